"""Online loop against real databases: training rounds, the promotion gate, hot swap, faults."""

import os
import signal
import subprocess
import sys
import time
import types
from dataclasses import replace

import pytest
import torch
from sqlalchemy import select
from sqlalchemy.orm import Session

import lightning_modules.online
from adaflash.config import DistillConfig, EngineConfig, SamplingParams
from adaflash.engine.engine import Engine
from adaflash.engine.records import MemorySink
from adaflash.models.drafter import save_drafter
from adaflash.models.target import load_target
from app.training.hotswap import VersionWatcher
from db.buffer import count_unconsumed, write_records
from db.models import TrajectoryRow
from db.registry import Registry
from db.runs import claim_run, list_runs
from lightning_modules.online import OnlineConfig, training_round
from lightning_modules.train import new_drafter
from tests.tiny import VOCAB, add_tokenizer, build_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = add_tokenizer(
        build_checkpoint(tmp_path_factory.mktemp("t"), "llama", seed=8, layers=6)
    )
    target = load_target(folder)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (5,), generator=g).tolist() for _ in range(12)]
    sink = MemorySink()
    Engine(target, None, EngineConfig(policy="ar"), sink=sink).generate(
        prompts, SamplingParams(max_new_tokens=24, ignore_eos=True)
    )
    return folder, target, sink.requests()


@pytest.fixture
def online(db, tmp_path, tiny):
    _, target, records = tiny
    registry = Registry(db, tmp_path / "weights")
    shipped = new_drafter(target, mask_token_id=VOCAB - 1, num_layers=1, block_size=4)
    registry.register_folder(save_drafter(shipped, tmp_path / "shipped"))
    write_records(db, records)
    return registry, target


@pytest.fixture
def trained(monkeypatch) -> list[list[str]]:
    """The ids of the trajectories each training round's ``fit`` was given, round by round."""
    rounds: list[list[str]] = []
    fit = lightning_modules.online.fit

    def spy(drafter, target, data, *a, **k):
        rounds.append([t.id for t in data])
        return fit(drafter, target, data, *a, **k)

    monkeypatch.setattr("lightning_modules.online.fit", spy)
    return rounds


FAST = OnlineConfig(
    retain=0,  # the shipped trajectories answer for the default target, not the tiny one
    min_new=8,
    min_samples=4,
    holdout_fraction=0.25,
    gate_anchors=8,
    distill=DistillConfig(epochs=2, anchors_per_seq=8, accumulate=1, drafter_lr=3e-3, head_lr=3e-3),
)


def test_training_round_publishes_gates_and_consumes_exactly_the_trained_rows(db, online):
    registry, target = online
    run = claim_run(db, "threshold")
    out = training_round(db, registry, target, FAST, run)
    assert out.status == "succeeded" and out.version_id == "v0001"
    v = registry.get("v0001")
    assert v.parent == "v0000" and v.loss == "opd" and v.samples == 9
    gate = v.metrics["gate"]
    assert gate["holdout"] == 3
    assert v.status == ("active" if out.promoted else "rejected")
    assert out.promoted == (gate["candidate_accept_len"] >= gate["active_accept_len"])
    with Session(db) as s:
        rows = list(s.scalars(select(TrajectoryRow).order_by(TrajectoryRow.seq)))
    assert [r.consumed_by for r in rows] == [run] * 9 + [None] * 3  # held-out stay unconsumed
    assert (v.data_from, v.data_to) == (rows[0].seq, rows[8].seq)
    assert list_runs(db)[0].status == "succeeded" and list_runs(db)[0].steps > 0


def test_a_round_trains_on_the_replay_window_too_and_consumes_only_its_new_rows(
    db, online, tiny, trained
):
    """``replay``: a round trains on the latest rows earlier rounds consumed as well as on its
    new ones, and marks only the new ones consumed (the held-out rows never enter the window)."""
    registry, target = online
    first = claim_run(db, "admin")
    training_round(db, registry, target, FAST, first)  # seq 1–9 consumed, 10–12 held out
    write_records(db, [replace(r, request_id=f"{r.request_id}-b") for r in tiny[2][:9]])
    trained.clear()  # the second round's alone
    second = claim_run(db, "admin")
    out = training_round(db, registry, target, replace(FAST, replay=5), second)
    with Session(db) as s:
        rows = list(s.scalars(select(TrajectoryRow).order_by(TrajectoryRow.seq)))
    # new rows: seq 10–21, the last 3 held out; the window: the 5 latest consumed, seq 5–9
    assert trained == [[r.request_id for r in rows[4:18]]]
    assert [r.consumed_by for r in rows] == [first] * 9 + [second] * 9 + [None] * 3
    assert out.metrics["replayed"] == 5 and registry.get(out.version_id).samples == 14
    with pytest.raises(ValueError, match="replay"):
        OnlineConfig(replay=-1)


