"""Which attention plan each group of a step's rows gets: the cost rule, on host lists only.

A step's rows are split into groups, each attended by one plan (layers/attention/torch_native/plans.py):
decode rows (one new token), verify rows (a few new tokens after a prefix: speculative
decoding) and extend rows (a prompt or a chunk of one) go to separate groups, so short rows
are never padded to a prompt chunk's length. Short rows that share a long prefix of KV
slots (a radix-cache hit) form one cascade group whatever their kind: the prefix is then
read once per layer for all of them instead of once per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Callable

import torch

# Shortest shared prefix worth the cascade's extra kernels.
CASCADE_MIN_PREFIX = 64
# Rows with at most this many new tokens (and a prefix) are verify rows, attended folded.
VERIFY_MAX_Q = 16
# Rows with at most this many new tokens over a shared prefix join a cascade group.
CASCADE_MAX_Q = 32
# With flash_rows, fresh prompts of at least this many tokens get a flash call of their own;
# shorter ones are cheaper in the prompt op than a call each.
FLASH_ROW_MIN_Q = 96
# Without the C++ op, a cascade's suffixes are attended as one masked sequence when that has
# at most this many times the query-key pairs of padding each row's queries to the longest
# row: the CPU flash kernel computes many more pairs a second in one large call than in
# several small padded ones. The C++ op's suffix loop computes only each row's own pairs,
# reading keys straight from the pool, and was faster than the padded path at every size
# measured (docs/development.md), so with it the token cascade is always taken.
TOKEN_SUFFIX_GAIN = 4
# Dtypes the C++ cascade op computes in (q, KV pool and output alike).
CPP_DTYPES = (torch.bfloat16, torch.float32)


class PlanKind(Enum):
    DECODE = "decode"  # one new token per row, no shared prefix
    PREFILL = "prefill"  # one fresh prompt: plain causal attention
    EXTEND = "extend"  # rows of more than VERIFY_MAX_Q new tokens, no shared prefix
    FOLDED = "folded"  # up to VERIFY_MAX_Q new tokens per row, no shared prefix
    CASCADE = "cascade"  # folded rows over a shared prefix, suffixes padded row by row
    TOKEN_CASCADE = "token_cascade"  # a cascade whose suffixes are one masked sequence
    CPP_CASCADE = "cpp_cascade"  # the token cascade in one C++ op per layer
    CPP_OWN_KEYS = "cpp_own_keys"  # one group of a larger step, rows on their own keys in the C++ op
    CPP_PROMPT = "cpp_prompt"  # prompts or chunks (EXTEND, PREFILL rows) on their own keys in the C++ prompt op


@dataclass(frozen=True)
class GroupChoice:
    rows: list[int]  # batch rows, ascending
    kind: PlanKind
    shared: int  # prefix slots every row shares, attended once (cascade kinds), else 0


def cpp_cascade_ok(kernels_loaded: bool, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the C++ cascade and prompt ops can run this step: built, in a dtype they
    compute, and a head size their vector loops take (a multiple of the widest vector, 16
    floats, up to 256)."""
    return kernels_loaded and dtype in CPP_DTYPES and head_dim % 16 == 0 and head_dim <= 256


def may_share_prefix(ext: list[int]) -> bool:
    """Whether rows with these new-token counts could form a cascade (the caller then looks
    up how many KV slots they share)."""
    return len(ext) > 1 and max(ext) <= CASCADE_MAX_Q


def own_keys_in_cpp(ext: list[int]) -> bool:
    """Whether rows that share no prefix go to the C++ op, each on its own keys (prefix
    length 0): rows of up to CASCADE_MAX_Q tokens. The padded path gathers every row's keys
    and pads its queries; the C++ loop reads each row's own keys once for all its queries."""
    return max(ext) <= CASCADE_MAX_Q


