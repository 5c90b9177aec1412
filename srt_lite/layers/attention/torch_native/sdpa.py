"""Attention kernels the torch_native plans share: SDPA with its log-sum-exp, the merge of
two partial results, and the additive bias of a bool mask."""

from __future__ import annotations

import torch


def sdpa_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also returns each query's log-sum-exp, which the cascade's merge needs:
    q [B, H, Lq, D], k and v [B, H, Lk, D], attn_mask an additive bias broadcastable to
    [B, H, Lq, Lk] -> out [B, H, Lq, D] in q's dtype and lse [B, H, Lq] float32 (any strides).

    On the CPU, torch's flash kernel, which returns both. That op has a CPU kernel only, so
    other devices (CUDA without FlashInfer, or float32 on CUDA) take sdpa_with_lse_math."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=attn_mask, scale=scale)
    return sdpa_with_lse_math(q, k, v, attn_mask, scale)


def sdpa_with_lse_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """sdpa_with_lse in plain torch ops, computed in float32 whatever the input dtype: torch
    has no public attention op that returns the log-sum-exp on every device (the private
    CUDA ones that do put conditions on the mask's alignment and the head size). It holds
    the [B, H, Lq, Lk] scores, which the plans that use it keep small: short rows, or one
    shared prefix. A query that sees no key gets lse -inf and a zero output, so it adds no
    mass to a merge (such queries do not occur: padded query rows see one real key)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)  # [B, H, Lq, Lk]
    if attn_mask is not None:
        scores.add_(attn_mask.float())
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, Lq]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)  # a row of -inf alone gives NaN
    return torch.matmul(probs, v.float()).to(q.dtype), lse


def merge(
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


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask (True = attend) -> 0 / -inf bias of the same shape. SDPA would convert a
    bool mask again in every layer, so the plans hold the bias."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
