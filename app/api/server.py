"""The FastAPI application: OpenAI and SGLang APIs, /metrics, admin, and the Gradio UI at /ui.

Errors always come back as JSON ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
for anything the client can fix: validation errors and malformed JSON (400), oversized bodies
(413), unknown models (404), disabled or unauthorised admin calls (403/401). The OpenAPI
document says exactly that (FastAPI's default 422 is replaced by 400).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from adaflash import __version__
from app.api import admin_routes, metrics, openai_routes, sglang_routes
from app.api.streaming import ApiError
from app.service import Service

access_log = logging.getLogger("adaflash.access")


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413, whether or not they declare a
    Content-Length."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "").startswith("/ui"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise ApiError(413, f"request body over {self.limit} bytes")
            return msg

        try:
            await self.app(scope, limited, send)
        except ApiError:
            await self._too_large(send)

    async def _too_large(self, send: Send) -> None:
        resp = ApiError(413, f"request body is over the limit of {self.limit} bytes").response()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": resp.body})


class AccessLog:
    """One log line per HTTP request when its response has been sent: method, path, status,
    seconds, and for generations the token counts, τ, verify length and finish reason that the
    route left in ``request.state.access``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "").startswith("/ui"):
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), 0

        async def logged(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)
            if msg["type"] == "http.response.body" and not msg.get("more_body"):
                extra = scope.get("state", {}).get("access") or {}
                fields = " ".join(f"{k}={v}" for k, v in extra.items())
                access_log.info(
                    "%s %s %d %.3fs %s",
                    scope["method"],
                    scope["path"],
                    status,
                    time.perf_counter() - t0,
                    fields,
                )

        await self.app(scope, receive, logged)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or (where or None)
        if err.get("type") == "json_invalid":
            parts.append("the body is not valid JSON")
        elif err.get("type") == "extra_forbidden":
            parts.append(f"unknown field {where!r}")
        else:
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", param


def create_app(service: Service, ui: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(service.start)
        try:
            yield
        finally:
            # off the event loop: streams keep delivering their last tokens while we drain
            await asyncio.to_thread(service.stop)

    app = FastAPI(
        title="AdaFlash",
        version=__version__,
        lifespan=lifespan,
        description="Self-improving speculative decoding: OpenAI- and SGLang-"
        "compatible APIs, Prometheus metrics, admin, and a Gradio UI.",
    )
    app.add_middleware(BodyLimit, limit=service.cfg.max_body_bytes)
    app.add_middleware(AccessLog)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return ApiError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "the body could not be parsed (is it valid UTF-8 JSON?)"
        return ApiError(
            exc.status_code,
            detail,
            "not_found_error" if exc.status_code == 404 else "invalid_request_error",
        ).response()

    app.include_router(openai_routes.router(service))
    app.include_router(sglang_routes.router(service))
    app.include_router(admin_routes.router(service))

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        return PlainTextResponse(
            metrics.render(service), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    def openapi() -> dict[str, Any]:
        """FastAPI documents validation errors as 422; this server answers them with 400 (as
        the OpenAI API does), documented on every route that takes a body."""
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    responses = op.get("responses", {})
                    if responses.pop("422", None) is not None and "400" not in responses:
                        responses["400"] = {
                            "description": "invalid request",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/ErrorResponse"}
                                }
                            },
                        }
            comps = schema.get("components", {}).get("schemas", {})
            comps.pop("HTTPValidationError", None)
            comps.pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/", include_in_schema=False)
    async def root() -> Any:
        return RedirectResponse("/ui/" if ui else "/docs")

    if ui:
        import gradio as gr

        from ui.app import build_ui

        app = gr.mount_gradio_app(app, build_ui(service), path="/ui")
    return app
