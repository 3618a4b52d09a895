"""Admin endpoints (bearer token): trigger training, list versions and runs, promote, roll back,
change γ / policy live. Without a configured token they are disabled, not open."""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, Request

from app.schemas import ConfigRequest, PromoteRequest, RollbackRequest
from app.service import Service
from app.streaming import ApiError
from db.registry import VersionError
from db.runs import list_runs, request_run


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

    r = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])

    @r.post("/train")
    async def train() -> dict[str, Any]:
        run_id = request_run(service.db, "admin")
        return {
            "run_id": run_id,
            "trainer_running": service.trainer_alive(),
            "note": None
            if service.trainer_alive()
            else "no trainer process is attached to this server; start `adaflash trainer` "
            "with the same database URL to run the request",
        }

    @r.get("/versions")
    async def versions() -> dict[str, Any]:
        active = service.registry.active()
        return {
            "serving": service.engine.version,
            "active": active.id if active else None,
            "versions": [version_json(v) for v in service.registry.list()],
            "last_swap_error": service.watcher.last_error,
        }

    @r.get("/runs")
    async def runs() -> dict[str, Any]:
        return {"runs": [run_json(x) for x in list_runs(service.db)]}

    @r.post("/promote")
    async def promote(body: PromoteRequest) -> dict[str, Any]:
        try:
            v = service.registry.activate(body.version, reason=body.reason)
        except VersionError as exc:
            raise ApiError(409, str(exc), "conflict") from exc
        await asyncio.to_thread(service.watcher.check)  # a swap may take a while (SGLang)
        return {"active": v.id, "serving": service.engine.version}

    @r.post("/rollback")
    async def rollback(body: RollbackRequest) -> dict[str, Any]:
        try:
            v = service.registry.rollback(body.version)
        except VersionError as exc:
            raise ApiError(409, str(exc), "conflict") from exc
        await asyncio.to_thread(service.watcher.check)  # a swap may take a while (SGLang)
        return {"active": v.id}

    @r.post("/config")
    async def config(body: ConfigRequest) -> dict[str, Any]:
        try:
            service.engine.set_policy(body.policy, body.gamma)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        service.runner.notify()
        return {
            "policy": body.policy or service.engine.policy,
            "gamma": body.gamma or service.engine.gamma,
        }

    return r
