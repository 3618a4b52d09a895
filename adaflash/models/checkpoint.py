"""Reading and writing Hugging Face style safetensors folders (single file or sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def safetensors_files(folder: str | Path) -> list[Path]:
    """The weight files of a folder: ``model.safetensors`` or the shards named in its index."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"weight shards listed in the index are missing: {missing}")
    return files


def load_tensors(folder: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a folder, optionally cast to ``dtype``."""
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = f.get_tensor(key)
                out[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def save_tensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]
) -> None:
    """Save contiguous CPU copies (safetensors refuses shared or strided storage)."""
    clean = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(clean, str(path), metadata=metadata)
