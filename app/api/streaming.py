"""Shared request plumbing for the HTTP routes: running a generation while watching for a client
that went away, and turning engine outcomes into HTTP errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from adaflash.config import SamplingParams
from adaflash.engine.runner import StreamDelta
from adaflash.metrics import SpecCounters
from app.service import Service


class ApiError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> JSONResponse:
        return JSONResponse(
            status_code=self.status,
            content={
                "error": {
                    "message": self.message,
                    "type": self.kind,
                    "param": self.param,
                    "code": None,
                }
            },
        )


async def open_stream(
    service: Service,
    request: Request,
    prompt_ids: list[int],
    params: SamplingParams,
    domain: str | None,
    request_id: str | None = None,
) -> AsyncGenerator[StreamDelta, None]:
    """Start a generation; invalid requests raise ApiError(400) before anything streams. When
    the stream ends, its totals go to ``request.state.access`` for the access log."""
    agen = service.backend.stream(prompt_ids, params, domain=domain, request_id=request_id)
    try:
        first = await agen.__anext__()
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    except StopAsyncIteration as exc:
        raise ApiError(500, "generation ended without output", "server_error") from exc

    async def chained() -> AsyncGenerator[StreamDelta, None]:
        tokens, last = 0, first
        try:
            async with contextlib.aclosing(agen):
                yield first
                tokens += len(first.token_ids)
                async for d in agen:
                    tokens, last = tokens + len(d.token_ids), d
                    yield d
        finally:
            request.state.access = access_fields(service, len(prompt_ids), tokens, last)

    return chained()


def access_fields(
    service: Service, prompt: int, completion: int, last: StreamDelta
) -> dict[str, Any]:
    """What the access log says about a generation (τ and verify length from its record)."""
    out: dict[str, Any] = {"prompt": prompt, "completion": completion}
    out["finish"] = last.finish_reason if last.finished else "cancelled"
    rec = last.record
    if rec is not None and rec.rounds:
        c = SpecCounters.from_totals(
            service.backend.block_size, rec.rounds, rec.verified, rec.accepted
        )
        out["tau"] = round(c.accept_len, 3)
        out["verify_len"] = round(c.verify_len, 3)
        out["drafter"] = rec.drafter_version
    return out


async def collect(request: Request, deltas: AsyncGenerator[StreamDelta, None]) -> list[StreamDelta]:
    """Consume a whole generation; if the client disconnects first, cancel it (which aborts the
    request and frees its slot)."""
    out: list[StreamDelta] = []

    async def consume() -> None:
        async with contextlib.aclosing(deltas):
            async for d in deltas:
                out.append(d)

    task = asyncio.create_task(consume())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ApiError(499, "client disconnected", "client_closed_request")
    task.result()
    check_error(out[-1])
    return out


def check_error(last: StreamDelta) -> None:
    if last.finish_reason == "error":
        raise ApiError(500, last.error or "internal error", "server_error")


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"
