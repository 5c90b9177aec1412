"""The batched sampler: one pass over the batch's logits per step, no per-row Python loop
(except drawing the noise of seeded rows from their own generators).

Order: raw logprobs (if asked) -> float32 -> logit_bias, min_new_tokens bans -> penalties ->
greedy or temperature -> min_p -> top-k / top-p (one sort) -> exponential race argmax(p / q).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt_lite.sampling.penalties import apply_logit_adjustments
from srt_lite.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class LogprobRequest:
    """What logprobs the batch asks for; rows not listed get none."""

    rows: list[int]  # batch rows that want logprobs
    top_n: list[int]  # top_logprobs_num per listed row
    token_ids: list[list[int] | None]  # token_ids_logprob per listed row


@dataclass
class SampleOutput:
    next_ids: torch.Tensor  # [B] int64
    # Per listed row: (logprob of the sampled token, [(logprob, id)] top-n, [(logprob, id)] for token_ids)
    logprobs: dict[int, tuple[float, list, list | None]] | None = None


class Sampler:
    def __init__(self, seed: int, device: str):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, info: SamplingBatchInfo, logprob_req: LogprobRequest | None = None
    ) -> SampleOutput:
        """logits [B, V] -> next token ids [B] (and the asked-for raw logprobs)."""
        logits = logits.float()
        raw_logprobs = None
        if logprob_req is not None and logprob_req.rows:
            # The model's own distribution: before bias, penalties and temperature.
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if info.needs_adjustment:
            # On a copy: the caller's logits (and raw_logprobs' source) stay untouched.
            logits = apply_logit_adjustments(logits.clone(), info)
        if info.all_greedy:
            next_ids = logits.argmax(-1)
        else:
            next_ids = self._sample(logits, info)
        out = SampleOutput(next_ids)
        if raw_logprobs is not None:
            out.logprobs = gather_logprobs(raw_logprobs, next_ids, logprob_req)
        return out

    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        greedy_ids = logits.argmax(-1)
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        if info.need_min_p:
            top = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < info.min_ps.unsqueeze(1) * top, 0.0)
        if info.need_top_k_top_p:
            probs = top_k_top_p_filter(probs, info.top_ks, info.top_ps)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        if info.has_seeded:
            for row, gen in enumerate(info.generators):
                if gen is not None:
                    q[row].exponential_(generator=gen)
        # Exponential race: argmax(p_i / q_i), q ~ Exp(1), picks i with probability p_i / sum(p).
        sampled = (probs / q).argmax(-1)
        return torch.where(info.is_greedy, greedy_ids, sampled)


def top_k_top_p_filter(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Zeroes tokens outside each row's top-k and top-p nucleus, with one sort for the batch.
    probs [B, V]; top_ks [B] int; top_ps [B] float. A row always keeps its best token."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    drop = ranks[None, :] >= top_ks[:, None]
    # top-p over the top-k survivors, renormalised (as vLLM and SGLang do).
    kept = sorted_p.masked_fill(drop, 0.0)
    kept = kept / kept.sum(-1, keepdim=True)
    mass_before = kept.cumsum(-1) - kept
    drop |= mass_before > top_ps[:, None]
    drop[:, 0] = False
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill(drop, 0.0))


def gather_logprobs(
    logprobs: torch.Tensor, next_ids: torch.Tensor, req: LogprobRequest
) -> dict[int, tuple[float, list, list | None]]:
    """One device->host copy for the whole batch's logprob outputs."""
    rows = torch.tensor(req.rows, dtype=torch.int64, device=logprobs.device)
    lp = logprobs[rows]  # [R, V]
    chosen = lp.gather(1, next_ids[rows].view(-1, 1)).squeeze(1).tolist()
    k = max(req.top_n) if req.top_n else 0
    top_vals = top_ids = None
    if k > 0:
        top_vals, top_ids = lp.topk(k, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out = {}
    for j, row in enumerate(req.rows):
        n = req.top_n[j]
        top = list(zip(top_vals[j][:n], top_ids[j][:n])) if n > 0 else []
        ids = req.token_ids[j]
        by_id = list(zip(lp[j, ids].tolist(), ids)) if ids else None
        out[row] = (chosen[j], top, by_id)
    return out
