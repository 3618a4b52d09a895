"""Admin endpoints (bearer token): trigger training, list versions and runs, promote, roll back,
change γ / policy live. Without a configured token they are disabled, not open."""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, Request

from app.api.schemas import ADMIN_RESPONSES, ConfigRequest, PromoteRequest, RollbackRequest
from app.api.streaming import ApiError
from app.service import Service
from db.registry import VersionError


def version_json(v: Any) -> dict[str, Any]:
    d = asdict(v)
    d["path"] = str(d["path"])
    for k in ("created_at", "promoted_at"):
        d[k] = d[k].isoformat() if d[k] else None
    return d


def run_json(r: Any) -> dict[str, Any]:
    return {
        "id": r.id,
        "trigger": r.trigger,
        "status": r.status,
        "loss": r.loss,
        "requested_at": r.requested_at.isoformat() if r.requested_at else None,
        "started_at": r.started_at.isoformat() if r.started_at else None,
        "finished_at": r.finished_at.isoformat() if r.finished_at else None,
        "samples": r.samples,
        "steps": r.steps,
        "seconds": r.seconds,
        "version_id": r.version_id,
        "error": r.error,
        "history": r.history or [],
    }


def router(service: Service) -> APIRouter:
    def require_admin(request: Request) -> None:
        token = service.cfg.admin_token
        if not token:
            raise ApiError(
                403,
                "the admin API is disabled: start the server with --admin-token "
                "(or ADAFLASH_ADMIN_TOKEN) to enable it",
                "permission_error",
            )
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise ApiError(401, "missing or wrong bearer token", "authentication_error")

    r = APIRouter(
        prefix="/admin",
        tags=["admin"],
        dependencies=[Depends(require_admin)],
        responses=ADMIN_RESPONSES,
    )

    # every handler below touches the database or loads weights: off the event loop
    @r.post("/train")
    async def train() -> dict[str, Any]:
        run_id, note = await asyncio.to_thread(service.request_training)
        return {"run_id": run_id, "trainer_running": service.trainer_alive(), "note": note}

    @r.get("/versions")
    async def versions() -> dict[str, Any]:
        active, listed = await asyncio.to_thread(
            lambda: (service.active_version(), service.versions())
        )
        return {
            "serving": service.backend.version,
            "active": active.id if active else None,
            "versions": [version_json(v) for v in listed],
            "last_swap_error": service.watcher.last_error,
        }

    @r.get("/runs")
    async def runs() -> dict[str, Any]:
        return {"runs": [run_json(x) for x in await asyncio.to_thread(service.runs)]}

    @r.post("/promote")
    async def promote(body: PromoteRequest) -> dict[str, Any]:
        try:
            v = await asyncio.to_thread(service.promote, body.version, body.reason)
        except VersionError as exc:
            raise ApiError(409, str(exc), "conflict") from exc
        return {"active": v.id, "serving": service.backend.version}

    @r.post("/rollback")
    async def rollback(body: RollbackRequest) -> dict[str, Any]:
        try:
            v = await asyncio.to_thread(service.rollback, body.version)
        except VersionError as exc:
            raise ApiError(409, str(exc), "conflict") from exc
        return {"active": v.id}

    @r.post("/config")
    async def config(body: ConfigRequest) -> dict[str, Any]:
        try:
            service.configure(body.policy, body.gamma)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        return {
            "policy": body.policy or service.backend.policy,
            "gamma": body.gamma or service.backend.gamma,
        }

    return r
