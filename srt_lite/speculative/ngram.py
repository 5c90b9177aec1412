"""N-gram (prompt lookup) speculative decoding: drafts without a draft model.

A running request's last few tokens are looked up in its own prompt and output; if they
occurred before, the tokens that followed that occurrence are the draft. The target model
then scores the last token plus the draft in one forward (an extend of 1 + k tokens), and the
longest prefix of the draft that matches the model's own greedy choices is accepted, plus
the model's token after it. Output is therefore exactly what plain greedy decoding gives
(up to the kernels' rounding for a different number of rows), in fewer forward passes when
text repeats: code edits, quoting, lists, and the loops small models fall into.

Drafts are proposed only for requests whose next tokens do not depend on earlier draft
tokens beyond the model itself: greedy, no repetition/frequency/presence penalty, no
logprobs, min_new_tokens already reached. Other requests in the batch decode one token as
usual. This is the idea of SGLang's NGRAM and vLLM's "ngram" method; the index here is a
per-request dict of n-grams kept up to date incrementally.

Like SGLang's NGRAM (whose n-gram trie spans requests), drafts also come from other requests'
generated text (SharedNgramTable): requests that share a prompt prefix or a task tend to
generate alike (the same answer format, the same loop), so one request's output drafts
another's. Where a tail occurs in several places, the source that best predicts the model's
next tokens wins: the request's own generated text, then other requests' generated text,
then the request's prompt (a prompt match is often a coincidence, e.g. common short
n-grams of a long document).

How many tokens to draft is decided per request and step from a cost model: a draft token
costs compute (more so with a long context, as attention then dominates), and pays off only
if accepted. How likely that is depends mostly on where the match was found and how long it
is (a long tail found in the request's own output is almost always followed as before, a
1-token tail found in the prompt almost never), so acceptance
is learned server-wide per (source, tail length): the chance that the first draft token is
accepted, and that each further one is once the previous ones were. Draft tokens are nearly
free for a lone request (its step is memory bound) and cost about a fifth of a request's
step share in a full batch, so in a busy batch only likely drafts are made.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from srt_lite.req import Req


# Cost model of one step, in relative units: a decode step of B rows costs about
# STEP_BASE + STEP_PER_ROW * B, one draft token DRAFT_TOKEN + DRAFT_PER_CONTEXT * (its context
# length). Only the ratios matter: they set how likely a draft token must be accepted to pay
# for itself. They describe a CPU whose decode step is bound by reading the weights (a row
# costs little beside the step); benchmarks/bench_forward.py measures a machine's own, and
# docs/benchmarks.md ("Figures behind the code's constants") has the fit they come from.
STEP_BASE, STEP_PER_ROW = 35.0, 1.0
DRAFT_TOKEN, DRAFT_PER_CONTEXT = 0.5, 0.0007
# Acceptance estimates: counts decay by this factor per verified draft of their kind.
ACCEPT_DECAY = 0.95
# A kind of match not worth drafting is tried with one draft token every this many times,
# so its estimate can recover when the text changes.
PROBE_INTERVAL = 8
# Entries of the cross-request table (about max_n per generated token, ~250 bytes each);
# the oldest go first.
SHARED_NGRAM_CAPACITY = 1 << 17


class AcceptStats:
    """Decayed acceptance counts of one kind of match: the first draft token, and each
    further one given that the previous ones were accepted (prior: one hit, one miss)."""

    def __init__(self):
        self.first = [1.0, 2.0]  # [accepted, tried]
        self.next = [1.0, 2.0]
        self.skipped = 0  # times in a row it was not worth drafting

    def rates(self) -> tuple[float, float]:
        return self.first[0] / self.first[1], self.next[0] / self.next[1]

    def observe(self, drafted: int, accepted: int) -> None:
        # Token i (1-based) was tried when the i-1 before it were accepted.
        later_tried = min(accepted + 1, drafted) - 1
        for counts, hits, tried in ((self.first, min(accepted, 1), 1), (self.next, max(accepted - 1, 0), later_tried)):
            counts[0] = counts[0] * ACCEPT_DECAY + hits
            counts[1] = counts[1] * ACCEPT_DECAY + tried


class NgramIndex:
    """Most recent end position of every n-gram (min_n <= n <= max_n) of one token list.
    Only ends before the current last position are indexed, so the current tail never
    matches itself."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> index just after its latest occurrence
        self.indexed = 0  # ends 1..indexed are in `ends`
        self.shared_indexed = 0  # output positions 0..shared_indexed-1 are in SharedNgramTable
        self.draft_kind: tuple[str, int] | None = None  # (source, tail length) of the last draft

    def extend(self, tokens: list[int]) -> None:
        """Indexes the n-grams of tokens (the same list, grown) not indexed yet."""
        L, first = len(tokens), self.indexed + 1
        # One length at a time, ends ascending, so the latest occurrence wins; zipped slices
        # instead of a loop per position, which matters when a new request indexes its whole prompt.
        for n in range(self.min_n, self.max_n + 1):
            lo = max(first, n)
            if lo < L:
                grams = zip(*(tokens[lo - n + i : L - n + i] for i in range(n)))
                self.ends.update(zip(grams, range(lo, L)))
        self.indexed = max(self.indexed, L - 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of tokens' tail."""
        self.extend(tokens)
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            start = self.ends.get(tuple(tokens[L - n :]))
            if start is not None:
                return copy_from(tokens, start, k)
        return []


def copy_from(tokens: list[int], start: int, k: int) -> list[int]:
    """k tokens from tokens[start] on, like an LZ77 match: a copy that runs into the end of
    the list continues with its own tokens, so a loop of period p < k still gives k tokens."""
    L = len(tokens)
    draft: list[int] = []
    for j in range(k):
        src = start + j
        draft.append(tokens[src] if src < L else draft[src - L])
    return draft


class SharedNgramTable:
    """Server-wide: the latest place where each n-gram of a request's generated text was
    followed by a token, as (that request's output list, index in it). Entries point into
    the live list, so a continuation grows while its request decodes; n-grams may start in
    the prompt's last tokens. Bounded: the least recently written entries go first."""

    def __init__(self, min_n: int, max_n: int, capacity: int = SHARED_NGRAM_CAPACITY):
        self.min_n, self.max_n, self.capacity = min_n, max_n, capacity
        # OrderedDict, not dict: evicting a plain dict's first entry scans the deleted
        # entries before it (quadratic under steady churn: 94 s for 600k writes).
        self.ends: OrderedDict[tuple[int, ...], tuple[list[int], int]] = OrderedDict()

    def add(self, req: "Req", index: NgramIndex, tokens: list[int]) -> None:
        """Indexes req's n-grams that end at an output position with a token after it;
        tokens is req.fill_ids (prompt then output)."""
        out = req.output_ids
        if index.shared_indexed >= len(out):
            return
        h = len(req.origin_input_ids)  # output position e is tokens[h + e]
        for e in range(index.shared_indexed, len(out)):
            for n in range(self.min_n, min(self.max_n, h + e) + 1):
                key = tuple(tokens[h + e - n : h + e])
                self.ends[key] = (out, e)
                self.ends.move_to_end(key)  # the newest entry lives longest
        index.shared_indexed = len(out)
        while len(self.ends) > self.capacity:
            self.ends.popitem(last=False)

    def match(self, tail: tuple[int, ...], exclude: list[int]) -> tuple[list[int], int] | None:
        """(output list, index) where `tail` was last followed in another request's output
        than `exclude`, whose tokens from that index on continue it (at least one)."""
        hit = self.ends.get(tail)
        if hit is None or hit[0] is exclude:
            return None
        return hit


class NgramProposer:
    def __init__(self, num_draft_tokens: int, min_n: int, max_n: int):
        self.k = num_draft_tokens
        self.min_n, self.max_n = min_n, max_n
        self.reset()

    def reset(self) -> None:
        """Forgets other requests' text and the learned acceptance (flush_cache)."""
        self.shared = SharedNgramTable(self.min_n, self.max_n)
        self.stats: dict[tuple[str, int], AcceptStats] = {}  # by (source, tail length)

    @staticmethod
    def eligible(req: "Req") -> bool:
        p = req.sampling_params
        return (
            p.is_greedy
            and p.repetition_penalty == 1.0
            and not p.frequency_penalty
            and not p.presence_penalty
            and not req.return_logprob
            # Constrained rows do not draft: a draft would need the grammar's verdict
            # token by token, and greedy JSON rarely repeats the context anyway.
            and req.grammar is None
            and len(req.output_ids) >= p.min_new_tokens
        )

    def plan(self, reqs: list["Req"], room_kv: int, context_len: int) -> int:
        """Sets the draft tokens and extend_len of each decoding request of one step; returns
        the number of draft tokens. `room_kv` is the free KV left after one slot per request:
        the drafts must fit in it. Free KV counts evictable cache (in a long-running server the
        tree holds most slots); rejected slots return to the free list at once, so drafting
        evicts at most about one step's worth of draft tokens."""
        total = 0
        for r in reqs:
            r.draft_ids = []
            if room_kv - total > 0:
                left = r.tokens_left - 1
                # Positions up to context_len - 1 exist; the step's last is seq_len - 1 + d.
                room = min(left, context_len - r.seq_len, room_kv - total)
                r.draft_ids = self.propose(r, room, len(reqs))
                total += len(r.draft_ids)
            r.extend_len = 1 + len(r.draft_ids)
        return total

    def propose(self, req: "Req", room: int, batch_size: int) -> list[int]:
        """Draft tokens for req's next step in a batch of batch_size decoding requests;
        `room` caps them (tokens left to generate, free KV)."""
        if min(self.k, room) <= 0 or not self.eligible(req):
            return []
        if req.ngram_index is None:
            req.ngram_index = NgramIndex(self.min_n, self.max_n)
        index = req.ngram_index
        tokens = req.fill_ids  # one concatenation per step, for both indexes
        self.shared.add(req, index, tokens)
        match = self.find(req, index, tokens)
        if match is None:
            return []
        kind, take = match
        stats = self.stats.setdefault(kind, AcceptStats())
        k = min(self.num_worth_drafting(*stats.rates(), req.seq_len, batch_size), room)
        if k == 0:
            stats.skipped += 1
            if stats.skipped < PROBE_INTERVAL:
                return []
            k = 1  # probe: this kind of match may have become reliable
        stats.skipped = 0
        index.draft_kind = kind
        return take(k)

    def find(
        self, req: "Req", index: NgramIndex, tokens: list[int]
    ) -> tuple[tuple[str, int], Callable[[int], list[int]]] | None:
        """The longest tail of req (tokens: its fill_ids) that occurred before: in its own
        generated text, else in another request's, else in its prompt. Returns (source, tail
        length) and a function giving the k tokens that followed it."""
        index.extend(tokens)
        L, prompt_len = len(tokens), len(req.origin_input_ids)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            tail = tuple(tokens[L - n :])
            start = index.ends.get(tail)
            if start is not None and start >= prompt_len:
                return ("output", n), partial(copy_from, tokens, start)
            hit = self.shared.match(tail, exclude=req.output_ids)
            if hit is not None:
                out, e = hit
                return ("shared", n), lambda k: out[e : e + k]
            if start is not None:
                return ("prompt", n), partial(copy_from, tokens, start)
        return None

    def num_worth_drafting(self, p_first: float, p_next: float, context: int, batch_size: int) -> int:
        """The most draft tokens whose chance of acceptance (p_first * p_next^(i-1) for the
        i-th) still beats its cost relative to one token's share of the step."""
        share = (STEP_BASE + STEP_PER_ROW * batch_size) / batch_size
        threshold = (DRAFT_TOKEN + DRAFT_PER_CONTEXT * context) / share
        k, chance = 0, p_first
        while k < self.k and chance >= threshold:
            k, chance = k + 1, chance * p_next
        return k

    def observe(self, req: "Req", accepted: int) -> None:
        """After verifying req's draft: `accepted` of its draft tokens matched."""
        self.stats[req.ngram_index.draft_kind].observe(len(req.draft_ids), accepted)


def no_drafts(reqs: list["Req"]) -> None:
    """These decoding requests compute one token each this step."""
    for r in reqs:
        r.draft_ids, r.extend_len = [], 1


def accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """targets[i] is the model's token after the step's i-th input (the last accepted token,
    then each draft token). Returns the new tokens: the matching draft prefix and the model's
    token after it."""
    out = [targets[0]]
    for i, d in enumerate(draft):
        if d != targets[i]:
            break
        out.append(targets[i + 1])
    return out
