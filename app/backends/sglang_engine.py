"""Serving through an embedded SGLang engine (CUDA hosts, ``pip install 'adaflash[sglang]'``).

``SGLangBackend`` implements ``app.backends.Backend`` (the surface the service, API, UI and
hot-swap watcher use, as the embedded ``EngineRunner`` does) on top of SGLang's DFLASH
speculative decoding (SPEC §8):

- one event-loop thread owns the SGLang client: SGLang's tokenizer manager binds to the loop it
  first runs on, so every call (streams, aborts, weight updates) is submitted to that loop;
- streams arrive as cumulative ``output_ids`` (SGLang's default); text is detokenized here with
  the same ``TextStreamer`` as the embedded engine, so stop strings and UTF-8 behave the same;
  a stop string aborts the SGLang request;
- every finished request becomes a ``RequestRecord`` (prompt, output, rounds and accepted drafts
  from ``meta_info['spec_*']``) in the buffer, so the trainer keeps learning on-policy;
- a hot swap replaces the draft weights alone (``begin_weight_update(selector="draft")`` …
  ``end_weight_update()``, then ``flush_cache`` retried until it succeeds); a failed swap puts
  the previous weights back and is refused, so serving goes on with the active version.

What SGLang's stock DFLASH worker cannot give is listed in ``sglang_checks.LACKS``.
``EmbeddedSGLang`` is the only class that imports ``sglang``; everything else is tested on the
CPU against a stand-in client (tests/app/test_sglang_engine.py). Not yet run on a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from adaflash.config import DrafterConfig, SamplingParams, TargetConfig
from adaflash.engine.detokenize import TextStreamer, cut_at_stop
from adaflash.engine.engine import EngineStats
from adaflash.engine.records import NullSink, RecordSink, RequestRecord
from adaflash.engine.request import check_request
from adaflash.engine.runner import StreamDelta, feeder
from adaflash.metrics import SpecCounters
from adaflash.models.drafter import HEAD_PREFIX, DFlashDrafter

log = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]
UNKNOWN = "unknown"  # token provenance: SGLang does not say which tokens were accepted drafts


class SGLangClient(Protocol):
    """The calls AdaFlash needs from SGLang (all run on the backend's loop)."""

    def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str
    ) -> AsyncIterator[dict[str, Any]]:
        """Stream chunks with cumulative ``output_ids`` and ``meta_info``."""
        ...

    async def abort(self, rid: str) -> None: ...

    async def update_draft(self, named: NamedTensors) -> None:
        """Replace the draft model's weights (target untouched); raises on failure."""
        ...

    async def flush_cache(self) -> bool: ...

    def shutdown(self) -> None: ...


