"""Attention with torch's scaled_dot_product_attention, for any device (the CPU path).

The ragged batch is gathered into a padded one: queries [B, Lq, H, D] and the whole KV of
each request [B, Lk, Hkv, D] read from the pool through req_to_token, with a boolean mask
that is causal in absolute positions (a new token at position p sees slots 0..p of its own
request). One SDPA call covers prefill, prefill on top of a cached prefix, decode, and any mix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from srt_lite.layers.attention.base import AttentionBackend

if TYPE_CHECKING:
    from srt_lite.layers.radix_attention import RadixAttention
    from srt_lite.model_executor.forward_batch import ForwardBatch


@dataclass
class TorchNativeMetadata:
    kv_index: torch.Tensor  # [B, Lk] int64 pool slots (0 = padding slot)
    mask: torch.Tensor | None  # [B, 1, Lq, Lk] bool, True = attend; None = full causal single seq
    q_rows: torch.Tensor | None  # [T] batch row of each new token; None when no padding needed
    q_cols: torch.Tensor | None  # [T] index within the row
    max_q: int


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, device: str):
        self.device = device

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        B = fb.batch_size
        seq_lens = fb.seq_lens_cpu
        ext = fb.extend_seq_lens_cpu
        prefix = fb.extend_prefix_lens_cpu
        max_k, max_q = max(seq_lens), max(ext)
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_k].to(torch.int64)
        key_pos = torch.arange(max_k, device=self.device)  # [Lk]
        seq = fb.seq_lens.unsqueeze(1)  # [B, 1]
        key_valid = key_pos.unsqueeze(0) < seq  # [B, Lk]
        kv_index = rows.masked_fill(~key_valid, 0)

        if max_q == 1:
            # Decode (or all rows extend by one): the only constraint is the sequence length.
            meta = TorchNativeMetadata(kv_index, key_valid[:, None, None, :], None, None, 1)
        elif B == 1 and prefix[0] == 0:
            # A single fresh prompt: plain causal attention, no mask tensor needed.
            meta = TorchNativeMetadata(kv_index, None, None, None, max_q)
        else:
            ext_t = torch.tensor(ext, device=self.device)
            prefix_t = torch.tensor(prefix, device=self.device)
            q_rows = torch.repeat_interleave(torch.arange(B, device=self.device), ext_t)
            starts = torch.cumsum(ext_t, 0) - ext_t
            q_cols = torch.arange(fb.num_tokens, device=self.device) - starts[q_rows]
            q_idx = torch.arange(max_q, device=self.device)  # [Lq]
            q_abs = prefix_t[:, None] + q_idx[None, :]  # [B, Lq] absolute position
            mask = (key_pos[None, None, :] <= q_abs[:, :, None]) & key_valid[:, None, :]
            # Padded query rows attend to slot 0 only, so softmax never sees an empty row.
            q_pad = q_idx[None, :] >= ext_t[:, None]  # [B, Lq]
            mask[:, :, 0] |= q_pad
            meta = TorchNativeMetadata(kv_index, mask.unsqueeze(1), q_rows, q_cols, max_q)
        fb.attn_metadata = meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        fb: "ForwardBatch",
    ) -> torch.Tensor:
        meta: TorchNativeMetadata = fb.attn_metadata
        T = q.shape[0]
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k.view(T, Hkv, D), v.view(T, Hkv, D))

        B = fb.batch_size
        # index_select on the flat index is several times faster than advanced indexing.
        flat, lk = meta.kv_index.view(-1), meta.kv_index.shape[1]
        k_all = pool.k_buffer[layer.layer_id].index_select(0, flat).view(B, lk, Hkv, D)
        v_all = pool.v_buffer[layer.layer_id].index_select(0, flat).view(B, lk, Hkv, D)
        if meta.q_rows is None:
            q_pad = q.view(B, meta.max_q, H, D)
        else:
            q_pad = q.new_zeros(B, meta.max_q, H, D)
            q_pad[meta.q_rows, meta.q_cols] = q.view(T, H, D)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            k_all.transpose(1, 2).to(q.dtype),
            v_all.transpose(1, 2).to(q.dtype),
            attn_mask=meta.mask,
            is_causal=meta.mask is None,
            scale=layer.scaling,
            enable_gqa=H != Hkv,
        )  # [B, H, Lq, D]
        out = out.transpose(1, 2)  # [B, Lq, H, D]
        if meta.q_rows is not None:
            out = out[meta.q_rows, meta.q_cols]
        return out.reshape(T, H * D)
