"""Lightning training of drafter + head on trajectories from a tiny target."""

import json
import subprocess
import sys

import pytest
import torch

from adaflash.config import DistillConfig, EngineConfig, SamplingParams
from adaflash.distill import simulate_acceptance
from adaflash.engine.engine import Engine
from adaflash.models.drafter import load_drafter
from adaflash.models.target import load_target
from adaflash.workloads import Trajectory
from lightning_modules.train import fit, new_drafter, save_run
from tests.tiny import VOCAB, add_tokenizer, build_checkpoint


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = add_tokenizer(
        build_checkpoint(tmp_path_factory.mktemp("t"), "llama", seed=6, layers=6)
    )
    target = load_target(folder)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (6,), generator=g).tolist() for _ in range(8)]
    recs = Engine(target, None, EngineConfig(policy="ar")).generate(
        prompts, SamplingParams(max_new_tokens=40, ignore_eos=True)
    )
    trajs = [
        Trajectory(f"t{i}", "chat", p, list(r.output_ids), "", r.finish_reason)
        for i, (p, r) in enumerate(zip(prompts, recs, strict=True))
    ]
    return folder, target, trajs


def test_fit_lowers_loss_and_raises_simulated_acceptance(setup, tmp_path):
    _, target, trajs = setup
    drafter = new_drafter(target, mask_token_id=VOCAB - 1, num_layers=2, block_size=8)
    seqs = [(t.prompt_ids + t.response_ids, len(t.prompt_ids)) for t in trajs]
    before = simulate_acceptance(drafter, target, seqs, anchors_per_seq=None)
    cfg = DistillConfig(epochs=15, anchors_per_seq=16, accumulate=1, drafter_lr=3e-3, head_lr=3e-3)
    result = fit(drafter, target, trajs, trajs[:2], cfg, log_dir=tmp_path / "logs", progress=False)
    after = simulate_acceptance(result.drafter, target, seqs, anchors_per_seq=None)
    h = result.history
    assert result.steps == 15 * len(trajs) and result.samples == 15 * len(trajs)
    assert sum(r["draft_loss"] for r in h[-8:]) < 0.5 * sum(r["draft_loss"] for r in h[:8])
    assert after.accept_len > before.accept_len + 0.5, (before.summary(), after.summary())
    assert result.val_accept_len is not None
    out = save_run(result, tmp_path / "drafter", title="test", data={"n": len(trajs)}, cfg=cfg)
    again = load_drafter(out)
    assert again.head_trained and (out / "README.md").is_file()
    card = json.loads((out / "training.json").read_text())
    assert card["settings"]["loss"] == "opd" and card["result"]["steps"] == result.steps


def test_osd_baseline_trains_too(setup):
    _, target, trajs = setup
    drafter = new_drafter(target, mask_token_id=VOCAB - 1, num_layers=1, block_size=4)
    result = fit(
        drafter, target, trajs[:2], None, DistillConfig(loss="osd", epochs=1), progress=False
    )
    assert result.steps == 1 and all(r["draft_loss"] > 0 for r in result.history)


def test_train_cli_writes_a_dflash_folder(setup, tmp_path):
    folder, _, trajs = setup
    data = tmp_path / "trajs.jsonl"
    data.write_text("".join(t.to_json() + "\n" for t in trajs))
    out = tmp_path / "cli-drafter"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "train",
            str(data),
            "--out",
            str(out),
            "--target",
            str(folder),
            "--target-dtype",
            "float32",
            "--layers",
            "1",
            "--block-size",
            "4",
            "--epochs",
            "1",
            "--anchors",
            "4",
            "--mask-token-id",
            str(VOCAB - 1),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = load_drafter(out)
    assert d.cfg.block_size == 4 and d.cfg.num_layers == 1
    assert json.loads((out / "training.json").read_text())["data"]["sequences"] == len(trajs)


def test_bf16_autocast_applies_only_where_bf16_is_native(monkeypatch):
    from lightning_modules import train

    asked = DistillConfig(bf16_autocast=True)
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(train, "native_bf16", lambda: False)
    assert train.effective(asked).bf16_autocast is False  # reference kernels: fp32 is faster
    assert train.effective(DistillConfig()).bf16_autocast is False
    monkeypatch.setattr(train, "native_bf16", lambda: True)
    assert train.effective(asked) == asked
