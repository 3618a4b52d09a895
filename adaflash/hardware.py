"""What this CPU is: its model and the instruction-set flags the engine's kernel choices and the
benchmarks' result files depend on (machines of the same size differ between runs)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile")


@functools.cache
def cpuinfo() -> dict[str, str] | None:
    """The first processor's fields in /proc/cpuinfo (None where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_info() -> dict[str, object]:
    """{"model": …, "flags": […]} (flags: the ones of interest only), for result files."""
    fields = cpuinfo() or {}
    flags = set(fields.get("flags", "").split())
    return {
        "model": fields.get("model name") or platform.processor(),
        "flags": [f for f in FLAGS_OF_INTEREST if f in flags],
    }


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX). Without it a bf16 GEMM
    costs about a GEMV per row (``bench/gemm_dtypes.py``). No /proc/cpuinfo → assume native.
    Cheap enough to ask per layer per step (``cpuinfo`` is read once)."""
    fields = cpuinfo()
    if fields is None:
        return True
    return bool({"avx512_bf16", "amx_bf16"} & set(fields.get("flags", "").split()))