def choose_group(
    ext: list[int], prefix: list[int], shared: int, cpp: bool, cascade_only: bool = False
) -> tuple[PlanKind, int] | None:
    """The plan kind and cascade prefix length for one group of rows: new tokens `ext`,
    prefix lengths `prefix`, `shared` KV slots common to all rows at their start (0 when
    not looked up). cpp: a token cascade would run in the C++ op. cascade_only: None unless
    a cascade pays off (its rows are of several kinds, which would otherwise go apart)."""
    B, max_q = len(ext), max(ext)
    seq_lens = [p + e for p, e in zip(prefix, ext)]
    padded = B * max_q * (max(seq_lens) - shared)  # suffix pairs, each row's queries padded
    exact = sum(e * (k - shared) for e, k in zip(ext, seq_lens))  # each row's own suffix pairs
    # The C++ op attends each row's own suffix; torch's path, the suffixes as one masked sequence.
    token = cpp or sum(ext) * (sum(seq_lens) - B * shared) <= TOKEN_SUFFIX_GAIN * padded
    if shared >= CASCADE_MIN_PREFIX and token:
        return (PlanKind.CPP_CASCADE if cpp else PlanKind.TOKEN_CASCADE), shared
    if cpp and not cascade_only and own_keys_in_cpp(ext):
        return PlanKind.CPP_CASCADE, 0
    if cascade_only:
        # Suffix queries are padded to the longest row; the prefix part is not padded.
        useful = exact + shared * sum(ext)
        if shared < CASCADE_MIN_PREFIX or padded > useful:
            return None
    if shared < CASCADE_MIN_PREFIX:
        shared = 0
    if max_q == 1:
        return (PlanKind.CASCADE, shared) if shared else (PlanKind.DECODE, 0)
    if B == 1 and prefix[0] == 0:
        return PlanKind.PREFILL, 0
    if shared:
        return PlanKind.CASCADE, shared
    return (PlanKind.EXTEND if max_q > VERIFY_MAX_Q else PlanKind.FOLDED), 0


class RowKind(IntEnum):
    """What a row computes this step; the step's groups come in this order."""

    DECODE = 0  # one new token
    VERIFY = 1  # a few new tokens after a prefix (speculative decoding, short prompts)
    EXTEND = 2  # a prompt or a chunk of one


def row_kind(ext: int, prefix: int) -> RowKind:
    if ext == 1:
        return RowKind.DECODE
    return RowKind.VERIFY if ext <= VERIFY_MAX_Q and prefix > 0 else RowKind.EXTEND


def prompt_rows_in_flash(dtype: torch.dtype, amx: bool) -> bool:
    """Whether long prompts and chunks take torch's flash kernel one row at a time rather
    than the C++ prompt op: bf16 on a CPU with AMX, where the flash kernel's products run on
    AMX tiles, which the op lacks (it has AVX-512 dot products), and beat it on one long
    row; the op still beats a padded batch there, one flash call per row does not pad."""
    return amx and dtype == torch.bfloat16


