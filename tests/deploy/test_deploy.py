"""Deployment files and the CUDA-only parts, checked on a CPU machine."""

import json
import subprocess
import sys
from pathlib import Path

import compose
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from adaflash.config import DistillConfig, DrafterConfig, TargetConfig
from adaflash.models.drafter import DFlashDrafter, save_drafter
from app.backends.sglang_checks import BackendUnavailable, dflash_compat_problems, require_sglang

REPO = Path(__file__).resolve().parents[2]
COMPOSE_BIN = Path(compose.__file__).parent / "docker-compose"


def test_compose_file_validates_with_a_real_compose_binary():
    proc = subprocess.run(
        [str(COMPOSE_BIN), "-f", str(REPO / "docker-compose.yml"), "config", "-q"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert set(cfg["services"]) == {"postgres", "server", "trainer"}
    for name in ("server", "trainer"):
        svc = cfg["services"][name]
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        assert "healthcheck" in svc and "adaflash-data:/data" in svc["volumes"]
        assert svc["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("server", "trainer"):
        env = cfg["services"][name]["environment"]
        assert env["ADAFLASH_DATABASE_URL"].startswith("postgresql://")
        assert env["ADAFLASH_WEIGHTS_DIR"] == "/data/weights"


def test_compose_binary_rejects_a_broken_file(tmp_path):
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  x:\n    image: a\n    ports: 8000\n")
    proc = subprocess.run(
        [str(COMPOSE_BIN), "-f", str(bad), "config", "-q"], capture_output=True, text=True
    )
    assert proc.returncode != 0  # the validation above can fail


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on CPU machines")
def test_sglang_backend_is_refused_without_cuda_with_the_reason():
    with pytest.raises(BackendUnavailable, match="needs an NVIDIA GPU with CUDA"):
        require_sglang()
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--backend", "sglang"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "needs an NVIDIA GPU with CUDA" in proc.stderr and "Traceback" not in proc.stderr


def small_drafter(folder: Path) -> Path:
    target = TargetConfig("qwen3", 128, 64, 96, 8, 4, 2, 16)
    d = DFlashDrafter(DrafterConfig.for_target(target, num_layers=2, mask_token_id=127))
    return save_drafter(d, folder)


def test_our_checkpoints_load_as_plain_dflash_drafters(tmp_path):
    assert dflash_compat_problems(small_drafter(tmp_path / "d")) == []
    shipped = REPO / "assets" / "drafters" / "smollm2-135m-dflash"
    if (shipped / "config.json").is_file():
        assert dflash_compat_problems(shipped) == []


def test_compat_check_names_what_sglang_would_refuse(tmp_path):
    folder = small_drafter(tmp_path / "d")
    weights = load_file(str(folder / "model.safetensors"))
    weights.pop("layers.1.mlp.up_proj.weight")
    weights["fc.weight"] = torch.zeros(64, 3 * 64)
    weights["extra.bias"] = torch.zeros(1)
    save_file(weights, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(cfg))
    problems = " | ".join(dflash_compat_problems(folder))
    for needle in ("layers.1.mlp.up_proj.weight", "fc.weight", "extra.bias", "silu"):
        assert needle in problems


def test_training_strategy_is_configurable_and_checked():
    assert DistillConfig(strategy="ddp", devices=8, num_nodes=2).strategy == "ddp"
    with pytest.raises(ValueError, match="strategy"):
        DistillConfig(strategy="horovod")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fit_on_gpus_with_ddp(tmp_path):
    from adaflash.models.target import load_target
    from adaflash.workloads import Trajectory
    from lightning_modules.train import fit, new_drafter
    from tests.tiny import VOCAB, build_checkpoint

    target = load_target(
        build_checkpoint(tmp_path / "t", "llama", layers=6), "bfloat16", device="cuda"
    )
    drafter = new_drafter(target, mask_token_id=VOCAB - 1, num_layers=1, block_size=4).cuda()
    trajs = [
        Trajectory(f"t{i}", "x", [3, 4, 5], list(range(10, 30)), "", "length") for i in range(8)
    ]
    result = fit(
        drafter,
        target,
        trajs,
        None,
        DistillConfig(strategy="ddp", devices=torch.cuda.device_count(), epochs=1),
        progress=False,
    )
    assert result.steps > 0
