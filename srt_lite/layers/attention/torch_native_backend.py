"""Attention with torch's scaled_dot_product_attention, for any device (the CPU path).

The ragged batch is split into up to three groups, each attended with one SDPA call:
- decode rows (one new token): queries [B, 1, H, D] against each request's whole KV
  [B, Lk, Hkv, D], gathered from the pool through req_to_token and padded to the longest,
  with a key-length mask;
- verify rows (a few new tokens on a long prefix: a decode step with speculative draft
  tokens): like extend rows, but the query heads of each KV head and the row's tokens are
  folded into one query axis [B, Hkv, G * Lq, D], which the CPU flash kernel runs about twice
  as fast as GQA over [B, H, Lq, D];
- extend rows (a prompt or a chunk of one, maybe after a cached prefix): queries padded to
  [B, Lq, H, D] with a mask that is causal in absolute positions (a new token at position p
  sees slots 0..p of its own request); a lone fresh prompt needs no mask at all.
Keeping them apart matters for mixed batches: padding 16 decode rows to a 500-token chunk
would multiply the attention work by the chunk length.

Short rows that share a long prefix (a radix-cache hit: the same KV slots at the start of
every row, e.g. a common system prompt or the n choices of one prompt) form one group, whatever
their kind, with cascade attention, FlashInfer's idea: all their queries attend to the shared
prefix once, as one sequence, the rows' suffixes are attended apart (row by row, or as one
masked sequence), and the two partial results are merged with their log-sum-exp weights. The
prefix KV is then read once per layer instead of once per row.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from srt_lite.layers import cpu_kernels
from srt_lite.layers.attention.base import AttentionBackend

if TYPE_CHECKING:
    from srt_lite.layers.radix_attention import RadixAttention
    from srt_lite.model_executor.forward_batch import ForwardBatch


@dataclass
class AttnGroup:
    """Rows of the batch attended by one SDPA call."""

    tok_idx: torch.Tensor | None  # [Tg] batch token index of each query; None = all tokens, in order
    kv_index: torch.Tensor  # [Bg, Lk] int64 pool slots (0 = padding slot)
    mask: torch.Tensor | None  # [Bg, 1, Lq, Lk] bool, True = attend; None = see `causal`
    q_rows: torch.Tensor | None  # [Tg] group row of each query; None when no padding is needed
    q_cols: torch.Tensor | None  # [Tg] index within the row
    max_q: int
    causal: bool = False  # without a mask: a fresh prompt (causal) or one decode row (all keys)
    # Query heads of a KV head folded with the row's tokens into one axis (decode, verify).
    folded: bool = False
    # Cascade: slots of the prefix every row shares; kv_index/mask then cover the suffixes.
    prefix_index: torch.Tensor | None = None  # [Lp] int64
    # The prefix's first slot when its slots are consecutive (a prompt prefilled in one go
    # gets a run of free slots): the layers then read it as a view instead of gathering it.
    prefix_start: int | None = None
    # `mask` as an additive 0 / -inf bias in the query dtype, built at the first layer (SDPA
    # would convert a bool mask again in every layer); [Bg, 1, G * Lq, Lk] when folded.
    bias: torch.Tensor | None = None
    # Cascade with the suffixes as one sequence: kv_index is then [S] (every row's suffix
    # slots, row after row) and mask [1, 1, Tg, S] (a query sees its own row's keys).
    token_suffix: bool = False
    # For the C++ op instead of the mask: where each row's queries and suffix keys start in
    # the group's queries and kv_index ([Bg + 1] int64 each, from 0 to Tg and S).
    q_offsets: torch.Tensor | None = None
    k_offsets: torch.Tensor | None = None


# Shortest shared prefix worth the cascade's extra kernels.
CASCADE_MIN_PREFIX = 64
# Rows with at most this many new tokens (and a prefix) are verify rows, attended folded.
VERIFY_MAX_Q = 16
# Rows with at most this many new tokens over a shared prefix join a cascade group.
CASCADE_MAX_Q = 32
# A cascade's suffixes are attended as one masked sequence when that has at most this many
# times the query-key pairs of padding each row's queries to the longest row (the CPU flash
# kernel ran ~270 GFLOP/s on one [Tg * G, S] call, ~60 on 8 small padded rows). With the C++
# op, whose suffix loop computes only each row's own pairs, when those are this many times
# fewer than the padded ones.
TOKEN_SUFFIX_GAIN = 4
# ...or, with the C++ op, when its exact suffix pairs are at most this many, whatever padding
# would cost: below it the padded path's Python op calls cost more than the loop (one layer at
# 8 rows of 4 tokens with 50 own keys: C++ 387 us, padded flash + prefix 326 us before ~80 us
# of Python; at ~13K pairs the padded flash is twice as fast).
TOKEN_SUFFIX_SMALL = 8192
# Dtypes the C++ cascade op computes in (q, KV pool and output alike), and the head sizes
# its vector loops take (a multiple of the widest vector, 16 floats, up to 256).
CPP_DTYPES = (torch.bfloat16, torch.float32)


def _cpp_cascade_ok(layer: "RadixAttention", dtype: torch.dtype) -> bool:
    return dtype in CPP_DTYPES and layer.head_dim % 16 == 0 and layer.head_dim <= 256


class TorchNativeAttnBackend(AttentionBackend):
    # Each layer's result is written straight into its padded output: slicing the padding
    # off and padding the result again cost two more copies per layer.
    takes_padded_rows = True

    def __init__(self, device: str, use_cpu_kernels: bool = True):
        self.device = device
        # The token cascade (decode and verify steps over a shared prefix) as one C++ op per
        # layer (_token_cascade_cpp), whose suffix part is exact per row instead of one masked
        # sequence; W3's recorded steps replayed ~10% faster eager (both changes together).
        self.cpu_kernels = use_cpu_kernels and device == "cpu" and cpu_kernels.load()

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        ext, prefix = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu

        def kind(b: int) -> int:
            if ext[b] == 1:
                return 0  # decode
            return 1 if ext[b] <= VERIFY_MAX_Q and prefix[b] > 0 else 2  # verify, extend

        parts: list[tuple[list[int], AttnGroup | None]] = []
        # Short rows over one shared prefix (decode and verify rows, a new prompt on a cached
        # prefix) go together: one cascade group reads the prefix once for all their queries.
        short = [b for b in range(fb.batch_size) if ext[b] <= CASCADE_MAX_Q and prefix[b] > 0]
        rest = list(range(fb.batch_size))
        # The C++ cascade op runs a step whose attention is one token cascade group.
        cpp = self.cpu_kernels and fb.token_to_kv_pool.dtype in CPP_DTYPES
        if len(short) > 1 and len(set(kind(b) for b in short)) > 1:
            cascade = self._group(fb, short, cascade_only=True, cpp=cpp and len(short) == fb.batch_size)
            if cascade is not None:
                parts.append((short, cascade))
                rest = [b for b in rest if b not in set(short)]
        kinds = [kind(b) for b in rest]
        parts += [(rows, None) for k in range(3) if (rows := [b for b, kb in zip(rest, kinds) if kb == k])]
        starts = [0, *itertools.accumulate(ext)]
        groups = []
        for rows, group in parts:
            group = group or self._group(fb, rows, cpp=cpp and len(parts) == 1)
            if len(parts) > 1:
                tok = [t for b in rows for t in range(starts[b], starts[b + 1])]
                group.tok_idx = torch.tensor(tok, dtype=torch.int64, device=self.device)
            groups.append(group)
        fb.attn_metadata = groups

    @contextlib.contextmanager
    def compiled_step(self, fb: "ForwardBatch", layers: dict):
        """A step that is one token cascade runs its attention in the compiled graph's C++ op
        (`srt_lite_cpu::attention`, see RadixAttention) with no Python per layer: the step's
        metadata goes to C++ once here. Other steps reach the Python op from there."""
        groups: list[AttnGroup] = fb.attn_metadata
        pool = fb.token_to_kv_pool
        layer = next(iter(layers.values()))
        one_cascade = len(groups) == 1 and groups[0].token_suffix
        if not (self.cpu_kernels and one_cascade and _cpp_cascade_ok(layer, pool.dtype)):
            yield
            return
        g = groups[0]
        torch.ops.srt_lite_cpu.set_cascade_step(
            fb.out_cache_loc, g.kv_index, g.q_offsets, g.k_offsets,
            -1 if g.prefix_start is None else g.prefix_start, g.prefix_index.shape[0], g.prefix_index,
            layer.num_heads, layer.scaling, pool.k_buffer, pool.v_buffer,
        )
        try:
            yield
        finally:
            torch.ops.srt_lite_cpu.clear_cascade_step()

    def _group(
        self, fb: "ForwardBatch", rows: list[int], cascade_only: bool = False, cpp: bool = False
    ) -> AttnGroup | None:
        """The group of these rows (ascending), tok_idx left None (all tokens) for the caller
        to set. With cascade_only, None unless they share a prefix worth a cascade and
        padding every row to the longest one wastes little. cpp: a token cascade of these
        rows would run in the C++ op (the step's only group)."""
        ext = [fb.extend_seq_lens_cpu[b] for b in rows]
        prefix = [fb.extend_prefix_lens_cpu[b] for b in rows]
        seq_lens = [p + e for p, e in zip(prefix, ext)]
        B, max_k, max_q = len(rows), max(seq_lens), max(ext)
        pool_rows = fb.req_pool_indices if B == fb.batch_size else fb.req_pool_indices[rows]
        slots = fb.req_to_token_pool.req_to_token[pool_rows, :max_k].to(torch.int64)
        key_pos = torch.arange(max_k, device=self.device)  # [Lk]
        seq = torch.tensor(seq_lens, device=self.device).unsqueeze(1)  # [B, 1]
        key_valid = key_pos.unsqueeze(0) < seq  # [B, Lk]
        kv_index = slots.masked_fill(~key_valid, 0)
        # Cascade needs rows whose shared slots are all before their new tokens.
        shared = self._shared_prefix_len(slots, min(prefix)) if B > 1 and max_q <= CASCADE_MAX_Q else 0
        # Suffix query-key pairs when each row's queries are padded to the longest row.
        padded = B * max_q * (max_k - shared)
        exact = sum(e * (k - shared) for e, k in zip(ext, seq_lens))  # each row's own suffix pairs
        if cpp:
            token = exact <= TOKEN_SUFFIX_SMALL or TOKEN_SUFFIX_GAIN * exact <= padded
        else:  # the suffixes as one masked sequence
            token = sum(ext) * (sum(seq_lens) - B * shared) <= TOKEN_SUFFIX_GAIN * padded
        if shared >= CASCADE_MIN_PREFIX and token:
            return self._token_cascade(kv_index, key_valid, shared, ext, prefix)
        if cascade_only:
            # Suffix queries are padded to the longest row; the prefix part is not padded.
            useful = exact + shared * sum(ext)
            if shared < CASCADE_MIN_PREFIX or padded > useful:
                return None
        if max_q == 1:
            if shared >= CASCADE_MIN_PREFIX:
                return AttnGroup(
                    None, kv_index[:, shared:], key_valid[:, None, None, shared:], None, None, 1,
                    folded=True, **_prefix(kv_index[0, :shared]),
                )
            # Decode: the only constraint is the sequence length (none for a single row).
            mask = key_valid[:, None, None, :] if B > 1 else None
            return AttnGroup(None, kv_index, mask, None, None, 1)
        if B == 1 and prefix[0] == 0:
            # A single fresh prompt: plain causal attention, no mask tensor needed.
            return AttnGroup(None, kv_index, None, None, None, max_q, causal=True)
        ext_t = torch.tensor(ext, device=self.device)
        prefix_t = torch.tensor(prefix, device=self.device)
        q_rows = torch.repeat_interleave(torch.arange(B, device=self.device), ext_t)
        starts = torch.cumsum(ext_t, 0) - ext_t
        q_cols = torch.arange(int(ext_t.sum()), device=self.device) - starts[q_rows]
        q_idx = torch.arange(max_q, device=self.device)  # [Lq]
        q_abs = prefix_t[:, None] + q_idx[None, :]  # [B, Lq] absolute position
        mask = (key_pos[None, None, :] <= q_abs[:, :, None]) & key_valid[:, None, :]
        q_pad = q_idx[None, :] >= ext_t[:, None]  # [B, Lq]
        if shared < CASCADE_MIN_PREFIX:
            shared = 0
        # Padded query rows attend to one real key only, so softmax never sees an empty row.
        mask[:, :, shared] |= q_pad
        if B == 1:
            q_rows = q_cols = None  # one row, no padding: a view is enough
        if max_q > VERIFY_MAX_Q and not shared:
            return AttnGroup(None, kv_index, mask.unsqueeze(1), q_rows, q_cols, max_q)
        return AttnGroup(
            None, kv_index[:, shared:], mask[:, None, :, shared:], q_rows, q_cols, max_q, folded=True,
            **(_prefix(kv_index[0, :shared]) if shared else {}),
        )

    def _token_cascade(
        self, kv_index: torch.Tensor, key_valid: torch.Tensor, shared: int, ext: list[int], prefix: list[int]
    ) -> AttnGroup:
        """A cascade group whose suffix part is one sequence too: every row's suffix keys
        concatenated, attended by all the group's queries (unpadded, as for the prefix) under
        a mask that lets a query see its own row's keys up to its position. One large call
        runs ~4x faster per pair on the CPU than B small padded ones, and the suffix output
        then has the prefix output's layout (no padding, no reordering)."""
        B = len(ext)
        ext_t = torch.tensor(ext, device=self.device)
        q_row = torch.repeat_interleave(torch.arange(B, device=self.device), ext_t)  # [T]
        starts = torch.cumsum(ext_t, 0) - ext_t
        q_col = torch.arange(int(ext_t.sum()), device=self.device) - starts[q_row]  # index within its row
        q_abs = torch.tensor(prefix, device=self.device)[q_row] + q_col  # [T] absolute position
        valid = key_valid[:, shared:]  # [B, Ls]
        ls = valid.shape[1]
        key_row = torch.arange(B, device=self.device)[:, None].expand(B, ls)[valid]  # [S]
        key_abs = (shared + torch.arange(ls, device=self.device))[None, :].expand(B, ls)[valid]  # [S]
        mask = (key_row[None, :] == q_row[:, None]) & (key_abs[None, :] <= q_abs[:, None])  # [T, S]
        suffix_lens = [p + e - shared for p, e in zip(prefix, ext)]
        return AttnGroup(
            None, kv_index[:, shared:][valid], mask[None, None], None, None, max(ext), folded=True,
            token_suffix=True, **_prefix(kv_index[0, :shared]),
            q_offsets=torch.tensor([0, *itertools.accumulate(ext)], dtype=torch.int64),
            k_offsets=torch.tensor([0, *itertools.accumulate(suffix_lens)], dtype=torch.int64),
        )

    @staticmethod
    def _shared_prefix_len(slots: torch.Tensor, limit: int) -> int:
        """Positions at the start (at most `limit`) where every row has the same KV slot."""
        n = min(limit, slots.shape[1])
        if n <= 0:
            return 0
        same = (slots[:, :n] == slots[:1, :n]).all(0)  # [n]
        return int(same.cumprod(0).sum())

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        fb: "ForwardBatch",
    ) -> torch.Tensor:
        T, rows = fb.num_tokens, q.shape[0]
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        pool = fb.token_to_kv_pool
        groups: list[AttnGroup] = fb.attn_metadata
        out = q.new_empty(rows, H * D)
        if rows != T:
            out[T:].zero_()
        if (
            len(groups) == 1 and groups[0].token_suffix and self.cpu_kernels
            and pool.dtype == q.dtype and _cpp_cascade_ok(layer, q.dtype)
        ):
            _token_cascade_cpp(q, k, v, groups[0], layer, fb, out)
            return out
        if rows != T:  # rows past T pad the token axis to a row bucket: no KV, zero output
            q, k, v = q[:T], k[:T], v[:T]
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k.view(T, Hkv, D), v.view(T, Hkv, D))
        k_buf, v_buf = pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id]
        if len(groups) == 1:
            self._attend(q, k_buf, v_buf, groups[0], layer, out[:T])
            return out
        for g in groups:
            out.index_copy_(0, g.tok_idx, self._attend(q.index_select(0, g.tok_idx), k_buf, v_buf, g, layer))
        return out

    @staticmethod
    def _attend(
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        g: AttnGroup,
        layer: "RadixAttention",
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [Tg, H * D] -> [Tg, H * D] for the rows of one group, written into `out` when
        given (a [Tg, H * D] view whose rows are contiguous)."""
        if g.folded:
            return TorchNativeAttnBackend._attend_folded(q, k_buf, v_buf, g, layer, out)
        T = q.shape[0]
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        B, lk = g.kv_index.shape
        # index_select on the flat index is several times faster than advanced indexing.
        flat = g.kv_index.view(-1)
        k_all = k_buf.index_select(0, flat).view(B, lk, Hkv, D)
        v_all = v_buf.index_select(0, flat).view(B, lk, Hkv, D)
        q_pad = _pad_queries(q, g, H, D)
        if g.mask is not None and (g.bias is None or g.bias.dtype != q.dtype):
            g.bias = _additive(g.mask, q.dtype)
        o = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            k_all.transpose(1, 2).to(q.dtype),
            v_all.transpose(1, 2).to(q.dtype),
            attn_mask=g.bias,
            is_causal=g.causal,
            scale=layer.scaling,
            enable_gqa=H != Hkv,
        ).transpose(1, 2)  # [B, Lq, H, D]
        if g.q_rows is not None:
            o = o[g.q_rows, g.q_cols]  # [Tg, H, D]
        return _write(o, out, T)

    @staticmethod
    def _attend_folded(
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        g: AttnGroup,
        layer: "RadixAttention",
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """Decode, verify or short extend rows, q [Tg, H * D] -> [Tg, H * D]. The G query
        heads of each KV head and the Lq tokens of a row become G * Lq query rows, so no GQA
        expansion is needed. With a shared prefix (cascade), all the group's queries attend
        to it in one call, unpadded, each row to its own suffix in another, and the two are
        merged by their log-sum-exp."""
        if g.token_suffix:
            return TorchNativeAttnBackend._attend_token_cascade(q, k_buf, v_buf, g, layer, out)
        T = q.shape[0]
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        G, Lq = H // Hkv, g.max_q
        B, ls = g.kv_index.shape
        q_pad = _pad_queries(q, g, H, D)  # [B, Lq, H, D]
        # Row order within a KV head: (g, t), so the mask of token t repeats G times.
        qf = q_pad.view(B, Lq, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Lq, D)
        if g.bias is None or g.bias.dtype != q.dtype:
            g.bias = _additive(g.mask, q.dtype).repeat(1, 1, G, 1)  # [B, 1, G * Lq, Ls]
        flat = g.kv_index.reshape(-1)
        k_suf = k_buf.index_select(0, flat).view(B, ls, Hkv, D).transpose(1, 2).to(q.dtype)
        v_suf = v_buf.index_select(0, flat).view(B, ls, Hkv, D).transpose(1, 2).to(q.dtype)
        # [B, Hkv, G * Lq, D] and [B, Hkv, G * Lq]
        o_suf, lse_suf = sdpa_with_lse(qf, k_suf, v_suf, attn_mask=g.bias, scale=layer.scaling)
        if g.prefix_index is None:
            o = o_suf.view(B, Hkv, G, Lq, D).permute(0, 3, 1, 2, 4)  # [B, Lq, Hkv, G, D]
            if g.q_rows is not None:
                o = o[g.q_rows, g.q_cols]  # [Tg, Hkv, G, D]
            return _write(o, out, T)
        # Back to token order: [Tg, Hkv, G, D] and [Tg, Hkv, G].
        o_suf = o_suf.view(B, Hkv, G, Lq, D).permute(0, 3, 1, 2, 4)
        lse_suf = lse_suf.view(B, Hkv, G, Lq).permute(0, 3, 1, 2)
        if g.q_rows is not None:
            o_suf, lse_suf = o_suf[g.q_rows, g.q_cols], lse_suf[g.q_rows, g.q_cols]
        else:
            o_suf, lse_suf = o_suf.reshape(T, Hkv, G, D), lse_suf.reshape(T, Hkv, G)
        # Prefix: one sequence whose Tg * G queries per KV head all see every prefix token.
        q_seq = q.view(T, Hkv, G, D).transpose(0, 1).reshape(1, Hkv, T * G, D)
        o_pre, lse_pre = _attend_prefix(q_seq, k_buf, v_buf, g, layer.scaling)
        o_pre = o_pre.view(Hkv, T, G, D).transpose(0, 1)  # [Tg, Hkv, G, D]
        lse_pre = lse_pre.view(Hkv, T, G).transpose(0, 1)  # [Tg, Hkv, G]
        if out is None:
            return _merge(o_suf, lse_suf, o_pre, lse_pre).reshape(T, H * D)
        _merge(o_suf, lse_suf, o_pre, lse_pre, out.view(T, Hkv, G, D))
        return out

    @staticmethod
    def _attend_token_cascade(
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        g: AttnGroup,
        layer: "RadixAttention",
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """q [Tg, H * D] -> [Tg, H * D]: the prefix and the concatenated suffixes are each
        one sequence attended by all Tg * G queries of a KV head, merged by log-sum-exp."""
        T = q.shape[0]
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        G, S = H // Hkv, g.kv_index.shape[0]
        q_seq = q.view(T, Hkv, G, D).transpose(0, 1).reshape(1, Hkv, T * G, D)  # row t * G + g
        k_suf = k_buf.index_select(0, g.kv_index).view(1, S, Hkv, D).transpose(1, 2).to(q.dtype)
        v_suf = v_buf.index_select(0, g.kv_index).view(1, S, Hkv, D).transpose(1, 2).to(q.dtype)
        bias = _token_bias(g, q.dtype, G)
        o_suf, lse_suf = sdpa_with_lse(q_seq, k_suf, v_suf, attn_mask=bias, scale=layer.scaling)
        o_pre, lse_pre = _attend_prefix(q_seq, k_buf, v_buf, g, layer.scaling)
        # [1, Hkv, Tg * G, D] -> token order, merged straight into the output's layout.
        o_suf, o_pre = o_suf.view(Hkv, T, G, D), o_pre.view(Hkv, T, G, D)
        lse_suf, lse_pre = lse_suf.view(Hkv, T, G), lse_pre.view(Hkv, T, G)
        if out is None:
            out = q.new_empty(T, H * D)
        _merge(o_suf, lse_suf, o_pre, lse_pre, out.view(T, Hkv, G, D).transpose(0, 1))
        return out


def _token_cascade_cpp(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: AttnGroup, layer: "RadixAttention",
    fb: "ForwardBatch", out: torch.Tensor,
) -> None:
    """The KV store and _attend_token_cascade in one C++ call (csrc/cpu_attention.cpp), without
    ~40 Python op calls a layer, and with each row's suffix attended on its own keys only (no
    mask over every row's); q, k, v and out may have padded rows."""
    pool, lid = fb.token_to_kv_pool, layer.layer_id
    torch.ops.srt_lite_cpu.cascade_attention(
        q, k, v, pool.k_buffer[lid], pool.v_buffer[lid], fb.out_cache_loc, g.kv_index, g.q_offsets, g.k_offsets,
        -1 if g.prefix_start is None else g.prefix_start, g.prefix_index.shape[0], g.prefix_index,
        layer.num_heads, layer.scaling, out,
    )


def _attend_prefix(
    q_seq: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, g: AttnGroup, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cascade's shared prefix attended by q_seq [1, Hkv, M, D] as one sequence:
    returns the output [1, Hkv, M, D] and its log-sum-exp [1, Hkv, M]."""
    lp, Hkv, D = g.prefix_index.shape[0], q_seq.shape[1], q_seq.shape[3]
    if g.prefix_start is not None:
        k_pre, v_pre = k_buf[g.prefix_start : g.prefix_start + lp], v_buf[g.prefix_start : g.prefix_start + lp]
    else:
        k_pre, v_pre = k_buf.index_select(0, g.prefix_index), v_buf.index_select(0, g.prefix_index)
    k_pre = k_pre.view(1, lp, Hkv, D).transpose(1, 2).to(q_seq.dtype)  # [1, Hkv, Lp, D]
    v_pre = v_pre.view(1, lp, Hkv, D).transpose(1, 2).to(q_seq.dtype)
    return sdpa_with_lse(q_seq, k_pre, v_pre, scale=scale)


def sdpa_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also returns each query's log-sum-exp, which the cascade's merge needs:
    q [B, H, Lq, D], k and v [B, H, Lk, D], attn_mask an additive bias broadcastable to
    [B, H, Lq, Lk] -> out [B, H, Lq, D] in q's dtype and lse [B, H, Lq] float32 (any strides).

    On the CPU, torch's flash kernel, which returns both. That op has a CPU kernel only, so
    other devices (CUDA without FlashInfer, or float32 on CUDA) take _sdpa_with_lse_math."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=attn_mask, scale=scale)
    return _sdpa_with_lse_math(q, k, v, attn_mask, scale)


def _sdpa_with_lse_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """sdpa_with_lse in plain torch ops, computed in float32 whatever the input dtype: torch
    has no public attention op that returns the log-sum-exp on every device (the private
    CUDA ones that do put conditions on the mask's alignment and the head size). It holds
    the [B, H, Lq, Lk] scores, which the groups that use it keep small: short rows, or one
    shared prefix. A query that sees no key gets lse -inf and a zero output, so it adds no
    mass to a merge (such queries do not occur: padded query rows see one real key)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)  # [B, H, Lq, Lk]
    if attn_mask is not None:
        scores.add_(attn_mask.float())
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, Lq]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)  # a row of -inf alone gives NaN
    return torch.matmul(probs, v.float()).to(q.dtype), lse


