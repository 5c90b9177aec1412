"""The tiny reasoning-model fixture: greedy decoding with transformers reproduces its replies."""

from __future__ import annotations

import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_chat_model import greedy_text
from reasoning_model import PLAIN_REPLY, QUESTION, REASONING_REPLY, make_reasoning_model


def _greedy(model, tokenizer, **template_kwargs) -> str:
    return greedy_text(model, tokenizer, [{"role": "user", "content": QUESTION}], **template_kwargs)


def test_reasoning_model_fixture(tmp_path_factory):
    path = make_reasoning_model(str(tmp_path_factory.mktemp("reasoning_model")))
    assert make_reasoning_model(path) == path  # second call is cached

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["eos_token_id"] == 2
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == 2
    assert any(name.endswith(".safetensors") for name in os.listdir(path))

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"

    thinking_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    assert thinking_prompt.endswith("<|im_start|>assistant\n")
    plain_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False,
        enable_thinking=False,
    )
    assert plain_prompt == thinking_prompt + "<think>\n\n</think>\n\n"

    assert _greedy(model, tokenizer) == REASONING_REPLY + "<|im_end|>"
    assert _greedy(model, tokenizer, enable_thinking=False) == PLAIN_REPLY + "<|im_end|>"
