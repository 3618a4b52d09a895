"""Incremental detokenization and stop strings, shared by the engine (to finish a request) and
the streamer (to release text deltas without ever taking text back)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from adaflash.config import SamplingParams


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
    """Index in ``text`` where the earliest stop string begins (searching from ``start``)."""
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def cut_at_stop(
    output: list[int],
    tokens: Sequence[int],
    params: SamplingParams,
    eos: Collection[int],
    detokenize: Callable[[list[int]], str] | None,
) -> tuple[int, str | None, str | None]:
    """How many of ``tokens`` (following ``output``) a request keeps, and why it ends.

    EOS (unless ignored) and stop token ids end it without being kept; a stop string ends it
    after the token that completes it; max_new_tokens ends it. Returns (kept, finish reason or
    None, text before the stop string or None).
    """
    kept: list[int] = []
    for tok in tokens:
        if (tok in eos and not params.ignore_eos) or tok in params.stop_token_ids:
            return len(kept), "stop", None
        kept.append(tok)
        if params.stop and detokenize is not None:
            text = detokenize([*output, *kept])
            cut = find_stop(text, params.stop)
            if cut is not None:
                return len(kept), "stop", text[:cut]
        if len(output) + len(kept) >= params.max_new_tokens:
            return len(kept), "length", None
    return len(kept), None, None


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
