"""bf16 GEMV kernels for decoding on CPUs: AVX512-BF16 (``csrc/gemv_bf16.cpp``; without AMX
weights in panels, ``csrc/gemm_bf16_panels.cpp``), with AMX tiles where the CPU has AMX-BF16
(``csrc/linear_amx.cpp``), and, where the CPU has no native bf16, AVX2 + FMA
(``csrc/gemv_bf16_avx2.cpp``; weights that fit in panels of 16 features,
``csrc/gemm_bf16_panels_avx2.cpp``).

``torch.ops.adaflash.gemv_bf16(x, w)``: y (M, N) = x (M, K) · w (N, K)ᵀ for a few rows, bf16 in
and out, fp32 accumulation. The same library holds ``torch.ops.adaflash.decode_attention``
(``attention``: the compiled steps' attention over the KV pool, ``csrc/decode_attention.cpp``;
with AVX-512, calls of two new tokens a request or more take its tile path, scores through
vdpbf16ps or, where built with AMX-BF16, AMX tiles: ``ADAFLASH_ATTENTION_TILES=0`` switches
that path off).
``layers.linear`` and the compiled steps (``decode_graph``; inductor calls it as an opaque op)
send inputs of up to ``max_rows()`` rows here instead of oneDNN.

Where the CPU has AVX512-BF16 and no AMX, weights whose shape fits are packed once in panels of
32 output features (``pack_panels``, ``torch.ops.adaflash.gemm_bf16_panels``,
``csrc/gemm_bf16_panels.cpp``: vdpbf16ps's operand layout, each panel one contiguous stream,
tiles of up to 8 input rows whose accumulators are the outputs, no horizontal sums), and that
kernel takes every row count: eager projections (``layers.Packed.panels``, instead of oneDNN's
prepacked copy) and compiled steps up to 256 rows (sharing the eager step's panels). Over a
step's 121 projections of SmolLM2-135M (real weights, 2 threads, an AMD EPYC of family 25 model
17 (Zen 4), one process, interleaved) 1 / 2 / 4 rows took 9.1–9.9 / 8.8 / 8.8 ms against
15.3–16.9 / 15.9 / 13.2 through oneDNN's prepacked weights and 10.1–10.5 / 9.8 / 13.3 through
the GEMV kernel below; 16 rows 14.1 against 18.9; 128 / 256 / 512 rows 90.6 / 171.5 / 341.8
against 96.2 / 186.4 / 357.6 (inductor's C++ template, which widens bf16 to fp32 on this CPU
class, took ~32 ms for a 16-token step's projections there, an earlier session's A/B). Tiles of
12 rows, panels of 64 features and blocks of K shared by the tiles from L1 measured level or
slower (the kernel's header). ``ADAFLASH_PANELS=0`` leaves the GEMV kernel as before.

Where the CPU has only AVX2 + FMA, weights that fit are packed likewise in panels of 16 output
features, K-major (``csrc/gemm_bf16_panels_avx2.cpp``: one 32-byte load per k widened to two
fp32 vectors in registers, tiles of up to 6 input rows, 12 accumulators that are the outputs),
and that kernel takes every eager projection (instead of the GEMV kernel's rows and the fp32
copies, which are then not made: 270 MB of panels instead of 540 MB of fp32) and the compiled
steps' up to 256 rows. Over a step's 121 projections (real weights, 2 threads, an AMD EPYC of
family 25 model 1 (Zen 3), one process, interleaved, the least of 3 rounds; this host's speed
moved ±20% between rounds):
1 / 2 / 4 / 8 / 16 rows 16.4 / 17.2 / 16.9 / 30.7 / 43.2 ms against the GEMV kernel's 15.4 /
16.6 / 21.7 / 33.1 / 59.4; 32 / 64 / 128 rows 62.2 / 113.2 / 210.6 against 78.0 / 141.8 /
268.7; 256 rows 447.9 against 599.1 through fp32 copies. With the second tile of rows fetching
the next panel into cache (4 rounds, a faster spell of the host): 1 / 8 / 16 rows 14.3 / 20.7 /
32.8 against 14.1 / 27.1 / 47.7; that prefetch alone, built with and without it and alternated
(two rounds of three, least of each): 8 / 16 rows 18.8–19.9 / 28.9–29.2 ms against 20.1–21.5 /
29.5–31.3, 32 rows level (54.6–58.8). One thread, one weight in cache, 6-row tiles ran at 38–43 G
multiply-adds/s (the accumulators kept as named locals: an array of them, indexed in loops,
lived on the stack at ~27).

Measured over a step's 121 projections of SmolLM2-135M (random weights, 2 threads), in one
process, interleaved:
- AVX512-BF16 (an AMD EPYC of family 26, no AMX): 0.79× oneDNN's time for one row, 0.94× for
  two, 1.27× for four; so one row only (every batch-1 decode step): a compiled batch-1 step took
  8.6 ms against 9.9 ms with oneDNN's prepacked weights. Since then the kernel reads each
  weight row start to end (one stream per thread) instead of four rows' chunks interleaved: on
  an AMD EPYC of family 25 model 17 (Zen 4) one row over the 121 projections took 13.7 ms
  against 19.6 ms before (2 threads; 19.4 vs 33.8 ms on one), two rows 17.8 vs 25.3 ms.
  Since 2026-12-03 each weight row's accumulators are locals the compiler keeps in registers
  (for four input rows the 32 accumulators had lived on the stack, a load and a store per dot
  product): four rows over the 121 projections 19.6 against 26.9 ms, one row unchanged (real
  weights, one thread, the other core busy; the old kernel built beside it, interleaved). On
  that Zen 4, quiet, 2 threads, 1 / 2 / 3 / 4 rows took 9.3 / 9.9 / 12.8 / 15.3 ms against
  oneDNN's 18.9 / 18.8 / 20.4 / 18.3: so eager projections of up to four rows go through it
  (on the family-26 EPYC four rows were 1.27× oneDNN before that change, not measured since).
- AMX (an Intel Xeon with AMX-BF16, real weights, 2 threads): ``linear_amx`` over the same
  projections took 11.4 / 10.7 / 11.7 / 11.7 / 12.6 / 17.8 / 24.9 / 40.1 ms for 1 / 2 / 4 / 8 / 16
  / 32 / 64 / 128 rows against 14.5 / 14.4 / 14.5 / 14.7 / 14.6 / 19.8 / 23.8 / 33.2 ms through
  oneDNN's prepacked weights and 14.0 / 15.6 / 19.3 ms (1 / 2 / 4 rows) through the AVX512-BF16
  GEMV (one thread: 1 / 32 / 48 rows 21.1 / 30.5 / 37.7 ms against oneDNN 24.9 / 33.4 / 37.4). So
  there AMX takes eager projections of up to 32 rows where the weight's shape fits: an eager pass
  of 1 / 16 / 32 tokens after 128 (real weights, 2 threads, two alternated processes each) took
  22.1–22.5 / 27.0–28.2 / 35.7–36.5 ms against 23.4–23.8 / 31.5 / 39.4–39.9 ms with
  ``ADAFLASH_AMX=0`` (100 tokens, beyond it: 55.0–57.7 vs 56.4–56.6). Inside compiled steps
  inductor's own AMX template (weights frozen in its blocked layout, epilogues fused) did better:
  a compiled one-request step of real weights, 100 interleaved calls, took 12.08 ms with the
  template against 12.99 ms through ``linear_amx`` for one token and 16.57 against 18.40 ms for
  16; so there the kernel serves the one-row step only where the route measured at the first
  compile picks it (``decode_graph.Route``).
- AVX2 + FMA (an AMD EPYC of family 25 model 1; weights whose shape does not fit panels, or
  ``ADAFLASH_PANELS=0``): 1 / 2 / 4 / 8 / 16 rows in 21 / 22 / 27 / 36 /
  75 ms against 27 / 40 / 72 / 140 / 263 ms through bf16 ``F.linear`` and 82 / 120 / 145 / 129 /
  151 ms through fp32 copies of the weights; so up to 16 rows (decode, verification and batched
  decode up to 16 requests). Eager projections (prompt chunks) go through it up to 128 rows in
  one call, each block of eight weight rows read from memory once for every input row: over
  the 120 per-layer projections 17 / 24 / 40 / 64 / 100 / 128 rows took 68 / 107 / 181 / 241 /
  330 / 395 ms against 237 / 231 / 342 / 361 / 418 / 484 ms through fp32 copies (256 rows:
  773 vs 771); the fp32 copies serve only wider inputs.

It is compiled at first use (20–60 s, g++ and ninja through torch's extension builder; then the
library is cached under ``cache_dir()/ext`` and loads in ~0.1 s), for the CPU's variant.
``ADAFLASH_GEMV=0`` switches it off, and the attention op with it; a failed build logs why and
leaves every projection and the attention on the default path.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from adaflash.hardware import cpu_flags

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")


ATTENTION = CSRC / "decode_attention.cpp"  # built into the same library (``attention``)


@dataclass(frozen=True)
class Variant:
    name: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    max_rows: int  # compiled steps' inputs of up to this many rows go through it (measured)
    eager_rows: int  # eager projections' (prompt chunks', ``layers.linear``) likewise
    limit: int  # the most rows the GEMV op accepts
    # the attention op's work (positions × heads × d) per thread, at least (csrc/decode_attention)
    attention_split: int = 1 << 21
    # weights packed in panels (``pack_panels``, ``csrc/gemm_bf16_panels.cpp``) take every
    # projection whose shape fits, in compiled steps up to this many rows (0: no panels here;
    # ``max_rows`` then), in eager ones any
    panel_rows: int = 0
    panel: int = 32  # output features per panel (``pack_panels``)


AVX512_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mfma", "-fopenmp")
AVX512_BF16 = Variant(  # the panels kernel where a weight's shape fits, else the GEMV kernel
    "avx512_bf16",
    (CSRC / "gemv_bf16.cpp", CSRC / "gemm_bf16_panels.cpp"),
    AVX512_FLAGS,
    max_rows=1,  # the GEMV kernel's, without panels (``ADAFLASH_PANELS=0``)
    eager_rows=4,
    limit=4,
    panel_rows=256,  # compiled steps: 16 verified tokens, 16 requests, batched verification
    # a compiled 16-token step (128 positions) took 17.1 ms with its attention on two threads
    # against 18.4 on one, a one-token step level (Zen 4 EPYC, real weights, interleaved)
    attention_split=1 << 18,
)
AMX = Variant(  # the AVX512-BF16 kernel for one row, AMX tiles for more (``linear_amx.cpp``)
    "amx",
    (CSRC / "gemv_bf16.cpp", CSRC / "linear_amx.cpp"),
    (*AVX512_FLAGS, "-mamx-tile", "-mamx-bf16"),
    max_rows=1,  # in compiled steps inductor's AMX template won for more rows (below)
    eager_rows=32,
    limit=4,  # the GEMV op's; AMX takes any number of rows
    attention_split=1 << 16,  # two threads won from the smallest call there
)
AVX2 = Variant(  # the panels kernel where a weight's shape fits, else the GEMV kernel
    "avx2",
    (CSRC / "gemv_bf16_avx2.cpp", CSRC / "gemm_bf16_panels_avx2.cpp"),
    ("-O3", "-mavx2", "-mfma", "-fopenmp"),
    max_rows=16,  # the GEMV kernel's, without panels (``ADAFLASH_PANELS=0``)
    eager_rows=128,
    limit=128,
    panel_rows=256,
    panel=16,
)


def variant() -> Variant | None:
    """This machine's kernel: switched on, and AVX512-BF16, else AVX2 + FMA; None otherwise."""
    if os.environ.get("ADAFLASH_GEMV", "1") == "0":
        return None
    flags = cpu_flags() or frozenset()
    if {"avx512_bf16", "amx_bf16", "amx_tile"} <= flags and os.environ.get("ADAFLASH_AMX") != "0":
        return AMX
    if "avx512_bf16" in flags:
        return AVX512_BF16
    return AVX2 if {"avx2", "fma"} <= flags else None


