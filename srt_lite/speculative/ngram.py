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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from srt_lite.managers.schedule_batch import Req


class NgramIndex:
    """Most recent end position of every n-gram (min_n <= n <= max_n) of one token list.
    Only ends before the current last position are indexed, so the current tail never
    matches itself."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> index just after its latest occurrence
        self.indexed = 0  # ends 1..indexed are in `ends`

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of tokens' tail."""
        L = len(tokens)
        for end in range(max(self.indexed + 1, self.min_n), L):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, L - 1)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            start = self.ends.get(tuple(tokens[L - n :]))
            if start is not None:
                # Copy from `start` on, like an LZ77 match: a copy that runs into the end of
                # the list continues with its own tokens, so a loop of period p < k still
                # gives k tokens.
                draft: list[int] = []
                for j in range(k):
                    src = start + j
                    draft.append(tokens[src] if src < L else draft[src - L])
                return draft
        return []


class NgramProposer:
    def __init__(self, num_draft_tokens: int, min_n: int, max_n: int):
        self.k = num_draft_tokens
        self.min_n, self.max_n = min_n, max_n

    @staticmethod
    def eligible(req: "Req") -> bool:
        p = req.sampling_params
        return (
            p.is_greedy
            and p.repetition_penalty == 1.0
            and not p.frequency_penalty
            and not p.presence_penalty
            and not req.return_logprob
            and len(req.output_ids) >= p.min_new_tokens
        )

    def propose(self, req: "Req", room: int) -> list[int]:
        """Draft tokens for req's next step; `room` caps them (tokens left to generate, KV)."""
        k = min(self.k, room)
        if k <= 0 or not self.eligible(req):
            return []
        if req.ngram_index is None:
            req.ngram_index = NgramIndex(self.min_n, self.max_n)
        return req.ngram_index.propose(req.fill_ids, k)


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
