import pytest
import torch

from adaflash.config import DrafterConfig, TargetConfig
from adaflash.models.drafter import DFlashDrafter, save_drafter
from db.registry import Registry, VersionError
from db.runs import claim_run, fail_stale_runs, finish_run, list_runs, pending_request, request_run

TARGET = TargetConfig("llama", 96, 32, 64, 6, 4, 2, 8)


def drafter(seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(
        DrafterConfig.for_target(TARGET, num_layers=1, mask_token_id=95, block_size=4)
    )


@pytest.fixture
def registry(db, tmp_path):
    reg = Registry(db, tmp_path / "weights")
    reg.register_folder(save_drafter(drafter(), tmp_path / "shipped"))
    return reg


def test_initial_version_is_active(registry):
    v = registry.active()
    assert v is not None and v.id == "v0000" and v.status == "active"
    assert registry.load("v0000").cfg.block_size == 4


def test_publish_promote_reject_rollback(registry):
    a = registry.publish(
        drafter(1), parent="v0000", loss="opd", samples=10, data=(1, 10), metrics={"x": 1}
    )
    assert a.id == "v0001" and a.status == "candidate" and (a.path / "config.json").is_file()
    registry.activate(a.id)
    assert registry.active().id == "v0001" and registry.get("v0000").status == "retired"
    b = registry.publish(
        drafter(2), parent="v0001", loss="opd", samples=5, data=(11, 15), metrics={}
    )
    registry.reject(b.id, "worse")
    assert registry.get(b.id).status == "rejected" and registry.get(b.id).reason == "worse"
    with pytest.raises(VersionError, match="rejected"):
        registry.activate(b.id)
    assert registry.rollback().id == "v0000"  # one action back to the previous good version
    assert registry.get("v0001").status == "retired"
    assert registry.rollback("v0001").id == "v0001"
    registry.update_metrics("v0001", gate={"tau": 2.0})
    assert registry.get("v0001").metrics["gate"] == {"tau": 2.0}


def test_corrupted_version_is_refused_and_active_stays(registry):
    v = registry.publish(drafter(3), parent="v0000", loss="opd", samples=1, data=(1, 1), metrics={})
    weights = v.path / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-5] ^= 0xFF
    weights.write_bytes(bytes(raw))
    with pytest.raises(VersionError, match="sha256"):
        registry.load(v.id)
    with pytest.raises(VersionError):
        registry.activate(v.id)
    assert registry.active().id == "v0000"


def test_publish_is_atomic_when_the_writer_dies(registry, monkeypatch):
    import db.registry as mod

    def boom(*a, **k):
        raise KeyboardInterrupt  # the process is being killed mid-write

    monkeypatch.setattr(mod, "save_drafter", boom)
    with pytest.raises(KeyboardInterrupt):
        registry.publish(drafter(4), parent="v0000", loss="opd", samples=1, data=(1, 1), metrics={})
    assert [v.id for v in registry.list()] == ["v0000"]
    assert not any(p.name.startswith("v0001") for p in registry.weights_dir.iterdir())
    assert not list(registry.weights_dir.glob(".tmp-*"))


def test_runs_one_at_a_time_and_stale_runs_fail(db):
    r1 = request_run(db, "admin")
    assert request_run(db, "admin") == r1  # an open request covers the next one
    assert pending_request(db) == r1
    assert claim_run(db, "admin", r1) == r1
    assert claim_run(db, "threshold") is None  # one job at a time
    assert fail_stale_runs(db) == 1
    assert list_runs(db)[0].status == "failed"
    r2 = claim_run(db, "threshold")
    finish_run(db, r2, status="succeeded", samples=3, steps=2, version_id="v0001")
    assert list_runs(db)[0].version_id == "v0001"
