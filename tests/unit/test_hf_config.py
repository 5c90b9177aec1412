"""config.json read without transformers (srt_lite/model_loader/hf_config.py) gives what
transformers' config classes give, for the fields srt_lite reads: every default, the derived
head_dim and KV heads, RoPE frequencies of every scaling type, end tokens and sampling
defaults from generation_config.json."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, GenerationConfig

from srt_lite.layers.rotary_embedding import compute_inv_freq
from srt_lite.model_config import ModelConfig
from srt_lite.model_loader.hf_config import DEFAULTS, HFConfig, read_config, read_generation_config
from srt_lite.models.registry import _MODULES, get_model_class, model_class_name

MISSING = object()
# Every config field that srt_lite's models, loader and ModelConfig read.
FIELDS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size",
    "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias", "eos_token_id",
    "bos_token_id", "hidden_act",
)
ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SHAPES = [
    {},  # every field from the defaults
    {"hidden_size": 256, "num_attention_heads": 8, "num_hidden_layers": 2, "intermediate_size": 512},
    {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
     "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "eos_token_id": [5, 6]},
]


@pytest.mark.parametrize("model_type", sorted(DEFAULTS))
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_fields_equal_transformers(model_type, shape):
    values = {"model_type": model_type, "architectures": [ARCH[model_type]], **SHAPES[shape]}
    ours = HFConfig(values)
    theirs = AutoConfig.for_model(**values)
    for field in FIELDS:
        assert getattr(ours, field, MISSING) == getattr(theirs, field, MISSING), field


@pytest.mark.parametrize("rope", [
    {"rope_theta": 500000.0},
    {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
    {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
], ids=["theta", "linear", "llama3", "yarn", "v5-parameters"])
def test_rope_frequencies_equal_transformers(rope):
    values = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
              "num_attention_heads": 4, "max_position_embeddings": 8192, **rope}
    ours_freq, ours_scale = compute_inv_freq(HFConfig(values), 64)
    ref_freq, ref_scale = compute_inv_freq(AutoConfig.for_model(**values), 64)
    torch.testing.assert_close(ours_freq, ref_freq, rtol=0, atol=0)
    assert ours_scale == ref_scale


def test_model_config_reads_a_directory_as_transformers_does(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 300,
        "eos_token_id": 7,
    }))
    gen = {"eos_token_id": [7, 9], "temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    cfg = ModelConfig.load(str(tmp_path))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 128, 300)
    assert cfg.context_len == AutoConfig.from_pretrained(tmp_path).max_position_embeddings == 32768
    assert cfg.eos_token_ids == [7, 9]
    explicit = GenerationConfig.from_pretrained(tmp_path).to_diff_dict()
    assert cfg.generation_defaults == {k: explicit[k] for k in ("temperature", "top_p", "top_k")}
    (tmp_path / "generation_config.json").unlink()
    assert read_generation_config(str(tmp_path)) == {}
    assert ModelConfig.load(str(tmp_path)).eos_token_ids == [7]


def test_a_config_that_is_not_an_object_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        read_config(str(tmp_path))


def test_registry_names_each_modules_own_classes():
    for name in _MODULES:
        assert get_model_class([name]).__name__ == name
        assert model_class_name([name.replace("ForCausalLM", "Model")]) == name
    with pytest.raises(ValueError, match="unsupported model architecture"):
        model_class_name(["GPT2LMHeadModel"])