def test_a_round_also_trains_on_trajectories_of_the_domains_to_retain(
    db, online, tiny, tmp_path, trained
):
    """``retain``: each round trains on that many trajectories of ``retain_from`` (gzipped JSONL
    read too) beside its new rows, a seeded draw per run; they count as samples, not consumed."""
    import gzip

    from adaflash.workloads import Trajectory

    registry, target = online
    old = [
        Trajectory(f"old-{i}", "chat", list(r.prompt_ids), list(r.output_ids), "", "length")
        for i, r in enumerate(tiny[2])
    ]
    path = tmp_path / "old.jsonl.gz"
    path.write_bytes(gzip.compress("\n".join(t.to_json() for t in old).encode()))
    cfg = replace(FAST, retain=4, retain_from=(str(path),))
    out = training_round(db, registry, target, cfg, claim_run(db, "admin"))
    kept = [i for i in trained[0] if i.startswith("old-")]
    assert len(kept) == 4 and len(set(kept)) == 4 and len(trained[0]) == 4 + 9
    assert out.metrics["retained"] == 4 and registry.get(out.version_id).samples == 13
    assert count_unconsumed(db) == 3  # the new rows consumed as without it, held-out kept
    assert lightning_modules.online.retained(cfg, 7) == lightning_modules.online.retained(cfg, 7)
    assert lightning_modules.online.retained(replace(cfg, retain=0), 7) == []
    with pytest.raises(ValueError, match="retain"):
        OnlineConfig(retain=2, retain_from=())
    with pytest.raises(ValueError, match="retain"):
        OnlineConfig(retain=-1)


def test_retain_draws_on_the_shipped_trajectories_only_for_the_target_that_wrote_them(
    db, online, tiny, tmp_path
):
    """The shipped trajectories are the default target's answers: a trainer of any other
    target turns ``retain`` off unless ``retain_from`` names files of its own."""
    import json

    from adaflash.pull import DEFAULT_MODELS, DEFAULT_TARGET, MARKER, pulled_as
    from app.training.trainer import TrainerService
    from lightning_modules.online import SHIPPED_DOMAINS, for_target

    folder = tiny[0]
    shipped = OnlineConfig(retain=8)
    assert shipped.retain_from == SHIPPED_DOMAINS and pulled_as(folder) is None
    assert for_target(shipped, folder).retain == 0
    assert TrainerService(db, online[0], folder, shipped).online.retain == 0
    own = replace(shipped, retain_from=(str(tmp_path / "own.jsonl"),))
    assert for_target(own, folder) == own
    pulled = tmp_path / "pulled"
    pulled.mkdir()
    source = DEFAULT_MODELS[DEFAULT_TARGET].requirement
    (pulled / MARKER).write_text(json.dumps({"source": source}))
    assert pulled_as(pulled) == DEFAULT_TARGET and for_target(shipped, pulled) == shipped


def test_gate_rejects_a_worse_candidate(db, online):
    registry, target = online
    strict = OnlineConfig(
        retain=0,
        min_new=8,
        min_samples=4,
        holdout_fraction=0.25,
        gate_anchors=8,
        gate_margin=100.0,  # demands an impossible improvement
        distill=DistillConfig(epochs=1, anchors_per_seq=4),
    )
    out = training_round(db, registry, target, strict, claim_run(db, "admin"))
    assert not out.promoted and "below the active" in out.reason
    assert registry.get("v0001").status == "rejected" and registry.active().id == "v0000"


@pytest.mark.parametrize(("candidate", "active"), [(1.49, 1.50), (1.50, 1.50)])
def test_by_default_a_candidate_that_measures_worse_is_not_promoted(
    db, online, monkeypatch, candidate, active
):
    """The gate's default demands the candidate measure at least as well as the active version
    on the held-out traffic: 0.01 τ worse is rejected (the gate once let 0.05 through), level is
    promoted. The replay's τ is fixed here (candidate first, then the active version, as the
    round replays them); the point is the decision."""
    registry, target = online
    reported = [candidate, active]
    monkeypatch.setattr(
        "lightning_modules.online.simulate_acceptance",
        lambda *_a, **_k: types.SimpleNamespace(accept_len=reported.pop(0)),
    )
    cfg = replace(FAST, distill=replace(FAST.distill, epochs=1))
    assert cfg.gate_margin == 0.0
    out = training_round(db, registry, target, cfg, claim_run(db, "admin"))
    assert not reported and out.status == "succeeded"
    worse = candidate < active
    assert out.promoted == (not worse) and ("below the active" in out.reason) == worse
    assert registry.active().id == ("v0000" if worse else out.version_id)


def test_failed_round_publishes_nothing(db, online):
    registry, target = online
    bad = OnlineConfig(retain=0, min_new=8, min_samples=4, distill=DistillConfig(anchors_per_seq=4))
    registry.get("v0000").path.joinpath("model.safetensors").write_bytes(b"corrupt")
    out = training_round(db, registry, target, bad, claim_run(db, "admin"))
    assert out.status == "failed" and "sha256" in out.reason
    assert [v.id for v in registry.list()] == ["v0000"]
    assert count_unconsumed(db) == 12 and list_runs(db)[0].status == "failed"