def serving() -> Variant | None:
    """The kernel that serves: wanted here, built and loaded (the first call builds it)."""
    chosen = variant()
    return chosen if chosen is not None and _loaded(chosen) else None


def available() -> bool:
    """Whether a kernel serves."""
    return serving() is not None


def max_rows() -> int:
    """Compiled steps' inputs of up to this many rows go through the kernel (0 where none
    serves)."""
    chosen = serving()
    if chosen is None:
        return 0
    return chosen.panel_rows if panels() else chosen.max_rows


def panels() -> bool:
    """Whether weights are packed in panels here (``pack_panels``; ``ADAFLASH_PANELS=0``
    switches them off, leaving the GEMV kernel)."""
    chosen = serving()
    on = os.environ.get("ADAFLASH_PANELS", "1") != "0"
    return chosen is not None and chosen.panel_rows > 0 and on


def eager_rows() -> int:
    """Eager projections' inputs of up to this many rows go through the kernel (0 where none
    serves)."""
    chosen = serving()
    return chosen.eager_rows if chosen is not None else 0


_loaded_variant: Variant | None = None  # set at load: read in traced code (no file reads)


@contextlib.contextmanager
def builder(build: Path) -> Iterator[None]:
    """The build folder to this process alone while it builds or loads the kernel: an OS lock
    (``flock``), which the OS lets go of when its process dies. Holding it, a ``lock`` file that
    torch's own build lock left there is stale — a process killed while it held it — and is
    removed: torch waits on that file for good otherwise (a benchmark killed while it loaded
    the kernel left one, and every process that loaded the kernel after it hung at start)."""
    with open(build / "adaflash.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        except OSError:  # a file system without locks: torch's lock alone, as before
            yield
            return
        (build / "lock").unlink(missing_ok=True)
        yield


@functools.cache
def _loaded(chosen: Variant) -> bool:
    """Build (once per machine: then the cached library loads in ~0.1 s) and load the kernel;
    False where that failed."""
    from torch.utils.cpp_extension import load

    from adaflash.pull import cache_dir

    if shutil.which("ninja") is None:  # the PyPI ninja (a dependency) outside an activated venv
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

    # the sources' digest in the name: an edited kernel or header never loads a stale build
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(CSRC.iterdir()))).hexdigest()
    tag = f"{chosen.name}-torch{torch.__version__.replace('+', '_')}-{digest[:12]}"
    build = cache_dir() / "ext" / f"gemv_bf16-{tag}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        with builder(build):
            load(
                name=f"adaflash_gemv_bf16_{chosen.name}",
                sources=[*map(str, chosen.sources), str(ATTENTION)],
                extra_cflags=list(chosen.cflags),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                is_python_module=False,
            )
    except Exception as exc:  # no compiler, no ninja, an old assembler: the default path serves
        log.warning(
            "the %s GEMV kernel did not build (%s); projections stay as they were", chosen.name, exc
        )
        return False
    register_fake()
    torch.ops.adaflash.set_attention_split(chosen.attention_split)
    tiles = os.environ.get("ADAFLASH_ATTENTION_TILES", "1") != "0"
    torch.ops.adaflash.set_attention_tile_tokens(2 if tiles else 1 << 30)
    global _loaded_variant
    _loaded_variant = chosen
    return True


