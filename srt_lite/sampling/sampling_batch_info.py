"""SamplingBatchInfo: the sampling parameters of a batch as tensors, one row per request.

The running (decode) batch keeps one instance for its whole life: `filter` drops the rows of
finished requests and `merge` appends newly prefilled ones, so nothing is rebuilt per step.
Penalty state is incremental: `update` adds each step's sampled tokens to the counts.
Optional state (logit_bias, penalties, min-token bans) exists only while some row needs it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from srt_lite.req import Req


@dataclass
class SamplingBatchInfo:
    vocab_size: int
    device: str
    temperatures: torch.Tensor  # [B, 1] float32 (1.0 on greedy rows, unused there)
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, vocab size when disabled
    min_ps: torch.Tensor  # [B] float32
    is_greedy: torch.Tensor  # [B] bool
    # Per-request generators for seeded rows (None elsewhere); they live on the Req, so a
    # request draws the same noise whoever shares its batch, and across retraction.
    generators: list[torch.Generator | None]
    # Each row's logit_bias as (token ids, biases), None for a row without one; the list is
    # None when no row has one. Sparse, because the usual bias is one or two tokens (e.g.
    # suppressing EOS) and a dense [B, V] one cost a pass over the logits every step and a
    # [B, V] copy whenever rows are filtered, merged or repeated for verification.
    logit_bias: list[tuple[list[int], list[float]] | None] | None = None
    # min_new_tokens: rows with min_tokens_left > 0 cannot produce their stop ids yet.
    min_tokens_left: torch.Tensor | None = None  # [B] int64
    min_tokens_ban: torch.Tensor | None = None  # [B, V] bool, the ids each row may not end with
    # Penalties (vLLM semantics): repetition over prompt and output tokens, frequency and
    # presence over output tokens.
    rep_penalties: torch.Tensor | None = None  # [B, 1] float32
    freq_penalties: torch.Tensor | None = None  # [B, 1] float32
    pres_penalties: torch.Tensor | None = None  # [B, 1] float32
    output_counts: torch.Tensor | None = None  # [B, V] float32, occurrences in the output
    prompt_mask: torch.Tensor | None = None  # [B, V] bool, token appears in the prompt
    # Structured output: each row's grammar matcher (constrained.base.GrammarMatcher), None
    # for a free row; the list is None when no row has one. The matchers live on the Reqs.
    grammars: list | None = None

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_reqs(cls, reqs: list["Req"], vocab_size: int, device: str, eos_ids: set[int]) -> "SamplingBatchInfo":
        params = [r.sampling_params for r in reqs]
        greedy = [p.is_greedy for p in params]
        B, V = len(reqs), vocab_size

        def col(values, dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        info = cls(
            vocab_size=V,
            device=device,
            temperatures=col([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32).unsqueeze(1),
            top_ps=col([p.top_p for p in params], torch.float32),
            top_ks=col([V if p.top_k == -1 else min(p.top_k, V) for p in params], torch.int64),
            min_ps=col([p.min_p for p in params], torch.float32),
            is_greedy=col(greedy, torch.bool),
            # A chunk that stops short of the prompt's end samples a token nobody keeps: it
            # must not draw from the request's own generator, or a seeded request's noise
            # would depend on how its prompt was chunked.
            generators=[None if r.stops_mid_prompt else r.generator for r in reqs],
        )
        if any(r.grammar is not None for r in reqs):
            info.grammars = [r.grammar for r in reqs]
        if any(p.logit_bias for p in params):
            info.logit_bias = [
                ([int(t) for t in p.logit_bias], [float(b) for b in p.logit_bias.values()]) if p.logit_bias else None
                for p in params
            ]
        left = [max(p.min_new_tokens - len(r.output_ids), 0) for p, r in zip(params, reqs)]
        if any(left):
            info.min_tokens_left = col(left, torch.int64)
            info.min_tokens_ban = torch.zeros(B, V, dtype=torch.bool, device=device)
            for i, p in enumerate(params):
                # A grammar decides when its text may end: a ban on the stop ids could
                # leave it no token at all.
                if left[i] and reqs[i].grammar is None:
                    banned = set(p.stop_token_ids or []) | (set() if p.ignore_eos else eos_ids)
                    info.min_tokens_ban[i, list(banned)] = True
        if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params):
            info.rep_penalties = col([p.repetition_penalty for p in params], torch.float32).unsqueeze(1)
            info.freq_penalties = col([p.frequency_penalty for p in params], torch.float32).unsqueeze(1)
            info.pres_penalties = col([p.presence_penalty for p in params], torch.float32).unsqueeze(1)
            # Counted once here from the request's history (it may be a resumed request);
            # from then on `update` keeps them current.
            info.output_counts = torch.zeros(B, V, dtype=torch.float32, device=device)
            info.prompt_mask = torch.zeros(B, V, dtype=torch.bool, device=device)
            for i, r in enumerate(reqs):
                if r.output_ids:
                    ids = torch.tensor(r.output_ids, dtype=torch.int64, device=device)
                    info.output_counts[i].index_add_(0, ids, torch.ones(len(ids), device=device))
                info.prompt_mask[i, r.origin_input_ids] = True
        info._refresh_flags()
        return info

    def _refresh_flags(self) -> None:
        self.all_greedy = bool(self.is_greedy.all())
        self.need_top_k_top_p = bool((self.top_ks < self.vocab_size).any() or (self.top_ps < 1.0).any())
        self.need_min_p = bool((self.min_ps > 0).any())
        self.has_seeded = any(g is not None for g in self.generators)
        if self.output_counts is not None:
            active = (self.rep_penalties != 1.0) | (self.freq_penalties != 0) | (self.pres_penalties != 0)
            self.penalized_rows = active.squeeze(1).nonzero().squeeze(1)
        self.needs_adjustment = (
            self.logit_bias is not None
            or self.min_tokens_left is not None
            or self.output_counts is not None
            or self.grammars is not None
        )

    def logit_bias_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The logit_bias entries as (rows [N], token ids [N], biases [N] float32)."""
        rows, ids, vals = [], [], []
        for b, entry in enumerate(self.logit_bias):
            if entry:
                rows += [b] * len(entry[0])
                ids += entry[0]
                vals += entry[1]
        return (
            torch.tensor(rows, dtype=torch.int64, device=self.device),
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.tensor(vals, dtype=torch.float32, device=self.device),
        )

    @property
    def batch_size(self) -> int:
        return int(self.temperatures.shape[0])

    # ---- keeping rows aligned with the batch's requests ---------------------------------

    _ROW_TENSORS = (
        "temperatures", "top_ps", "top_ks", "min_ps", "is_greedy", "min_tokens_left",
        "min_tokens_ban", "rep_penalties", "freq_penalties", "pres_penalties", "output_counts", "prompt_mask",
    )
    # Value of an absent optional tensor's rows when merging with a batch that has it.
    _NEUTRAL = {
        "min_tokens_left": 0, "min_tokens_ban": False, "rep_penalties": 1.0,
        "freq_penalties": 0.0, "pres_penalties": 0.0, "output_counts": 0.0, "prompt_mask": False,
    }

    def filter(self, keep: list[int]) -> None:
        """Keeps rows `keep` (in that order)."""
        idx = torch.tensor(keep, dtype=torch.int64, device=self.device)
        for name in self._ROW_TENSORS:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[idx])
        self.generators = [self.generators[i] for i in keep]
        if self.grammars is not None:
            self.grammars = [self.grammars[i] for i in keep]
            if all(g is None for g in self.grammars):
                self.grammars = None
        if self.logit_bias is not None:
            self.logit_bias = [self.logit_bias[i] for i in keep]
            if not any(self.logit_bias):
                self.logit_bias = None
        if self.min_tokens_left is not None and not bool(self.min_tokens_left.any()):
            self.min_tokens_left = self.min_tokens_ban = None
        self._refresh_flags()

    def repeat_rows(self, counts: list[int]) -> "SamplingBatchInfo":
        """A new info whose row b appears counts[b] times (to sample several positions of one
        request, as speculative verification does); self is unchanged."""
        idx = torch.repeat_interleave(torch.arange(len(counts), device=self.device), torch.tensor(counts, device=self.device))
        out = dataclasses.replace(self)
        for name in self._ROW_TENSORS:
            t = getattr(self, name)
            if t is not None:
                setattr(out, name, t.index_select(0, idx))
        out.generators = [g for g, n in zip(self.generators, counts) for _ in range(n)]
        if self.grammars is not None:
            # Only a row's first position may be constrained: constrained rows never draft.
            out.grammars = [g for g, n in zip(self.grammars, counts) for _ in range(n)]
        if self.logit_bias is not None:
            out.logit_bias = [e for e, n in zip(self.logit_bias, counts) for _ in range(n)]
        out._refresh_flags()
        return out

    def merge(self, other: "SamplingBatchInfo") -> None:
        """Appends other's rows after ours."""
        mine, theirs = self.batch_size, other.batch_size  # before any tensor grows
        for name in self._ROW_TENSORS:
            a, b = getattr(self, name), getattr(other, name)
            if a is None and b is None:
                continue
            if a is None:
                a = self._neutral(name, b, mine)
            if b is None:
                b = self._neutral(name, a, theirs)
            setattr(self, name, torch.cat([a, b]))
        self.generators = self.generators + other.generators
        if self.grammars is not None or other.grammars is not None:
            self.grammars = (self.grammars or [None] * mine) + (other.grammars or [None] * theirs)
        if self.logit_bias is not None or other.logit_bias is not None:
            self.logit_bias = (self.logit_bias or [None] * mine) + (other.logit_bias or [None] * theirs)
        self._refresh_flags()

    @classmethod
    def _neutral(cls, name: str, like: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.full((rows, *like.shape[1:]), cls._NEUTRAL[name], dtype=like.dtype, device=like.device)

    def update(self, next_ids: torch.Tensor) -> None:
        """After a step: count each row's new token (penalties) and advance min_new_tokens."""
        if self.output_counts is not None:
            self.output_counts.scatter_add_(
                1, next_ids.view(-1, 1), torch.ones(len(next_ids), 1, device=self.device)
            )
        if self.min_tokens_left is not None:
            self.min_tokens_left.sub_(1).clamp_(min=0)
