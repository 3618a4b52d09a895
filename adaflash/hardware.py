"""What this CPU is: its model and the instruction-set flags the engine's kernel choices and the
benchmarks' result files depend on (machines of the same size differ between runs)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

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


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The first processor's instruction-set flags (None where /proc/cpuinfo is missing)."""
    fields = cpuinfo()
    return None if fields is None else frozenset(fields.get("flags", "").split())


def cpu_info() -> dict[str, object]:
    """{"model": …, "family": …, "model_number": …, "flags": […]} (flags: the ones of interest
    only), for result files: a VM's model name is often just "AMD EPYC", and the family and model
    numbers tell its generation (AMD family 23 Zen 1/2, 25 Zen 3/4, 26 Zen 5)."""
    flags = cpu_flags() or frozenset()
    info = cpuinfo() or {}
    out: dict[str, object] = {
        "model": info.get("model name") or platform.processor(),
        "flags": [f for f in FLAGS_OF_INTEREST if f in flags],
    }
    for key, name in (("cpu family", "family"), ("model", "model_number")):
        if info.get(key, "").isdigit():
            out[name] = int(info[key])
    return out


def machine() -> dict[str, object]:
    """What a benchmark's result file says about the machine it ran on."""
    return {
        "platform": platform.platform(),
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX). Without it a bf16 GEMM
    costs about a GEMV per row (``bench/gemm_dtypes.py``). No /proc/cpuinfo → assume native.
    Asked per layer per step: the flags are parsed once (``cpu_flags``)."""
    flags = cpu_flags()
    return flags is None or bool({"avx512_bf16", "amx_bf16"} & flags)