def _merge(
    o_suf: torch.Tensor,
    lse_suf: torch.Tensor,
    o_pre: torch.Tensor,
    lse_pre: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax over the union of two key sets from each part's output [..., D] and
    log-sum-exp [...]: the parts weighted by their shares of the total mass, the prefix's
    share being sigmoid(lse_pre - lse_suf). Written into `out` (any strides) when given."""
    w_pre = torch.sigmoid_(lse_pre - lse_suf).unsqueeze(-1).to(o_suf.dtype)
    if out is None:
        return torch.lerp(o_suf, o_pre, w_pre)
    return torch.lerp(o_suf, o_pre, w_pre, out=out)


def _write(o: torch.Tensor, out: torch.Tensor | None, T: int) -> torch.Tensor:
    """An attention output whose leading dims are the T tokens in order ([T, ...] or
    [B, Lq, ...] with B * Lq = T, any strides) as [T, H * D]: one copy, into `out` when
    given."""
    if out is None:
        return o.reshape(T, -1)
    out.view(o.shape).copy_(o)
    return out


def _token_bias(g: AttnGroup, dtype: torch.dtype, G: int) -> torch.Tensor:
    """A token cascade's suffix mask as a bias [1, 1, Tg * G, S] (query row t * G + g),
    built at the first layer of the step."""
    if g.bias is None or g.bias.dtype != dtype:
        g.bias = _additive(g.mask, dtype).repeat_interleave(G, dim=2)
    return g.bias


def _prefix(index: torch.Tensor) -> dict:
    """AttnGroup fields for a cascade prefix with these slots ([Lp] int64)."""
    index = index.contiguous()
    start = int(index[0])
    consecutive = bool((index == torch.arange(start, start + index.numel(), device=index.device)).all())
    return {"prefix_index": index, "prefix_start": start if consecutive else None}


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask (True = attend) -> 0 / -inf bias of the same shape."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _pad_queries(q: torch.Tensor, g: AttnGroup, H: int, D: int) -> torch.Tensor:
    """q [Tg, H * D] -> [Bg, Lq, H, D], zero rows where a request has fewer tokens."""
    B = g.kv_index.shape[0]
    if g.q_rows is None:
        return q.view(B, g.max_q, H, D)
    q_pad = q.new_zeros(B, g.max_q, H, D)
    q_pad[g.q_rows, g.q_cols] = q.view(q.shape[0], H, D)
    return q_pad
