"""Rebuild the target's bf16 ``model.safetensors`` from its GGUF, refusing any tensor that differs
from the manifest that ``prepare.py`` wrote from the pulled folder (transformers' GGUF loader has
to dequantise exactly as it did there).

    python3 convert.py MODEL.gguf TARGET_FOLDER manifest.json
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM


def tensor_sha(t: torch.Tensor) -> str:
    """The sha256 of a bf16 tensor's bytes (the manifest's, and what is checked against it)."""
    return hashlib.sha256(t.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


def main() -> None:
    gguf, out, manifest_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    manifest = json.loads(manifest_path.read_text())
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    bad = []
    for k, want in manifest.items():
        t = state.get(k)
        if t is None or tensor_sha(t) != want["sha256"] or list(t.shape) != want["shape"]:
            bad.append(k)
    print(f"[convert] {len(manifest)} tensors, {len(bad)} differ: {bad[:5]}", flush=True)
    if bad:
        sys.exit(3)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: state[k] for k in manifest}, str(out / "model.safetensors"), {"format": "pt"})


if __name__ == "__main__":
    main()
