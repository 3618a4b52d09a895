"""Incremental detokenization and stop strings, shared by the engine (to finish a request) and
the streamer (to release text deltas without ever taking text back)."""

from __future__ import annotations

from collections.abc import Callable


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
    """Index in ``text`` where the earliest stop string begins (searching from ``start``)."""
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def safe_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of ``text`` that can be released: holds back an incomplete UTF-8 character (shown
    as U+FFFD by the tokenizer) and any suffix that could still grow into a stop string."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, end), 0, -1):
            if text[end - n : end] == s[:n]:
                hold = max(hold, n)
                break
    return end - hold


class TextStreamer:
    """Turns a growing list of token ids into append-only text deltas.

    Decoding the whole output each time is what makes multi-byte characters and merges come out
    right; text that could still change (an incomplete character, the start of a stop string) is
    held back until it can no longer change. After a stop string, nothing more is released.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...] = ()) -> None:
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.sent = 0  # characters released so far
        self.stopped = False

    def push(self, token_ids: tuple[int, ...] | list[int], final: bool = False) -> str:
        """Add tokens; return the newly releasable text. ``final`` releases everything left."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        text = self.decode(self.ids)
        cut = find_stop(text, self.stops) if self.stops else None
        if cut is not None:
            end, self.stopped = cut, True
        elif final:
            end = len(text)
        else:
            end = safe_prefix_len(text, self.stops)
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent : end], end
        return delta
