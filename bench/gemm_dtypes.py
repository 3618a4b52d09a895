"""What a linear layer of the target costs on this CPU, per weight format and rows: the engine's
bf16 path (oneDNN's prepacked weight where this CPU allows it — ``onednn`` — else ``F.linear``),
plain ``F.linear`` in bf16, and fp32 weights (the input cast up, the output cast back).
Machines differ: where the CPU has no native bf16 arithmetic (no AVX512-BF16 / AMX), a bf16
GEMM costs about a GEMV per row, so a pass over 16 rows costs ~16 decode steps, and fp32
weights win from a few rows on. The file records the CPU model and flags with the timings.

    python bench/gemm_dtypes.py --threads 2 --out docs/results/engine/gemm_dtypes.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from adaflash.hardware import cpu_info
from adaflash.models.layers import linear, pack

# SmolLM2-135M's projections (out, in): q|k|v fused, o, gate|up fused, down, the LM head
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
ROWS = (1, 2, 4, 8, 16, 32)


def ms(f: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        f()
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    return round((time.perf_counter() - t0) / reps * 1e3, 4)


def timings(
    x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None, w32: torch.Tensor, reps: int
) -> dict[str, float]:
    return {
        "bf16_path_ms": ms(lambda: linear(x, w, None, packed), reps),
        "bf16_ms": ms(lambda: F.linear(x, w), reps),
        "fp32_ms": ms(lambda: F.linear(x.float(), w32).to(x.dtype), reps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--out", default="docs/results/engine/gemm_dtypes.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k).bfloat16()
        os.environ["ADAFLASH_FP32_ROWS"] = "0"  # the bf16 path alone: oneDNN's layout if any
        packed, w32 = pack(w), w.float()
        onednn = packed is not None and packed.onednn is not None
        for m in ROWS:
            x = torch.randn(m, k).bfloat16()
            row: dict[str, object] = {"layer": name, "shape": [n, k], "rows": m, "onednn": onednn}
            row.update(timings(x, w, packed, w32, args.reps))
            row["fp32_speedup"] = round(row["bf16_path_ms"] / row["fp32_ms"], 2)
            print(row, flush=True)
            rows.append(row)
    out = {
        "benchmark": "bench/gemm_dtypes.py",
        "cpu": cpu_info(),
        "threads": args.threads,
        "torch": torch.__version__,
        "rows": rows,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "note": args.note,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
