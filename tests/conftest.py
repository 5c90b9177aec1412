from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from srt_lite.model_config import ModelConfig  # noqa: E402
from srt_lite.model_loader.default_model import resolve_model_path  # noqa: E402

torch.manual_seed(0)


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The converted default model (converted into the user cache on first use)."""
    return resolve_model_path(None)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_model_config(default_model_dir) -> ModelConfig:
    return ModelConfig.load(default_model_dir)


def chat_ids(tokenizer, content: str) -> list[int]:
    """Token ids of a one-turn chat prompt, as the server builds them."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)