@functools.cache
def register_fake() -> None:
    """The op's shape rule, so that compiled steps can trace through it."""

    @torch.library.register_fake("adaflash::gemv_bf16")
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))

    if variant() is AMX:

        @torch.library.register_fake("adaflash::linear_amx")
        def _amx(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return x.new_empty((x.shape[0], w.shape[0]))

    chosen = variant()
    if chosen is not None and chosen.panel_rows:

        @torch.library.register_fake("adaflash::gemm_bf16_panels")
        def _panels(x: torch.Tensor, wp: torch.Tensor) -> torch.Tensor:
            return x.new_empty((x.shape[0], panel_features(wp)))

    @torch.library.register_fake("adaflash::decode_attention")
    def _attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pool: torch.Tensor,
        rows: torch.Tensor,
        layer: int,
        pos: torch.Tensor,
    ) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)


def attention(
    q: torch.Tensor,  # (B, T, heads, d) the new tokens' queries, after RoPE
    k: torch.Tensor,  # (B, T, kv_heads, d) their keys, after RoPE
    v: torch.Tensor,  # (B, T, kv_heads, d) their values
    pool: torch.Tensor,  # (rows, layers, 2, kv_heads, capacity, d) the KV pool
    rows: torch.Tensor,  # (B,) each request's pool row
    layer: int,
    pos: torch.Tensor,  # (B,) each request's committed length: its past is positions < pos
) -> torch.Tensor:
    """(B, T, heads, d): each new token's attention over its request's past and the new tokens
    up to itself, in fp32, rounded to q's dtype (``csrc/decode_attention.cpp``). Served where
    the kernels built (``available()``); the compiled steps call it as an opaque op."""
    return torch.ops.adaflash.decode_attention(q, k, v, pool, rows, layer, pos)


