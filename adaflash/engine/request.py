"""A request's state inside the engine."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from adaflash.config import SamplingParams
from adaflash.engine.records import RequestRecord


class FeatureBuffer:
    """Growing (n, K·H) store of the target features of committed positions (drafter context).

    Kept raw (before the drafter's ``fc``) so the drafter context can be rebuilt after a hot swap.
    """

    def __init__(self, width: int, dtype: torch.dtype, capacity: int = 256) -> None:
        self.data = torch.empty(capacity, width, dtype=dtype)
        self.length = 0

    def append(self, rows: torch.Tensor) -> None:
        n = rows.shape[0]
        if self.length + n > self.data.shape[0]:
            grown = torch.empty(
                max(2 * self.data.shape[0], self.length + n),
                self.data.shape[1],
                dtype=self.data.dtype,
            )
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        self.data[self.length : self.length + n] = rows
        self.length += n

    def view(self, start: int = 0) -> torch.Tensor:
        return self.data[start : self.length]


@dataclass(frozen=True)
class TokenEvent:
    """Tokens committed for one request in one step (what streams to the caller)."""

    request_id: str
    token_ids: tuple[int, ...]
    kinds: tuple[str, ...]  # per token: "draft" (accepted draft) or "target" (target's own)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


EventCallback = Callable[[TokenEvent], None]
FinishCallback = Callable[[RequestRecord], None]


@dataclass(eq=False)
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    domain: str | None = None
    on_event: EventCallback | None = None
    on_finish: FinishCallback | None = None
    created_at: float = field(default_factory=time.time)

    # engine state
    slot: int = -1  # target KV-cache slot
    draft_slot: int = -1  # drafter context KV slot
    prefilled: int = 0  # prompt tokens already in the target cache
    output_ids: list[int] = field(default_factory=list)
    features: FeatureBuffer | None = None
    ctx_version: str | None = None  # drafter version whose context KV is in draft_slot
    ctx_len: int = 0  # feature rows already projected into draft_slot
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    rounds: int = 0
    accepted: int = 0
    verified: int = 0  # drafts sent to the target, Σ(k̂ − 1)
    draft_ms: float = 0.0  # time of the drafter passes it was in (shared with its batch)
    verify_ms: float = 0.0  # time of the target passes that verified it
    drafter_version: str = ""
    stop_text: str | None = None  # decoded text when stop strings are in use

    def __post_init__(self) -> None:
        assert self.prompt_ids, "a request needs at least one prompt token"
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def prefill_done(self) -> bool:
        return self.prefilled == len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def anchor(self) -> int:
        """The last committed token, whose target hidden state is not yet known."""
        return self.output_ids[-1]

    @property
    def anchor_pos(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def tokens_left(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)


def check_request(
    prompt_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_context: int,
    can_detokenize: bool,
) -> None:
    """The checks every backend runs before a request is queued; ValueError says why."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if len(prompt_ids) + params.max_new_tokens > max_context:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
            f"exceeds the context window of {max_context} tokens"
        )
    if params.stop and not can_detokenize:
        raise ValueError("stop strings need a tokenizer; this engine has none")
