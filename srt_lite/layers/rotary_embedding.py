"""Rotary position embedding (the rotate-half / GPT-NeoX layout Hugging Face Llama uses).

Inverse frequencies come from the config's `rope_parameters`: the default formula here, and
transformers' own initialisers for scaled variants (linear, llama3, yarn, longrope, ...), so
our frequencies are the reference's by construction.
"""

from __future__ import annotations

import torch
from torch import nn

from srt_lite import cpu_kernels


def _rope_parameters(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # transformers 4.x style configs
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_type", params.get("type", "default"))
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def compute_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    inv_freq, scaling = _inv_freq(hf_config, head_dim)
    # A GGUF file of a llama3-style model carries its scaled RoPE as one factor per frequency
    # (llama.cpp's rope_freqs tensor), which divides the frequency.
    factors = getattr(hf_config, "rope_freq_factors", None)
    if factors is not None:
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq, scaling


def _inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = _rope_parameters(hf_config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        partial = params.get("partial_rotary_factor", 1.0)
        dim = int(head_dim * partial)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    # The initialisers read transformers' own config object (its standardised RoPE fields).
    reference = hf_config.to_transformers() if hasattr(hf_config, "to_transformers") else hf_config
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](reference, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_position: int):
        super().__init__()
        self.head_dim = head_dim
        inv_freq, scaling = compute_inv_freq(hf_config, head_dim)
        self.rotary_dim = inv_freq.numel() * 2
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim / 2]
        # Kept in float32; cast to the activation dtype at use, as transformers does.
        self.register_buffer("cos_cache", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * scaling, persistent=False)
        self._lookup: tuple | None = None  # (positions, dtype, cos, sin) of the current pass

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (query and key heads together) -> a rotated copy."""
        cos, sin = self._cos_sin(positions, x.dtype)
        if self.rotary_dim == x.shape[-1]:
            # x * [cos, cos] + [x2, x1] * [-sin, sin]: HF's x*cos + rotate_half(x)*sin with
            # the sign moved into the table; each product and sum rounds as HF's does.
            if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] and cpu_kernels.eager_cpu(x):
                return torch.ops.srt_lite_cpu.rope(x, cos, sin)  # one call, the same rounding
            half = self.rotary_dim // 2
            return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((rot * cos + torch.cat(rot.chunk(2, dim=-1)[::-1], dim=-1) * sin, rest), dim=-1)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[cos, cos] and [-sin, sin] rows for `positions` ([T, 1, rotary_dim] each), looked
        up once per forward pass: every layer shares this module and passes the same
        positions tensor (held here, so `is` cannot be fooled)."""
        if torch.compiler.is_compiling() or (positions.is_cuda and torch.cuda.is_current_stream_capturing()):
            # Traced or captured: the lookup itself must be part of the graph, which later
            # replays it for other positions (a cached result would be baked in).
            return self._lookup_cos_sin(positions, dtype)
        cached = self._lookup
        if cached is None or cached[0] is not positions or cached[1] != dtype:
            cached = self._lookup = (positions, dtype, *self._lookup_cos_sin(positions, dtype))
        return cached[2], cached[3]

    def _lookup_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cache.index_select(0, positions).to(dtype)  # [T, rot/2]
        sin = self.sin_cache.index_select(0, positions).to(dtype)
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)