def sglang_sampling(p: SamplingParams) -> dict[str, Any]:
    """Our SamplingParams as SGLang's ``sampling_params`` (stop strings are applied here)."""
    sp: dict[str, Any] = {
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k or -1,  # SGLang: -1 = off
        "max_new_tokens": p.max_new_tokens,
        "ignore_eos": p.ignore_eos,
    }
    if p.stop_token_ids:
        sp["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        sp["sampling_seed"] = p.seed
    return sp


def finish_type(meta: dict[str, Any]) -> tuple[str | None, str | None]:
    """(finish reason, error) from SGLang's ``meta_info['finish_reason']`` ({"type": "stop" |
    "length" | "abort", "message": …} or None). An abort SGLang decided on is an error."""
    fin = meta.get("finish_reason")
    if fin is None:
        return None, None
    kind = str(fin.get("type", "stop")) if isinstance(fin, dict) else str(fin)
    if kind == "abort":
        message = fin.get("message") if isinstance(fin, dict) else None
        return "error", f"SGLang aborted the request: {message or 'no reason given'}"
    return kind, None


def spec_totals(meta: dict[str, Any], n_tokens: int, block_size: int) -> tuple[int, int, int]:
    """(rounds, verified drafts, accepted drafts) of one request from SGLang's ``meta_info``.

    In AdaFlash's accounting every output token belongs to a round (τ = tokens ÷ rounds). SGLang
    makes the first token in prefill, then counts ``spec_verify_ct`` verify rounds; so the
    prefill is a round of its own that verified nothing, and every DFLASH round verified the
    whole block (block_size − 1 drafts). accepted = tokens − rounds. Without ``spec_verify_ct``
    (speculation off) every token is its own round.
    """
    reported = int(meta.get("spec_verify_ct") or 0)
    if not reported or n_tokens == 0:
        return n_tokens, 0, 0
    rounds = min(reported + 1, n_tokens)
    verified = (rounds - 1) * (block_size - 1)
    return rounds, verified, min(n_tokens - rounds, verified)


def draft_tensors(drafter: DFlashDrafter) -> NamedTensors:
    """The weights SGLang's DFlash model holds (the length head stays with AdaFlash)."""
    return [
        (k, v.detach().to("cpu"))
        for k, v in drafter.state_dict().items()
        if not k.startswith(HEAD_PREFIX)
    ]


@dataclass
class _Flight:
    started: float
    future: Future[None] | None = None


@dataclass(frozen=True)
class _Ended:
    """The pump's last word when SGLang's stream stopped without a finish reason."""

    reason: str
    error: str | None = None


class SGLangBackend:
    """The serving backend, served by SGLang on its own loop thread."""

    policy = "fixed"  # SGLang's DFLASH verifies the whole block every round
    gamma = 1.0
    speculative = True  # SGLang serves with a DFlash drafter or not at all

    def __init__(
        self,
        make_client: Callable[[], SGLangClient],
        *,
        target_cfg: TargetConfig,
        drafter_cfg: DrafterConfig,
        initial_weights: NamedTensors,
        version: str,
        decode: Callable[[list[int]], str] | None = None,
        sink: RecordSink | None = None,
        max_context: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
        swap_timeout_s: float = 300.0,
        flush_retries: int = 60,
        chunk_timeout_s: float = 300.0,
    ) -> None:
        self.make_client = make_client
        self.target_cfg, self.drafter_cfg = target_cfg, drafter_cfg
        self.block_size = drafter_cfg.block_size
        self.max_context = max_context or target_cfg.max_position_embeddings
        self.version = version
        self.decode = decode
        self.sink = sink or NullSink()
        self.eos = tuple(eos_token_ids) or tuple(target_cfg.eos_token_ids)
        self.swap_timeout_s, self.flush_retries = swap_timeout_s, flush_retries
        self.chunk_timeout_s = chunk_timeout_s  # no chunk for this long: SGLang is gone
        self.counters = SpecCounters(self.block_size)
        self.source_counters: dict[str, SpecCounters] = {}  # SGLang does not say
        self.stats = EngineStats()
        self.running: dict[str, _Flight] = {}
        self.step_errors = 0
        self._weights = initial_weights  # what SGLang holds now (restored after a failed swap)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: SGLangClient | None = None
        self._swap: Future[Any] | None = None  # the weight update in flight
        self._stopping = False

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop thread and the SGLang client on it; raises what start-up raised."""
        if self._thread is not None:
            return
        ready: Future[None] = Future()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop

            async def boot() -> None:  # the client is built on this loop (SGLang binds to it)
                self._client = self.make_client()

            try:
                loop.run_until_complete(boot())
            except BaseException as exc:
                ready.set_exception(exc)
                loop.close()
                return
            ready.set_result(None)
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="adaflash-sglang", daemon=True)
        self._thread.start()
        try:
            ready.result()
        except BaseException:
            self._thread.join()
            self._thread = None
            raise

    def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Let running streams finish for up to ``drain_timeout_s``, abort the rest, shut down."""
        if self._thread is None or self._loop is None:
            return
        deadline = time.monotonic() + drain_timeout_s
        while self.running and time.monotonic() < deadline:
            time.sleep(0.05)
        self.abort_all()
        deadline = time.monotonic() + 10.0
        while self.running and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stopping = True  # a swap cut short now is not restored (SGLang is going away)
        if self._swap is not None:
            self._swap.cancel()
        with self._lock:  # no swap starts or runs past this point
            if self._client is not None:
                with contextlib.suppress(Exception):
                    self._client.shutdown()
            loop, self._loop = self._loop, None
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join()
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def cost_snapshot(self) -> dict[str, float] | None:
        return None  # SGLang schedules on its own; there is no cost-aware policy to feed

    def policy_check(self) -> dict[str, float] | None:
        return None

    def probes(self, since: float) -> list[tuple[float, int, int]]:
        return []

    def compiled_decode(self) -> tuple[str, int]:
        return "off", 0  # SGLang runs its own kernels

    @property
    def running_count(self) -> int:
        return len(self.running)

    @property
    def waiting_count(self) -> int:
        return 0  # SGLang queues internally and does not say

    def abort_all(self) -> None:
        for flight in list(self.running.values()):
            if flight.future is not None:
                flight.future.cancel()

    # -- policy and weights ------------------------------------------------------------------
    def set_policy(self, policy: str | None = None, gamma: float | None = None) -> None:
        if policy not in (None, "fixed") or gamma not in (None, 1.0):
            raise ValueError(
                "the SGLang backend verifies SGLang's full DFLASH block (policy fixed); the "
                "ar/head policies and γ need the embedded backend (--backend adaflash)"
            )

    def swap_drafter(self, drafter: DFlashDrafter, version: str) -> None:
        """Replace SGLang's draft weights with ``drafter``'s; ValueError when refused (the
        previous weights are put back and stay active)."""
        drafter.cfg.check_target(self.target_cfg)
        if (drafter.cfg.block_size, drafter.cfg.target_layer_ids, drafter.cfg.num_layers) != (
            self.drafter_cfg.block_size,
            self.drafter_cfg.target_layer_ids,
            self.drafter_cfg.num_layers,
        ):
            raise ValueError(
                "SGLang fixed the drafter's block size, layers and target features at start-up; "
                "a version with a different layout needs a restart"
            )
        named = draft_tensors(drafter)
        with self._lock:
            if version == self.version:
                return  # the watcher and an admin action may ask for the same version
            try:
                self._call(self._replace(named), self.swap_timeout_s)
            except Exception as exc:
                reason = str(exc) or type(exc).__name__
                log.error("SGLang draft update failed (%s); restoring %s", reason, self.version)
                try:
                    if not self._stopping:
                        self._call(self._replace(self._weights), self.swap_timeout_s)
                except Exception:
                    log.exception("could not restore the previous draft weights")
                raise ValueError(f"SGLang refused the draft weights: {reason}") from exc
            self._weights, self.version = named, version
            self.stats.swaps += 1

    async def _replace(self, named: NamedTensors) -> None:
        assert self._client is not None
        await self._client.update_draft(named)
        for _ in range(self.flush_retries):  # a reload right after a request may not flush yet
            if await self._client.flush_cache():
                return
            await asyncio.sleep(0.5)
        log.warning("SGLang did not confirm the cache flush after the draft update")

    def _call(self, coro: Any, timeout: float) -> Any:
        """Run a weight-update coroutine on the backend loop; cancelled when it times out."""
        if self._loop is None:
            coro.close()
            raise RuntimeError("the SGLang backend is not running")
        self._swap = fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except TimeoutError as exc:
            fut.cancel()
            raise TimeoutError(f"no answer from SGLang within {timeout:g} s") from exc
        finally:
            self._swap = None

    # -- streaming ---------------------------------------------------------------------------
    async def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        *,
        domain: str | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[StreamDelta, None]:
        """Yield text deltas as SGLang commits tokens. Raises ValueError for invalid requests.

        Stop rules are the embedded engine's: EOS and stop token ids end the output without
        being part of it; a stop string ends it after the token that completes it (the text is
        cut before the stop string); SGLang's request is aborted when the stop is ours.
        """
        params = params or SamplingParams()
        self._check(prompt_ids, params, request_id)
        assert self._loop is not None
        rid = request_id or uuid.uuid4().hex
        chunks: asyncio.Queue[dict[str, Any] | _Ended] = asyncio.Queue()
        put = feeder(chunks)
        sampling = sglang_sampling(params)
        if not params.ignore_eos:
            sampling["stop_token_ids"] = sorted({*sampling.get("stop_token_ids", []), *self.eos})
        flight = _Flight(time.time())
        flight.future = asyncio.run_coroutine_threadsafe(
            self._pump(rid, list(prompt_ids), sampling, put), self._loop
        )
        self.running[rid] = flight
        streamer = TextStreamer(self.decode, params.stop) if self.decode else None
        output: list[int] = []  # what the caller gets (stop tokens removed)
        seen = 0  # tokens of SGLang's cumulative output already looked at
        reason: str | None = None
        error: str | None = None
        stop_text: str | None = None
        try:
            while reason is None:
                try:
                    item = await asyncio.wait_for(chunks.get(), self.chunk_timeout_s)
                except TimeoutError:
                    item = _Ended("error", f"no output from SGLang for {self.chunk_timeout_s} s")
                meta: dict[str, Any] = {}
                new: list[int] = []
                if isinstance(item, _Ended):
                    reason, error = item.reason, item.error
                else:
                    ids = list(item.get("output_ids") or [])
                    meta = item.get("meta_info") or {}
                    reason, error = finish_type(meta)
                    n, cut, stop_text = cut_at_stop(
                        output, ids[seen:], params, self.eos, self.decode
                    )
                    new = ids[seen : seen + n]
                    reason = "stop" if cut == "stop" else (reason or cut)  # our stop wins
                    seen = len(ids)
                output += new
                text = streamer.push(new, final=reason is not None) if streamer else ""
                record = None
                if reason is not None:
                    record = self._record(
                        rid, prompt_ids, output, params, domain, meta, reason, stop_text
                    )
                yield StreamDelta(
                    rid,
                    text,
                    tuple(new),
                    (UNKNOWN,) * len(new),
                    reason is not None,
                    reason,
                    error,
                    record,
                )
        finally:
            if reason is None:  # the caller went away: abort, and record it like the engine
                self._record(rid, prompt_ids, output, params, domain, {}, "abort")
            self.running.pop(rid, None)
            if flight.future is not None and not flight.future.done():
                flight.future.cancel()  # abort in SGLang (our stop, a disconnect, shutdown)

    def _check(self, prompt_ids: list[int], params: SamplingParams, rid: str | None) -> None:
        """The embedded engine's request checks, before anything reaches SGLang."""
        check_request(
            prompt_ids,
            params,
            self.target_cfg.vocab_size,
            self.max_context,
            self.decode is not None,
        )
        if rid is not None and rid in self.running:
            raise ValueError(f"request id {rid!r} is already running")
        if self._loop is None or not self.alive:
            raise RuntimeError("the SGLang backend is not running")

    async def _pump(
        self,
        rid: str,
        prompt_ids: list[int],
        sampling: dict[str, Any],
        put: Callable[[dict[str, Any] | _Ended], None],
    ) -> None:
        """On the backend loop: forward SGLang's chunks; always end with a terminal marker (the
        consumer ignores it once a chunk carried a finish reason); abort when cancelled."""
        assert self._client is not None
        try:
            async for chunk in self._client.generate(prompt_ids, sampling, rid):
                put(chunk)
            put(_Ended("abort"))  # the stream ended without a finish reason
        except asyncio.CancelledError:
            put(_Ended("abort"))
            with contextlib.suppress(Exception):
                await self._client.abort(rid)
            raise
        except Exception as exc:
            log.exception("SGLang request %s failed", rid)
            self.step_errors += 1
            put(_Ended("error", f"SGLang: {exc}"))

    def _record(
        self,
        rid: str,
        prompt_ids: list[int],
        output: list[int],
        params: SamplingParams,
        domain: str | None,
        meta: dict[str, Any],
        reason: str,
        stop_text: str | None = None,
    ) -> RequestRecord:
        rounds, verified, accepted = spec_totals(meta, len(output), self.block_size)
        now = time.time()
        flight = self.running.get(rid)
        if stop_text is not None:
            text: str | None = stop_text
        else:
            text = self.decode(output) if self.decode else None
        rec = RequestRecord(
            request_id=rid,
            prompt_ids=tuple(prompt_ids),
            output_ids=tuple(output),
            output_text=text,
            finish_reason=reason,
            drafter_version=self.version,
            domain=domain,
            temperature=params.temperature,
            rounds=rounds,
            accepted=accepted,
            verified=verified,
            created_at=flight.started if flight else now,
            finished_at=now,
            meta={"backend": "sglang"},
            draft_ms=None,  # SGLang's meta_info does not split draft and verify time
            verify_ms=None,
        )
        self.counters = self.counters + SpecCounters.from_totals(
            self.block_size, rounds, verified, accepted, drafted=verified
        )
        self.stats.requests_finished += 1
        self.stats.prompt_tokens += len(prompt_ids)
        self.stats.output_tokens += len(output)
        self.sink.offer(rec)  # aborted and failed requests are not trajectories (db/buffer.py)
        return rec


class EmbeddedSGLang:
    """``SGLangClient`` on an in-process ``sglang.Engine`` (sglang 0.5.23, CUDA only).

    Built on the backend's loop thread, so the engine's loop is that loop. Draft-only updates
    go through the tokenizer manager's weight-update session (SPEC §8).
    """

    def __init__(self, **engine_kwargs: Any) -> None:
        import sglang

        self.engine = sglang.Engine(**engine_kwargs)
        self.tp_size = int(engine_kwargs.get("tp_size", 1))

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str
    ) -> AsyncIterator[dict[str, Any]]:
        gen = await self.engine.async_generate(
            input_ids=input_ids, sampling_params=sampling_params, stream=True, rid=rid
        )
        async for chunk in gen:
            yield chunk

    async def abort(self, rid: str) -> None:
        self.engine.tokenizer_manager.abort_request(rid)

    async def update_draft(self, named: NamedTensors) -> None:
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )
        from sglang.srt.utils import MultiprocessingSerializer

        tm = self.engine.tokenizer_manager
        _raise_unless_ok(
            await tm.begin_weight_update(BeginWeightUpdateReqInput(selector="draft"), None)
        )
        try:
            payload = [MultiprocessingSerializer.serialize(named) for _ in range(self.tp_size)]
            _raise_unless_ok(
                await tm.update_weights_from_tensor(
                    UpdateWeightsFromTensorReqInput(
                        serialized_named_tensors=payload, flush_cache=False, selector="draft"
                    ),
                    None,
                )
            )
        finally:
            _raise_unless_ok(await tm.end_weight_update(EndWeightUpdateReqInput(), None))

    async def flush_cache(self) -> bool:
        out = await self.engine.tokenizer_manager.flush_cache()
        return bool(getattr(out, "success", out))

    def shutdown(self) -> None:
        self.engine.shutdown()


def _raise_unless_ok(result: Any) -> None:
    """SGLang's control calls answer (success, message) or an object with ``success``."""
    if isinstance(result, tuple) and result:
        ok, message = bool(result[0]), result[1] if len(result) > 1 else ""
    else:
        ok, message = bool(getattr(result, "success", True)), getattr(result, "message", "")
    if not ok:
        raise RuntimeError(message or "SGLang reported a failure")


def embedded_sglang_args(
    target_dir: str, drafter_dir: str, dtype: str, max_running_requests: int
) -> dict[str, Any]:
    """``sglang.Engine`` arguments: the target with our drafter folder as a DFLASH drafter."""
    return {
        "model_path": target_dir,
        "speculative_algorithm": "DFLASH",
        "speculative_draft_model_path": drafter_dir,
        "dtype": dtype,
        "max_running_requests": max_running_requests,
        "skip_tokenizer_init": True,  # token ids in and out; AdaFlash detokenizes
        "log_level": "error",
    }
