"""A bf16 GEMV kernel for decoding on CPUs with AVX512-BF16 (``csrc/gemv_bf16.cpp``).

``torch.ops.adaflash.gemv_bf16(x, w)``: y (M, N) = x (M, K) · w (N, K)ᵀ for 1 ≤ M ≤ 4, bf16 in
and out, fp32 accumulation. ``layers.linear`` and the compiled steps (``decode_graph``; inductor
calls it as an opaque op) send inputs of up to ``MAX_ROWS`` rows here instead of oneDNN: every
batch-1 decode step. Measured on an AMD EPYC (family 26, AVX512-BF16, no AMX; 2 threads), in one
process, interleaved: a compiled batch-1 step of SmolLM2-135M took 8.6 ms with it against 9.9 ms
with oneDNN's prepacked weights (``bench/bench_engine.py`` has the engine-level figures).

It is compiled at first use (~20 s, g++ and ninja through torch's extension builder; then the
library is cached under ``cache_dir()/ext`` and loads in ~0.1 s), only where the CPU has
AVX512-BF16. ``ADAFLASH_GEMV=0`` switches it off; a failed build logs why and leaves every
projection on the default path.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from pathlib import Path

import torch

from adaflash.hardware import cpu_flags

log = logging.getLogger(__name__)

# rows it serves: over a step's 121 projections (random weights, 30 layers + LM head) it took
# 0.79× oneDNN's time for one row, 0.94× for two, 1.27× for four (the same EPYC)
MAX_ROWS = 1
SOURCE = Path(__file__).with_name("csrc") / "gemv_bf16.cpp"
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp"]


def wanted() -> bool:
    """Whether this machine should use the kernel: switched on and AVX512-BF16 present."""
    if os.environ.get("ADAFLASH_GEMV", "1") == "0":
        return False
    return "avx512_bf16" in (cpu_flags() or frozenset())


def available() -> bool:
    """Whether the kernel serves: wanted here, built and loaded (the first call builds it)."""
    return wanted() and _loaded()


@functools.cache
def _loaded() -> bool:
    """Build (once per machine: then the cached library loads in ~0.1 s) and load the kernel;
    False where that failed."""
    from torch.utils.cpp_extension import load

    from adaflash.pull import cache_dir

    if shutil.which("ninja") is None:  # the PyPI ninja (a dependency) outside an activated venv
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

    build = cache_dir() / "ext" / f"gemv_bf16-torch{torch.__version__.replace('+', '_')}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        load(
            name="adaflash_gemv_bf16",
            sources=[str(SOURCE)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no ninja, an old assembler: the default path serves
        log.warning("the bf16 GEMV kernel did not build (%s); projections stay on oneDNN", exc)
        return False
    register_fake()
    return True


def register_fake() -> None:
    """The op's shape rule, so that compiled steps can trace through it."""

    @torch.library.register_fake("adaflash::gemv_bf16")
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (..., K) with at most ``MAX_ROWS`` rows in all → (..., N) through the kernel."""
    y = torch.ops.adaflash.gemv_bf16(x.reshape(-1, x.shape[-1]), weight)  # (M, N)
    return y.view(*x.shape[:-1], weight.shape[0])