def test_hot_swap_follows_active_version_and_refuses_a_corrupt_one(db, online):
    registry, target = online
    engine = Engine(
        target, registry.load("v0000"), EngineConfig(policy="head"), drafter_version="v0000"
    )
    watcher = VersionWatcher(engine, registry, "float32")
    good = registry.publish(
        new_drafter(target, mask_token_id=VOCAB - 1, num_layers=1, block_size=4, seed=1),
        parent="v0000",
        loss="opd",
        samples=1,
        data=(1, 1),
        metrics={},
    )
    registry.activate(good.id)
    assert watcher.check() == good.id
    rec = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert engine.version == good.id and len(rec.output_ids) == 8
    bad = registry.publish(
        new_drafter(target, mask_token_id=VOCAB - 1, num_layers=1, block_size=4, seed=2),
        parent=good.id,
        loss="opd",
        samples=1,
        data=(1, 1),
        metrics={},
    )
    registry.activate(bad.id)
    (bad.path / "model.safetensors").write_bytes(b"garbage")  # corrupted after promotion
    assert watcher.check() is None and "refused" in (watcher.last_error or "")
    rec = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert engine.version == good.id and len(rec.output_ids) == 8  # serving goes on


def test_killed_trainer_leaves_no_partial_version_and_serving_goes_on(
    db, db_url, online, tiny, tmp_path
):
    folder, target, _ = tiny
    registry, _ = online
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "trainer",
        "--once",
        "--database-url",
        db_url,
        "--weights-dir",
        str(registry.weights_dir),
        "--target",
        str(folder),
        "--epochs",
        "2000",  # minutes of fitting: 50 epochs could finish before the kill on a fast CPU
        "--anchors",
        "8",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    engine = Engine(
        target, registry.load("v0000"), EngineConfig(policy="head"), drafter_version="v0000"
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (list_runs(db) and list_runs(db)[0].status == "running"):
        time.sleep(0.2)
    time.sleep(2.0)  # well inside the 2000-epoch fit
    assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
    # serving is unaffected while the trainer works and when it dies
    out = engine.generate([[9, 8, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert len(out[0].output_ids) == 6
    assert [v.id for v in registry.list()] == ["v0000"]
    assert not [p for p in registry.weights_dir.iterdir() if p.name.startswith("v0001")]
    assert count_unconsumed(db) == 12  # nothing marked consumed
    # the next trainer start cleans up and records the dead run as failed
    from app.training.trainer import TrainerService

    service = TrainerService(db, registry, folder, FAST)
    service.cfg = type(service.cfg)(nice=0)
    service.prepare()
    assert list_runs(db)[0].status == "failed"
    assert not list(registry.weights_dir.glob(".tmp-*"))


def test_trainer_service_runs_on_threshold_and_on_admin_request(db, online, tiny):
    from app.training.trainer import TrainerConfig, TrainerService
    from db.runs import request_run

    folder, _, _ = tiny
    registry, _ = online
    service = TrainerService(db, registry, folder, FAST, TrainerConfig(nice=0, threads=1))
    assert service.tick().status == "succeeded"  # 12 ≥ min_new 8
    assert service.tick() is None  # 3 held out < min_new
    request_run(db, "admin")
    out = service.tick()
    assert out is not None and out.status == "skipped"  # 3 < min_samples 4: nothing to learn
    assert list_runs(db)[0].trigger == "admin"


def test_a_trainer_stopped_mid_run_records_the_run_failed(db, db_url, online, tiny, tmp_path):
    """SIGTERM (what `serve` sends at shutdown) while a run trains: the process exits promptly
    and the run's row says failed and why, instead of staying 'running'. Its settings come from
    the JSON that `serve` writes."""
    import json

    folder, _, _ = tiny
    registry, _ = online
    settings = tmp_path / "settings.json"
    slow = OnlineConfig(
        min_new=4, min_samples=4, distill=DistillConfig(epochs=400, anchors_per_seq=8)
    )
    settings.write_text(
        json.dumps({"online": slow.to_dict(), "trainer": {"poll_s": 0.3, "nice": 0}})
    )
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "trainer",
        "--database-url",
        db_url,
        "--weights-dir",
        str(registry.weights_dir),
        "--target",
        str(folder),
        "--settings",
        str(settings),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (list_runs(db) and list_runs(db)[0].status == "running"):
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.2)
    time.sleep(1.0)  # inside the 400-epoch fit
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert time.time() - t0 < 10
    run = list_runs(db)[0]
    assert run.status == "failed" and "shut down" in (run.error or "")
    assert [v.id for v in registry.list()] == ["v0000"]
