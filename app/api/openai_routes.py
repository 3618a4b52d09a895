"""OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from adaflash.engine.runner import StreamDelta
from adaflash.metrics import SpecCounters
from app.api.schemas import GENERATION_RESPONSES, ChatCompletionRequest, CompletionRequest
from app.api.streaming import ApiError, check_error, collect, open_stream, sse
from app.service import Service

FINISH = {"stop": "stop", "length": "length"}


def spec_stats(service: Service, last: StreamDelta) -> dict[str, Any]:
    """Per-request speculative statistics (SPEC §1 definitions), an extension field."""
    rec = last.record
    if rec is None:
        return {}
    c = SpecCounters.from_totals(service.backend.block_size, rec.rounds, rec.verified, rec.accepted)
    return {
        "drafter_version": rec.drafter_version,
        "rounds": rec.rounds,
        "accept_len": round(c.accept_len, 4),
        "verify_len": round(c.verify_len, 4),
        "acceptance_rate": round(c.acceptance_rate, 4),
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def router(service: Service) -> APIRouter:
    r = APIRouter(tags=["openai"])

    def check_model(name: str | None) -> None:
        if name not in (None, "", service.model_name, "default"):
            raise ApiError(
                404,
                f"model {name!r} not found; this server serves {service.model_name!r}",
                "not_found_error",
                "model",
            )

    @r.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": service.model_name,
                    "object": "model",
                    "created": int(service.started_at),
                    "owned_by": "adaflash",
                    "max_model_len": service.backend.max_context,
                }
            ],
        }

    @r.post("/v1/chat/completions", response_model=None, responses=GENERATION_RESPONSES)
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        try:
            messages = [
                {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in body.messages
            ]
            if not any(m["content"].strip() for m in messages):
                raise ValueError("messages are empty: send at least one non-empty message")
            prompt = service.tokenizer.chat(messages)
            params = service.sampling(
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                max_new_tokens=body.max_completion_tokens or body.max_tokens,
                stop=body.stops(),
                ignore_eos=body.ignore_eos,
                seed=body.seed,
                prompt_len=len(prompt),
            )
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        deltas = await open_stream(service, request, prompt, params, body.domain)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "created": created, "model": service.model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                chat_events(service, deltas, head, len(prompt), include_usage),
                media_type="text/event-stream",
            )
        out = await collect(request, deltas)
        text = "".join(d.text for d in out)
        n = sum(len(d.token_ids) for d in out)
        return {
            **head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": FINISH.get(out[-1].finish_reason or "", "stop"),
                    "logprobs": None,
                }
            ],
            "usage": usage(len(prompt), n),
            "adaflash": spec_stats(service, out[-1]),
        }

    @r.post("/v1/completions", response_model=None, responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        try:
            if isinstance(body.prompt, str):
                if not body.prompt.strip():
                    raise ValueError("prompt is empty")
                prompt = service.tokenizer.encode(body.prompt)
            else:
                prompt = list(body.prompt)
            params = service.sampling(
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                max_new_tokens=body.max_tokens,
                stop=body.stops(),
                ignore_eos=body.ignore_eos,
                seed=body.seed,
                prompt_len=len(prompt),
            )
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        deltas = await open_stream(service, request, prompt, params, body.domain)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": service.model_name,
        }
        if body.stream:
            return StreamingResponse(
                completion_events(deltas, head), media_type="text/event-stream"
            )
        out = await collect(request, deltas)
        n = sum(len(d.token_ids) for d in out)
        return {
            **head,
            "object": "text_completion",
            "choices": [
                {
                    "index": 0,
                    "text": "".join(d.text for d in out),
                    "logprobs": None,
                    "finish_reason": FINISH.get(out[-1].finish_reason or "", "stop"),
                }
            ],
            "usage": usage(len(prompt), n),
            "adaflash": spec_stats(service, out[-1]),
        }

    return r


async def chat_events(
    service: Service,
    deltas: AsyncIterator[StreamDelta],
    head: dict[str, Any],
    prompt_tokens: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    base = {**head, "object": "chat.completion.chunk"}
    yield sse(
        {
            **base,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ],
        }
    )
    n = 0
    async for d in deltas:
        n += len(d.token_ids)
        if d.finished:
            try:
                check_error(d)
            except ApiError as exc:
                yield sse({"error": {"message": exc.message, "type": exc.kind}})
                return
        if d.text:
            yield sse(
                {
                    **base,
                    "choices": [{"index": 0, "delta": {"content": d.text}, "finish_reason": None}],
                }
            )
        if d.finished:
            yield sse(
                {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {},
                            "finish_reason": FINISH.get(d.finish_reason or "", "stop"),
                        }
                    ],
                    "adaflash": spec_stats(service, d),
                }
            )
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(prompt_tokens, n)})
    yield sse("[DONE]")


async def completion_events(
    deltas: AsyncIterator[StreamDelta], head: dict[str, Any]
) -> AsyncIterator[str]:
    base = {**head, "object": "text_completion"}
    async for d in deltas:
        if d.finished and d.finish_reason == "error":
            yield sse({"error": {"message": d.error or "internal error", "type": "server_error"}})
            return
        if d.text or d.finished:
            yield sse(
                {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "text": d.text,
                            "logprobs": None,
                            "finish_reason": FINISH.get(d.finish_reason or "", "stop")
                            if d.finished
                            else None,
                        }
                    ],
                }
            )
    yield sse("[DONE]")
