"""A model directory's config.json and generation_config.json, read without transformers.

The scheduler and detokenizer processes need a dozen numbers from the config; importing
transformers for its config classes costs seconds of CPU in every one of them at every start.
Fields a file leaves out take the defaults of transformers' class for that model type (the
unit tests compare them field by field), so a model reads here as it does there.
"""

from __future__ import annotations

import json
import os
from typing import Any

# transformers' defaults (the config classes' constructor arguments) for the fields srt_lite
# reads, by model_type. A None head_dim or num_key_value_heads means "derived" (below).
_COMMON = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "vocab_size": 32000,
        "intermediate_size": 11008,
        "num_key_value_heads": None,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2": {
        **_COMMON,
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
    },
    "qwen3": {
        **_COMMON,
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "attention_bias": False,
        "head_dim": 128,
        "bos_token_id": None,
        "eos_token_id": None,
    },
}


class HFConfig:
    """config.json as attributes, with the model type's defaults filled in. A field neither
    the file nor the defaults name is absent (getattr with a default works as on a
    transformers config)."""

    def __init__(self, values: dict[str, Any]):
        self._values = dict(values)  # as the file has them, for transformers if it is needed
        self.__dict__.update(DEFAULTS.get(values.get("model_type"), {}))
        self.__dict__.update(values)
        if "num_attention_heads" in self.__dict__:
            if getattr(self, "num_key_value_heads", None) is None:
                self.num_key_value_heads = self.num_attention_heads
            if "head_dim" in self.__dict__ and self.head_dim is None:
                self.head_dim = self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict[str, Any]:
        """The file's own fields."""
        return dict(self._values)

    def to_transformers(self):
        """transformers' config object for the same file (imports transformers: only for the
        rare paths that need its code, such as scaled RoPE initialisers)."""
        from transformers import AutoConfig

        values = self.to_dict()
        return AutoConfig.for_model(values.pop("model_type"), **values)


def _read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        value = json.load(f)
    if not isinstance(value, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return value


def read_config(model_dir: str) -> HFConfig:
    return HFConfig(_read_json(os.path.join(model_dir, "config.json")))


def read_generation_config(model_dir: str) -> dict[str, Any]:
    """generation_config.json's fields ({} without one)."""
    path = os.path.join(model_dir, "generation_config.json")
    return _read_json(path) if os.path.isfile(path) else {}
