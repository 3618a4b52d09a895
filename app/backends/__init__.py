"""What generates tokens for the service. ``Backend`` is the one surface the service, the HTTP
routes, the UI and the version watcher use; two implementations:

- the embedded AdaFlash engine: ``adaflash.engine.runner.EngineRunner`` (an ``Engine`` on its
  own thread) — the default, every feature;
- SGLang on CUDA hosts: ``sglang_engine.SGLangBackend``, with ``sglang_checks`` (selection, the
  DFlash-loader compatibility check and ``LACKS``, what it cannot do).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol, runtime_checkable

from adaflash.config import SamplingParams
from adaflash.engine.engine import EngineStats
from adaflash.engine.runner import StreamDelta
from adaflash.metrics import SpecCounters
from adaflash.models.drafter import DFlashDrafter


@runtime_checkable
class Backend(Protocol):
    """A serving backend. Mutations (swap, policy) take effect between two steps."""

    @property
    def version(self) -> str:
        """The drafter version being served ("none" without a drafter)."""
        ...

    @property
    def block_size(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    @property
    def counters(self) -> SpecCounters: ...

    @property
    def source_counters(self) -> dict[str, SpecCounters]:
        """The rounds that verified drafts, per source of the drafts ("dflash", "suffix");
        empty where the backend does not say."""
        ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def step_errors(self) -> int: ...

    @property
    def policy(self) -> str: ...

    @property
    def gamma(self) -> float: ...

    @property
    def speculative(self) -> bool:
        """A drafter is loaded (the policy may still be ``ar``)."""
        ...

    @property
    def alive(self) -> bool: ...

    @property
    def running_count(self) -> int: ...

    @property
    def waiting_count(self) -> int: ...

    def cost_snapshot(self) -> dict[str, float] | None:
        """The online cost estimates (``adaflash.cost_model``), None when not measured."""
        ...

    def policy_check(self) -> dict[str, float] | None:
        """The cost policy's plans against what happened: predicted and measured seconds of
        the steps that drafted and of those that did not, and the tokens it expected of the
        drafting steps against those they committed (None where no cost policy plans)."""
        ...

    def probes(self, since: float) -> list[tuple[float, int, int]]:
        """The cost policy's answered probes since ``since`` (unix time): (time, draft slots
        compared, accepted) each; none where no cost policy probes."""
        ...

    def compiled_decode(self) -> tuple[str, int]:
        """The compiled batch-1 step: ('ready' | 'compiling' | 'failed' | 'off', steps it ran)."""
        ...

    def start(self) -> None: ...

    def stop(self, drain_timeout_s: float = 0.0) -> None: ...

    def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        *,
        domain: str | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[StreamDelta, None]:
        """Text deltas as rounds commit tokens; ValueError for a request that cannot run."""
        ...

    def swap_drafter(self, drafter: DFlashDrafter, version: str) -> None: ...

    def set_policy(self, policy: str | None = None, gamma: float | None = None) -> None: ...
