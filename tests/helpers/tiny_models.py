"""Tiny random Llama / Qwen2 / Qwen3 checkpoints written with transformers' config classes,
for the tests that compare srt_lite's model code with transformers'."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

CASES = {
    "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False),
    "llama_tied_bias": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True, attention_bias=True),
    "llama3_rope_scaling": lambda: LlamaConfig(
        **COMMON,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
}


def make_tiny_model(kind: str, path) -> str:
    torch.manual_seed(0)
    config = CASES[kind]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init of norms is all ones; perturb them so the q/k norms are really exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return str(path)


def make_tp_llama(path, hidden_size: int, vocab_size: int, max_positions: int, dtype: torch.dtype) -> str:
    """A servable tiny Llama for tensor parallelism: 8 query heads and 2 KV heads (tp=2 splits
    both, tp=4 replicates each KV head twice), saved with the default model's tokenizer."""
    from transformers import AutoTokenizer

    from srt_lite.model_loader.default_model import resolve_model_path

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=False,
    )
    AutoModelForCausalLM.from_config(cfg, dtype=dtype).save_pretrained(path)
    AutoTokenizer.from_pretrained(resolve_model_path(None)).save_pretrained(path)
    return str(path)