def choose_plan(
    ext: list[int], prefix: list[int], shared_prefix: Callable[[list[int]], int], cpp: bool,
    flash_rows: bool = False, invariant: bool = False,
) -> list[GroupChoice]:
    """The step's groups and the plan of each, for rows with `ext` new tokens after `prefix`
    tokens of KV. shared_prefix(rows): how many KV slots those rows (ascending, at least
    two) have in common at their start, at most their shortest prefix. cpp: the C++ ops can
    run (cpp_cascade_ok): the cascade op then takes a token cascade that is the step's only
    group and the short rows beside other groups, the prompt op every group of prompts.
    flash_rows (prompt_rows_in_flash): chunks after a cached prefix and prompts of at least
    FLASH_ROW_MIN_Q tokens instead take torch's flash kernel, one group per row.
    invariant (batch-invariant inference, with cpp): every row, decode or prompt, in the C++
    cascade op with no shared prefix: each query is attended exactly on its own row's keys
    by the same loop (suffix_row), so its result depends only on the query and its keys,
    not on the other rows, a cascade's split of the keys, the plan a step's shape would
    pick or how the prompt was chunked."""
    B = len(ext)
    if invariant and cpp:
        return [GroupChoice(list(range(B)), PlanKind.CPP_CASCADE, 0)]

    def choose(rows: list[int], cpp_: bool, cascade_only: bool = False) -> GroupChoice | None:
        e, p = [ext[b] for b in rows], [prefix[b] for b in rows]
        shared = shared_prefix(rows) if may_share_prefix(e) else 0
        picked = choose_group(e, p, shared, cpp_, cascade_only)
        return None if picked is None else GroupChoice(rows, *picked)

    groups: list[GroupChoice] = []
    rest = list(range(B))
    # Short rows over one shared prefix (decode and verify rows, a new prompt on a cached
    # prefix) go together: one cascade group reads the prefix once for all their queries.
    short = [b for b in range(B) if ext[b] <= CASCADE_MAX_Q and prefix[b] > 0]
    if len(short) > 1 and len({row_kind(ext[b], prefix[b]) for b in short}) > 1:
        cascade = choose(short, cpp and len(short) == B, cascade_only=True)
        if cascade is not None:
            groups.append(cascade)
            rest = [b for b in rest if b not in set(short)]
    kinds = [row_kind(ext[b], prefix[b]) for b in rest]
    by_kind = [rows for k in RowKind if (rows := [b for b, kb in zip(rest, kinds) if kb == k])]
    alone = len(groups) + len(by_kind) == 1
    if cpp and not groups and not alone and own_keys_in_cpp(ext):
        # Decode and verify rows together, sharing nothing: one C++ call instead of a
        # Python plan per kind.
        return [GroupChoice(list(range(B)), PlanKind.CPP_CASCADE, 0)]
    chosen = groups + [choose(rows, cpp and alone) for rows in by_kind]
    if flash_rows:
        chosen = _long_prompts_in_flash(chosen, ext, prefix, cpp, choose)
    elif cpp:
        # Prompts and chunks: the C++ prompt op computes each row's own causal pairs, several
        # times faster than the flash kernel on one prompt (without AMX) and without a batch's
        # padded pairs.
        chosen = [GroupChoice(c.rows, PlanKind.CPP_PROMPT, 0) if c.kind in _PROMPTS else c for c in chosen]
    if cpp and not alone:
        chosen = _short_rows_in_cpp(chosen, ext)
    return chosen


_PROMPTS = (PlanKind.EXTEND, PlanKind.PREFILL)


def _long_prompts_in_flash(
    chosen: list[GroupChoice], ext: list[int], prefix: list[int], cpp: bool,
    choose: Callable[[list[int], bool], GroupChoice | None],
) -> list[GroupChoice]:
    """One flash call per long row computes no padded pairs; a row with a cached prefix keeps
    its mask (the flash kernel's causal flag assumes queries and keys start together). Short
    fresh prompts stay one group: a call per row would cost more than their pairs."""
    split: list[GroupChoice] = []
    for c in chosen:
        if c.kind not in _PROMPTS:
            split.append(c)
            continue
        own = [b for b in c.rows if prefix[b] or ext[b] >= FLASH_ROW_MIN_Q]
        rest = [b for b in c.rows if b not in own]
        if rest:
            split.append(GroupChoice(rest, PlanKind.CPP_PROMPT, 0) if cpp else choose(rest, False))
        split += [GroupChoice([b], PlanKind.EXTEND if prefix[b] else PlanKind.PREFILL, 0) for b in own]
    return split


def _short_rows_in_cpp(chosen: list[GroupChoice], ext: list[int]) -> list[GroupChoice]:
    """Beside a prompt chunk, the decode and few-token rows still run in C++, as one group."""
    def own(rows: list[int]) -> bool:
        return own_keys_in_cpp([ext[b] for b in rows])

    short = [c for c in chosen if c.kind in (PlanKind.DECODE, PlanKind.FOLDED)]
    rows = sorted(b for c in short for b in c.rows)
    if short and own(rows):
        return [GroupChoice(rows, PlanKind.CPP_OWN_KEYS, 0)] + [c for c in chosen if c not in short]
    return [GroupChoice(c.rows, PlanKind.CPP_OWN_KEYS, 0) if c in short and own(c.rows) else c for c in chosen]
