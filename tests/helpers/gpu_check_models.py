"""Tiny random models for the CUDA checks (tests/e2e/test_flashinfer.py, benchmarks/gpu_check.py).

FlashInfer's prefill kernels reject the head sizes of the CPU suite's tiny models (16 and 32:
"Invalid configuration"). These two use 64 and 128, the sizes real models use, and cover
both decode kernels: with 2 query heads per KV head FlashInfer decodes on CUDA cores, with 4
on tensor cores (SGLang's rule, see flashinfer_backend.py). Head dim 64 is also SmolLM2-135M's
(the default model), so the tiny llama and the served model share FlashInfer's JIT builds."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

_COMMON = dict(
    vocab_size=320,
    intermediate_size=256,
    num_hidden_layers=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

GPU_CASES = {
    # head_dim 64 = hidden / heads; 2 query heads per KV head: CUDA-core decode.
    "llama_hd64": lambda: LlamaConfig(**_COMMON, hidden_size=256, num_attention_heads=4, num_key_value_heads=2),
    # head_dim 128 set apart from hidden / heads (as Qwen3 does); 4 per KV head: tensor-core decode.
    "qwen3_hd128": lambda: Qwen3Config(
        **_COMMON, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=128
    ),
}


def make_gpu_tiny_model(kind: str, path: str | Path) -> str:
    """Saves the random model GPU_CASES[kind] (seeded) under path; returns the path."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPU_CASES[kind](), dtype=torch.float32)
    # Norm weights start at one; perturbed so that the q/k norms really take part.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return str(path)
