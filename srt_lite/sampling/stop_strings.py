"""Stop strings: finding them in text, and holding streamed text back until it is safe.

A stop string can arrive split over several deltas ("a#", "#", "#b" for "###"), so a
streaming response must not send a tail of text that might still become the start of a
stop string. We hold back only the longest suffix of the unsent text that is a proper
prefix of some stop, which is never more than max(len(stop)) - 1 characters; everything
before it can never be part of a stop occurrence and is sent at once.

Which stop wins: find_stop() returns the occurrence with the earliest start, preferring the
longer stop on ties. StopStringMatcher applies find_stop() to its buffer after each delta,
so it matches as soon as any stop completes; for stop sets where one stop is a substring of
another (e.g. "##" and "###"), what matches can therefore depend on how text was split into
deltas, just as it does for a scheduler that checks after every token.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def find_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest occurrence of any stop in text[start:] as (position in text, stop), the
    longer stop on a tie; None if there is none. Empty stops are ignored."""
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        pos = text.find(stop, start)
        if pos < 0:
            continue
        if best is None or pos < best[0] or (pos == best[0] and len(stop) > len(best[1])):
            best = (pos, stop)
    return best


class StopStringMatcher:
    """Filters one request's text deltas: holds back possible stop prefixes and cuts the
    text at the first stop string."""

    def __init__(self, stops: list[str], no_stop_trim: bool = False) -> None:
        # An empty stop would match everywhere; it is a caller mistake we simply ignore.
        self.stops = [s for s in stops if s]
        self.no_stop_trim = no_stop_trim
        # Every proper prefix of every stop: the only suffixes worth holding back.
        self.stop_prefixes = {s[:i] for s in self.stops for i in range(1, len(s))}
        self.max_hold = max((len(s) for s in self.stops), default=1) - 1
        self.buffer = ""  # received but not yet returned
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to send now, matched stop or None). Once a stop has matched,
        every later call returns ("", matched)."""
        if self.matched is not None:
            return "", self.matched
        if not self.stops:
            return delta, None
        # Text before the buffer was released only because no stop can start there, so
        # the buffer plus the new delta is all we need to search.
        buf = self.buffer + delta
        hit = find_stop(buf, self.stops)
        if hit is not None:
            pos, stop = hit
            self.matched = stop
            self.buffer = ""
            return buf[: pos + len(stop)] if self.no_stop_trim else buf[:pos], stop
        hold = self.hold_length(buf)
        self.buffer = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], None

    def hold_length(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop."""
        for n in range(min(self.max_hold, len(buf)), 0, -1):
            if buf[-n:] in self.stop_prefixes:
                return n
        return 0

    def flush(self) -> str:
        """End of the request without a match: releases the held-back text."""
        if self.matched is not None:
            return ""
        out, self.buffer = self.buffer, ""
        return out
