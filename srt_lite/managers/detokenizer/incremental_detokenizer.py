"""Turning a stream of generated token ids into a stream of text deltas.

Decoding every token on its own is wrong: byte-level BPE splits multi-byte UTF-8 characters
(emoji, CJK, accented letters) over several tokens, and SentencePiece-style tokenizers drop
the leading space of the first token of a decode. Decoding the whole sequence every step is
right but O(n) per token. We follow vLLM/SGLang instead and decode a short window:

    ids: [ ... already emitted ... | surr_offset ... read_offset | new ids ... ]

`ids[surr_offset:read_offset]` is context that was already emitted; we decode it alone and
together with the new ids, and the delta is the difference. The shared context makes the
tokenizer treat the new ids exactly as it does inside the full sequence. If the text ends
with U+FFFD the last character is still incomplete, so we emit nothing and keep the ids
pending until the next step completes it (or flush() gives up at the end of the request).

Both offsets only ever move to a point where the window's text ended with a complete
character, so each window starts on a character boundary of the full byte stream and the
concatenated deltas equal the full decode exactly.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# What an incomplete UTF-8 sequence decodes to (errors="replace" / from_utf8_lossy).
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes one request's output ids incrementally; see the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        # The same options must be used for every window (and by anyone comparing against a
        # full decode). Cleanup of tokenization spaces is always off: it rewrites text across
        # token boundaries (" ," -> ","), so it cannot be applied to a window and stay
        # consistent with already-emitted text.
        self.decode_kwargs: dict[str, Any] = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
            "clean_up_tokenization_spaces": False,
        }
        self.ids: list[int] = []
        # ids[:read_offset] have been emitted; ids[surr_offset:read_offset] is the context
        # decoded again with the pending ids.
        self.surr_offset = 0
        self.read_offset = 0
        self.chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (by step() and flush())."""
        if len(self.chunks) > 1:
            # Join lazily and keep the joined string, so repeated reads stay cheap.
            self.chunks = ["".join(self.chunks)]
        return self.chunks[0] if self.chunks else ""

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.decode_kwargs)

    def step(self, new_ids: list[int]) -> str:
        """Appends `new_ids` and returns the text they complete ("" while it is pending)."""
        self.ids.extend(int(i) for i in new_ids)
        if len(self.ids) == self.read_offset:
            return ""
        surr_text = self.decode(self.ids[self.surr_offset : self.read_offset])
        new_text = self.decode(self.ids[self.surr_offset :])
        # Nothing new yet (e.g. only skipped special tokens), or the last character is still
        # missing bytes: keep the ids pending; the window just grows by those few ids.
        if len(new_text) <= len(surr_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(surr_text) :]
        self.surr_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.chunks.append(delta)
        return delta

    def flush(self) -> str:
        """Emits whatever is still pending, even an incomplete character (as U+FFFD, like a
        full decode would show it). Call it once, when the request ends."""
        if len(self.ids) == self.read_offset:
            return ""
        surr_text = self.decode(self.ids[self.surr_offset : self.read_offset])
        new_text = self.decode(self.ids[self.surr_offset :])
        delta = new_text[len(surr_text) :]
        self.surr_offset = self.read_offset
        self.read_offset = len(self.ids)
        if delta:
            self.chunks.append(delta)
        return delta
