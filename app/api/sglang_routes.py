"""SGLang-native endpoints: /generate, /get_model_info, /flush_cache, /health.

``/generate`` follows SGLang's shapes so its clients and ``bench_serving`` work unchanged:
streaming chunks carry the cumulative ``text`` and ``meta_info`` (SGLang's default), ended by
``data: [DONE]``; ``meta_info`` has ``prompt_tokens``, ``completion_tokens`` and the speculative
statistics ``spec_accept_length`` (tokens per round, bonus included), ``spec_accept_rate``,
``spec_verify_ct`` (rounds), ``spec_verify_len`` (mean positions verified per round), and
``spec_draft_time_ms`` / ``spec_verify_time_ms`` (wall time of the drafter and target passes
this request was part of; a batched pass counts fully for each of its requests).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from adaflash.engine.runner import StreamDelta
from adaflash.metrics import SpecCounters
from app.api.schemas import GENERATION_RESPONSES, ErrorResponse, GenerateRequest
from app.api.streaming import ApiError, collect, open_stream, sse
from app.service import Service


def meta_info(
    service: Service,
    rid: str,
    prompt_tokens: int,
    completion_tokens: int,
    last: StreamDelta | None,
    started: float,
) -> dict[str, Any]:
    info: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": 0,
        "e2e_latency": round(time.perf_counter() - started, 4),
    }
    if last is not None and last.finished:
        reason = last.finish_reason or "stop"
        info["finish_reason"] = {"type": "length" if reason == "length" else reason}
    else:
        info["finish_reason"] = None
    rec = last.record if last is not None else None
    if rec is not None:
        c = SpecCounters.from_totals(
            service.backend.block_size, rec.rounds, rec.verified, rec.accepted
        )
        info.update(
            spec_accept_length=round(c.accept_len, 4),
            spec_accept_rate=round(c.acceptance_rate, 4),
            spec_verify_ct=rec.rounds,
            spec_verify_len=round(c.verify_len, 4),
            spec_draft_time_ms=None if rec.draft_ms is None else round(rec.draft_ms, 3),
            spec_verify_time_ms=None if rec.verify_ms is None else round(rec.verify_ms, 3),
            drafter_version=rec.drafter_version,
        )
    return info


def router(service: Service) -> APIRouter:
    r = APIRouter(tags=["sglang"])

    @r.post("/generate", response_model=None, responses=GENERATION_RESPONSES)
    async def generate(body: GenerateRequest, request: Request) -> Any:
        if (body.text is None) == (body.input_ids is None):
            raise ApiError(400, "send exactly one of text or input_ids")
        sp = body.sampling_params
        try:
            if body.text is not None:
                if not body.text.strip():
                    raise ValueError("text is empty")
                prompt = service.tokenizer.encode(body.text)
            else:
                prompt = list(body.input_ids or [])
            stops = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
            params = service.sampling(
                temperature=sp.temperature,
                top_p=sp.top_p,
                top_k=None if sp.top_k is None else max(sp.top_k, 0),  # SGLang's -1: off
                max_new_tokens=sp.max_new_tokens,
                stop=stops,
                stop_token_ids=tuple(sp.stop_token_ids or ()),
                ignore_eos=sp.ignore_eos,
                seed=sp.seed,
                prompt_len=len(prompt),
            )
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        started = time.perf_counter()
        deltas = await open_stream(service, request, prompt, params, body.domain, body.rid)
        if body.stream:
            return StreamingResponse(
                events(service, deltas, len(prompt), started), media_type="text/event-stream"
            )
        out = await collect(request, deltas)
        n = sum(len(d.token_ids) for d in out)
        return {
            "text": "".join(d.text for d in out),
            "output_ids": [t for d in out for t in d.token_ids],
            "meta_info": meta_info(service, out[-1].request_id, len(prompt), n, out[-1], started),
        }

    @r.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            **service.model_info(),
            "tokenizer_path": service.target_dir.name,
            "is_generation": True,
        }

    @r.api_route("/flush_cache", methods=["GET", "POST"], response_class=PlainTextResponse)
    async def flush_cache() -> PlainTextResponse:
        # KV slots are per request and freed when it ends: there is no shared prefix cache.
        return PlainTextResponse("Cache flushed.\n")

    @r.get(
        "/health",
        response_class=PlainTextResponse,
        responses={503: {"model": ErrorResponse, "description": "the engine is not running"}},
    )
    async def health() -> PlainTextResponse:
        if not service.backend.alive:
            raise ApiError(503, "engine thread is not running", "server_error")
        return PlainTextResponse("OK\n")

    return r


async def events(
    service: Service, deltas: AsyncIterator[StreamDelta], prompt_tokens: int, started: float
) -> AsyncIterator[str]:
    text, n = "", 0
    async for d in deltas:
        text += d.text
        n += len(d.token_ids)
        if d.finished and d.finish_reason == "error":
            yield sse({"error": {"message": d.error or "internal error"}})
            return
        yield sse(
            {
                "text": text,
                "meta_info": meta_info(service, d.request_id, prompt_tokens, n, d, started),
            }
        )
    yield sse("[DONE]")