def amx_fits(weight: torch.Tensor) -> bool:
    """Whether AMX tiles take this weight (N, K): N % 64 == 0 and K % 32 == 0."""
    n, k = weight.shape
    return n % 64 == 0 and k % 32 == 0


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """W (N, K) bf16 → W in panels of the serving variant's ``panel`` output features, each panel
    one contiguous stream; None where the shape does not fit or panels do not serve here.
    AVX512-BF16 (``csrc/gemm_bf16_panels.cpp``): (N/32, K/2, 32, 2), ``wp[p, k2, f, j] =
    W[32p + f, 2 k2 + j]``, vdpbf16ps's operand layout. AVX2 (``csrc/gemm_bf16_panels_avx2.cpp``):
    (N/16, K, 8, 2), ``wp[p, k, j, h] = W[16p + 8h + j, k]``, one 32-byte load per k whose lanes'
    low and high halves widen to features 0–7 and 8–15."""
    n, k = weight.shape
    chosen = serving() if panels() else None
    if chosen is None or weight.dtype != torch.bfloat16 or n % chosen.panel or k % 2:
        return None
    w = weight.detach().contiguous()
    if chosen is AVX2:
        return w.view(n // 16, 2, 8, k).permute(0, 3, 2, 1).contiguous()
    return w.view(n // chosen.panel, chosen.panel, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def panel_features(panels: torch.Tensor) -> int:
    """N, the output features of a weight packed in panels (``pack_panels``)."""
    per_panel = panels.shape[2] * panels.shape[3] if _loaded_variant is AVX2 else panels.shape[2]
    return panels.shape[0] * per_panel


def panel_linear(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """x (..., K) · Wᵀ through W's panels (``pack_panels``) → (..., N), any number of rows:
    the same as ``F.linear(x, W)`` up to the order of fp32 additions."""
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    y = torch.ops.adaflash.gemm_bf16_panels(x2, panels)  # (M, N)
    return y.view(*x.shape[:-1], panel_features(panels))


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (..., K) with at most ``max_rows()`` rows in all (``eager_rows()`` outside compiled
    steps) → (..., N) through the kernel: AMX tiles where the CPU has them and the weight's
    shape fits (``amx_fits``), else the GEMV kernel up to its ``limit`` and ``F.linear``
    beyond."""
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    if _loaded_variant is AMX and amx_fits(weight):
        y = torch.ops.adaflash.linear_amx(x2, weight)
    elif _loaded_variant is not None and x2.shape[0] <= _loaded_variant.limit:
        y = torch.ops.adaflash.gemv_bf16(x2, weight)  # (M, N)
    else:
        y = torch.nn.functional.linear(x2, weight)
    return y.view(*x.shape[:-1], weight.shape[0])
