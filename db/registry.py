"""Immutable drafter + head versions: published atomically to disk, recorded in the database.

A version is a DFlash-format folder ``<weights>/<id>/`` plus a ``weight_versions`` row holding its
sha256, parent, data range, metrics and status (candidate → active | rejected; active → retired).
Publishing writes to a temporary folder and renames it, so a killed trainer leaves no partial
version. Loading checks the hash and the tensors, so a corrupted folder is refused with a clear
error and whatever is serving stays.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from adaflash.models.drafter import DFlashDrafter, load_drafter, save_drafter
from db.models import WeightVersionRow

WEIGHTS_FILE = "model.safetensors"


class VersionError(RuntimeError):
    """A version cannot be used; the message says which and why."""


@dataclass(frozen=True)
class Version:
    id: str
    parent: str | None
    path: Path
    sha256: str
    status: str
    loss: str | None
    created_at: datetime
    promoted_at: datetime | None
    samples: int
    data_from: int | None
    data_to: int | None
    metrics: dict[str, Any]
    reason: str | None

    @classmethod
    def of(cls, row: WeightVersionRow) -> Version:
        return cls(
            row.id,
            row.parent,
            Path(row.path),
            row.sha256,
            row.status,
            row.loss,
            row.created_at,
            row.promoted_at,
            row.samples,
            row.data_from,
            row.data_to,
            dict(row.metrics or {}),
            row.reason,
        )

    @property
    def gate_tau(self) -> tuple[float, float] | None:
        """(the replaced version's τ, this one's) on the same held-out rows at its promotion
        gate (``lightning_modules/online.py``), or None for a version that met no gate."""
        gate = self.metrics.get("gate") or {}
        if "candidate_accept_len" not in gate:
            return None
        return float(gate["active_accept_len"]), float(gate["candidate_accept_len"])


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _now() -> datetime:
    return datetime.now(tz=UTC)


class Registry:
    def __init__(self, engine: Engine, weights_dir: str | Path) -> None:
        self.engine = engine
        self.weights_dir = Path(weights_dir)
        self.weights_dir.mkdir(parents=True, exist_ok=True)

    # -- reading ---------------------------------------------------------------------------
    def list(self) -> list[Version]:
        with Session(self.engine, expire_on_commit=False) as s:
            rows = s.scalars(select(WeightVersionRow).order_by(WeightVersionRow.created_at))
            return [Version.of(r) for r in rows]

    def get(self, version_id: str) -> Version:
        with Session(self.engine, expire_on_commit=False) as s:
            row = s.get(WeightVersionRow, version_id)
            if row is None:
                raise VersionError(f"no version {version_id!r}")
            return Version.of(row)

    def active(self) -> Version | None:
        with Session(self.engine, expire_on_commit=False) as s:
            row = s.scalars(
                select(WeightVersionRow).where(WeightVersionRow.status == "active")
            ).first()
            return Version.of(row) if row else None

    def load(self, version_id: str, dtype: str = "float32") -> DFlashDrafter:
        """Load a version's drafter after checking its folder against the recorded hash."""
        v = self.get(version_id)
        weights = v.path / WEIGHTS_FILE
        if not weights.is_file():
            raise VersionError(f"version {v.id}: {weights} is missing")
        if file_sha256(weights) != v.sha256:
            raise VersionError(
                f"version {v.id}: {weights} does not match its recorded sha256 "
                "(the file is corrupted or was modified)"
            )
        try:
            return load_drafter(v.path, dtype)
        except Exception as exc:
            raise VersionError(f"version {v.id}: cannot be loaded ({exc})") from exc

    # -- writing ---------------------------------------------------------------------------
    def next_id(self) -> str:
        with Session(self.engine, expire_on_commit=False) as s:
            ids = [i for i in s.scalars(select(WeightVersionRow.id)) if i[1:].isdigit()]
        return f"v{max((int(i[1:]) for i in ids), default=0) + 1:04d}"

    def register_folder(
        self,
        folder: Path,
        version_id: str = "v0000",
        status: str = "active",
        note: str = "initial drafter",
    ) -> Version:
        """Copy an existing drafter folder in as a version (the shipped drafter becomes v0000)."""
        load_drafter(folder)  # refuse a broken folder before it becomes a version
        return self._publish_dir(
            lambda tmp: shutil.copytree(folder, tmp, dirs_exist_ok=True),
            version_id,
            parent=None,
            status=status,
            loss=None,
            metrics={"note": note},
            samples=0,
            data=(None, None),
        )

    def publish(
        self,
        drafter: DFlashDrafter,
        *,
        parent: str | None,
        loss: str | None,
        samples: int,
        data: tuple[int | None, int | None],
        metrics: dict[str, Any],
    ) -> Version:
        """Write a new candidate version atomically and record it."""
        vid = self.next_id()
        return self._publish_dir(
            lambda tmp: save_drafter(
                drafter, tmp, metadata={"version": vid, "parent": parent}, dtype="bfloat16"
            ),
            vid,
            parent=parent,
            status="candidate",
            loss=loss,
            metrics=metrics,
            samples=samples,
            data=data,
        )

    def _publish_dir(
        self,
        write: Any,
        vid: str,
        *,
        parent: str | None,
        status: str,
        loss: str | None,
        metrics: dict[str, Any],
        samples: int,
        data: tuple[int | None, int | None],
    ) -> Version:
        final = self.weights_dir / vid
        if final.exists():
            raise VersionError(f"version folder {final} already exists; versions are immutable")
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{vid}-", dir=self.weights_dir))
        try:
            write(tmp)
            sha = file_sha256(tmp / WEIGHTS_FILE)
            tmp.rename(final)  # atomic on one filesystem: the version appears whole or not at all
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        row = WeightVersionRow(
            id=vid,
            created_at=_now(),
            parent=parent,
            path=str(final),
            sha256=sha,
            status=status,
            loss=loss,
            data_from=data[0],
            data_to=data[1],
            samples=samples,
            metrics=metrics,
            promoted_at=_now() if status == "active" else None,
        )
        with Session(self.engine, expire_on_commit=False) as s, s.begin():
            if status == "active":
                s.execute(
                    update(WeightVersionRow)
                    .where(WeightVersionRow.status == "active")
                    .values(status="retired")
                )
            s.add(row)
        return Version.of(row)

    def update_metrics(self, version_id: str, **metrics: Any) -> None:
        with Session(self.engine, expire_on_commit=False) as s, s.begin():
            row = s.get(WeightVersionRow, version_id)
            if row is None:
                raise VersionError(f"no version {version_id!r}")
            row.metrics = {**(row.metrics or {}), **metrics}

    def activate(self, version_id: str, reason: str | None = None) -> Version:
        """Make a version the active one (promotion or rollback) — after checking it loads."""
        v = self.get(version_id)
        if v.status == "rejected" and reason is None:
            raise VersionError(
                f"version {v.id} was rejected ({v.reason}); give a reason to activate it anyway"
            )
        self.load(version_id)  # never activate what the server could not load
        with Session(self.engine, expire_on_commit=False) as s, s.begin():
            s.execute(
                update(WeightVersionRow)
                .where(WeightVersionRow.status == "active")
                .values(status="retired")
            )
            s.execute(
                update(WeightVersionRow)
                .where(WeightVersionRow.id == version_id)
                .values(
                    status="active",
                    promoted_at=_now(),
                    reason=reason if reason is not None else v.reason,
                )
            )
        return self.get(version_id)

    def reject(self, version_id: str, reason: str) -> Version:
        with Session(self.engine, expire_on_commit=False) as s, s.begin():
            s.execute(
                update(WeightVersionRow)
                .where(WeightVersionRow.id == version_id)
                .values(status="rejected", reason=reason)
            )
        return self.get(version_id)

    def rollback(self, to: str | None = None) -> Version:
        """Activate ``to``, or else the version that was active before the current one."""
        if to is None:
            earlier = [v for v in self.list() if v.status == "retired" and v.promoted_at]
            if not earlier:
                raise VersionError("nothing to roll back to: no earlier active version")
            to = max(earlier, key=lambda v: v.promoted_at or _now()).id
        return self.activate(to, reason=f"rollback to {to}")

    def clean_partial(self) -> int:
        """Remove temporary folders left by a publisher that died mid-write."""
        stale = list(self.weights_dir.glob(".tmp-*"))
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)
        return len(stale)
