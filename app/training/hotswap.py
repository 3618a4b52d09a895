"""Serving side of versioning: follow the registry's active version and hot-swap it in.

A watcher thread polls the active version; when it changes, it loads the drafter (checking its
hash and tensors) off the engine thread and queues ``Engine.swap_drafter``, which takes effect
between two steps. A version that fails to load is refused: the error is kept for the API/UI,
the version is not retried until the active version changes again, and serving goes on with the
weights it has.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from db.registry import Registry, VersionError

if TYPE_CHECKING:
    from app.backends import Backend

log = logging.getLogger(__name__)


class VersionWatcher:
    def __init__(
        self,
        backend: Backend,
        registry: Registry,
        dtype: str,
        poll_s: float = 2.0,
        on_swap: Callable[[str], None] | None = None,
    ) -> None:
        self.backend, self.registry, self.dtype, self.poll_s = backend, registry, dtype, poll_s
        self.on_swap = on_swap
        self.last_error: str | None = None
        self.refused: set[str] = set()
        self.swapped: list[str] = []
        self._checking = threading.Lock()  # the poll thread and admin actions may both check
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="adaflash-hotswap", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def check(self) -> str | None:
        """Swap in the active version if it is new; returns the version swapped to."""
        with self._checking:
            return self._check()

    def _check(self) -> str | None:
        active = self.registry.active()
        if active is None or active.id == self.backend.version or active.id in self.refused:
            return None
        try:
            drafter = self.registry.load(active.id, self.dtype)
            self.backend.swap_drafter(drafter, active.id)
        except (VersionError, ValueError) as exc:
            self.refused.add(active.id)
            self.last_error = f"version {active.id} refused: {exc}"
            log.error(self.last_error)
            return None
        self.swapped.append(active.id)
        self.last_error = None
        if self.on_swap is not None:
            self.on_swap(active.id)
        return active.id

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:  # the database may be away for a while; serving goes on
                log.exception("version check failed")
            self._stop.wait(self.poll_s)
