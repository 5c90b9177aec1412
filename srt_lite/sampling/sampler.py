"""The batched sampler: one pass over the batch's logits per step, no per-row Python loop
(except drawing the noise of seeded rows from their own generators).

Order: raw logprobs (if asked) -> float32 -> logit_bias, min_new_tokens bans -> penalties ->
greedy or temperature -> min_p -> top-k / top-p (one sort) -> exponential race argmax(p / q).
On the CPU with the C++ ops the sampled rows take one op (srt_lite_cpu::sample_rows) for the
same filters, drawing by the inverse of the kept mass with one uniform a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt_lite import cpu_kernels
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
            next_ids = greedy_argmax(logits)
        else:
            next_ids = self._sample(logits, info)
        out = SampleOutput(next_ids)
        if raw_logprobs is not None:
            out.logprobs = gather_logprobs(raw_logprobs, next_ids, logprob_req)
        return out

    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        if _cpp_rows(logits):
            return self._sample_cpp(logits, info)
        greedy_ids = greedy_argmax(logits)
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        if info.need_min_p:
            top = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < info.min_ps.unsqueeze(1) * top, 0.0)
        next_ids = greedy_ids.clone()
        sampled = (~info.is_greedy).nonzero().squeeze(1)
        if sampled.numel() == 0:
            return next_ids
        full_rows = sampled
        if info.need_top_k_top_p:
            # Filtered rows race over their best CANDIDATES tokens only, which is exact when
            # the row's top-k / top-p set lies inside them (nearly always); a full sort of
            # the vocabulary (slow on CPU) is kept for the rows where it does not.
            filt = sampled[(info.top_ks[sampled] < info.vocab_size) | (info.top_ps[sampled] < 1.0)]
            if filt.numel():
                vals, idx, ok = top_k_top_p_candidates(probs[filt], info.top_ks[filt], info.top_ps[filt])
                rows = filt[ok]
                if rows.numel():
                    pick = self._race(vals[ok], rows, info)
                    next_ids[rows] = idx[ok].gather(1, pick.unsqueeze(1)).squeeze(1)
                rest = filt[~ok]
                if rest.numel():
                    probs[rest] = top_k_top_p_filter(probs[rest], info.top_ks[rest], info.top_ps[rest])
                unfiltered = torch.ones_like(info.is_greedy)
                unfiltered[rows] = False
                full_rows = sampled[unfiltered[sampled]]
        if full_rows.numel():
            next_ids[full_rows] = self._race(probs[full_rows], full_rows, info)
        return next_ids

    def _sample_cpp(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """The sampled rows in one C++ call (srt_lite_cpu::sample_rows: the same filters, then
        one uniform a row picks by the kept tokens' cumulative mass), the greedy ones by
        greedy_argmax. Seeded rows draw their uniform from their own generator, one a step,
        so their tokens never depend on the rest of the batch."""
        sampled = (~info.is_greedy).nonzero().squeeze(1)  # [R]
        R = sampled.numel()
        if R == 0:
            return greedy_argmax(logits)
        u = self._uniforms(sampled, 1, info, torch.float64)[:, 0]  # [R]
        fields = (info.temperatures[:, 0], info.top_ks, info.top_ps, info.min_ps)
        if R == logits.shape[0]:  # every row sampled: no gathers, no greedy pass
            return torch.ops.srt_lite_cpu.sample_rows(logits, *fields, u)
        next_ids = greedy_argmax(logits)
        next_ids[sampled] = torch.ops.srt_lite_cpu.sample_rows(logits[sampled], *(f[sampled] for f in fields), u)
        return next_ids

    def _race(self, probs: torch.Tensor, rows: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Exponential race over probs [R, N] (rows `rows` of the batch): argmax(p / q) with
        q ~ Exp(1) picks column i with probability p_i / sum(p). q = -log(u) is used because
        it is several times faster than Tensor.exponential_ on CPU. Seeded rows draw their q
        from their own generator, so their choice never depends on the rest of the batch."""
        q = self._uniforms(rows, probs.shape[1], info).clamp_(min=1e-30).log_().neg_()
        return (probs / q).argmax(-1)

    def _uniforms(self, rows: torch.Tensor, n: int, info: SamplingBatchInfo,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[R, n] uniforms in [0, 1) for batch rows `rows`: from the sampler's generator, a
        seeded row's from its own (n a step), so its draws never depend on the rest of the
        batch."""
        u = torch.rand((rows.numel(), n), generator=self.generator, dtype=dtype, device=self.device)
        if info.has_seeded:
            for j, row in enumerate(rows.tolist()):
                gen = info.generators[row]
                if gen is not None:
                    u[j] = torch.rand(n, generator=gen, dtype=dtype, device=self.device)
        return u


def _cpp_rows(logits: torch.Tensor) -> bool:
    """Whether the C++ sampling ops take these logits: fp32 rows, contiguous, on the CPU
    outside a compiled graph."""
    return logits.dtype == torch.float32 and logits.stride(-1) == 1 and cpu_kernels.eager_cpu(logits)


# greedy_argmax scans the vocabulary in blocks of this many logits.
ARGMAX_BLOCK = 1024


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> [B] int64, the same as logits.argmax(-1) (the first maximum on ties)
    for rows without NaN. On the CPU, argmax over long rows is not vectorised while amax is,
    and is many times slower over a vocabulary-wide row: the C++ op takes each row in one
    vectorised pass (and equals argmax with NaN too). Without it: the maximum of each block of
    ARGMAX_BLOCK logits (amax), the first block holding the row's maximum, then argmax within
    that block."""
    B, V = logits.shape
    if V and _cpp_rows(logits):
        return torch.ops.srt_lite_cpu.argmax_rows(logits)
    n_blocks = -(-V // ARGMAX_BLOCK)
    if n_blocks < 4 or logits.stride(-1) != 1:
        return logits.argmax(-1)
    full = V // ARGMAX_BLOCK
    block_max = logits[:, : full * ARGMAX_BLOCK].view(B, full, ARGMAX_BLOCK).amax(-1)  # [B, full]
    if full < n_blocks:  # a shorter last block
        block_max = torch.cat([block_max, logits[:, full * ARGMAX_BLOCK :].amax(-1, keepdim=True)], 1)
    row_max = block_max.amax(-1, keepdim=True)  # [B, 1]
    block = (block_max == row_max).to(torch.uint8).argmax(-1, keepdim=True)  # [B, 1] first such block
    # Columns of that block; a short last block repeats its last column, after the real one,
    # so the first maximum is still found at its real position.
    cols = (block * ARGMAX_BLOCK + torch.arange(ARGMAX_BLOCK, device=logits.device)).clamp_(max=V - 1)  # [B, BLOCK]
    within = logits.gather(1, cols).argmax(-1, keepdim=True)  # [B, 1]
    return cols.gather(1, within).squeeze(1)


# Candidate tokens per filtered row; a fixed number, so that a seeded row draws the same
# amount of noise whatever else is in the batch.
CANDIDATES = 1024


def top_k_top_p_candidates(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, k: int = CANDIDATES
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-k / top-p filter restricted to each row's k best tokens.
    Returns kept probabilities [R, k] (zero where dropped), their token ids [R, k], and
    ok [R]: whether the row's exact filtered set lies inside those k tokens."""
    k = min(k, probs.shape[-1])
    vals, idx = probs.topk(k, dim=-1)  # sorted, descending
    vocab = probs.shape[-1]
    ranks = torch.arange(k, device=probs.device)
    drop = ranks[None, :] >= top_ks[:, None]
    kept = vals.masked_fill(drop, 0.0)
    # Mass of the row's top-k set: within the candidates when top_k fits, else (top_k off)
    # the whole row.
    total = torch.where(top_ks >= vocab, probs.sum(-1), kept.sum(-1))
    kept = kept / total[:, None]
    mass_before = kept.cumsum(-1) - kept
    drop |= mass_before > top_ps[:, None]
    drop[:, 0] = False
    # Exact iff the top-k set fits, or (top-k off) the nucleus closes within the candidates.
    # With k < top_k < vocab the top-k mass is unknown here: those rows take the full sort.
    ok = (top_ks <= k) | ((top_ks >= vocab) & (kept.sum(-1) > top_ps))
    return vals.masked_fill(drop, 0.0), idx, ok


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
