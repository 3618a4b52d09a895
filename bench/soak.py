"""Soak test of a real `adaflash serve`: C concurrent streaming chats for M minutes while the
server's resident memory (RSS, from /proc) is sampled; writes the curve and a verdict as JSON.

Memory is "flat" when, after the warm-up, RSS stays within ``--tolerance`` (default 5%) of its
value at the end of the warm-up. The server runs in its own process (the load generator's memory
is not counted), with the embedded default models unless --target/--drafter say otherwise. The
load starts once the server's background compile has ended (its time is `compile_wait_s`).

    python bench/soak.py --minutes 5 --concurrency 32 --out docs/results/soak/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from adaflash.hardware import cpu_info

PROMPTS = [
    "Tell me about the moon.",
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Give me three tips for learning to cook.",
    "What does a compiler do?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I sort a list of dictionaries by a key in Python?",
]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def client(url: str, i: int, stop_at: float, stats: dict[str, int]) -> None:
    async with httpx.AsyncClient(timeout=300) as http:
        n = i
        while time.time() < stop_at:
            body = {
                "messages": [{"role": "user", "content": PROMPTS[n % len(PROMPTS)]}],
                "max_tokens": 96,
                "temperature": 0.7,
                "seed": n,
                "stream": True,
            }
            n += 1
            try:
                async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        stats["errors"] += 1
                        continue
                    async for _ in r.aiter_lines():
                        pass
                stats["requests"] += 1
            except httpx.HTTPError:
                stats["errors"] += 1


def wait_compiled(url: str, timeout: float = 1800) -> float:
    """Wait until the server's background compile has ended (ready, failed or off), so that the
    curve measures serving and not the compiler; returns the seconds waited."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        if 'adaflash_compiled_decode{status="compiling"}' not in text:
            return round(time.time() - t0, 1)
        time.sleep(2)
    raise SystemExit(f"the server was still compiling after {timeout:.0f} s")


async def sample(pid: int, every: float, stop_at: float, t0: float, out: list) -> None:
    while time.time() < stop_at:
        out.append({"t_s": round(time.time() - t0, 1), "rss_mb": round(rss_mb(pid), 1)})
        await asyncio.sleep(every)


async def soak(url: str, pid: int, args: argparse.Namespace) -> dict:
    t0 = time.time()
    stop_at = t0 + 60 * args.minutes
    stats = {"requests": 0, "errors": 0}
    curve: list[dict[str, float]] = []
    await asyncio.gather(
        sample(pid, args.every, stop_at, t0, curve),
        *(client(url, i, stop_at, stats) for i in range(args.concurrency)),
    )
    warm = [p for p in curve if p["t_s"] >= 60 * args.warmup_minutes]
    base = warm[0]["rss_mb"] if warm else curve[-1]["rss_mb"]
    peak, last = max(p["rss_mb"] for p in warm or curve), curve[-1]["rss_mb"]
    return {
        **stats,
        "curve": curve,
        "rss_after_warmup_mb": base,
        "rss_peak_after_warmup_mb": peak,
        "rss_end_mb": last,
        "growth_after_warmup": round(last / base - 1, 4),
        "peak_over_warmup": round(peak / base - 1, 4),
        "flat": peak <= base * (1 + args.tolerance),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--warmup-minutes", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--every", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument("--serve-args", default="", help="extra `adaflash serve` arguments")
    ap.add_argument("--note", default="", help="what else ran on the machine; the commit")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    port = free_port()
    data = Path(tempfile.mkdtemp(prefix="soak-"))
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "serve",
        "--port",
        str(port),
        "--no-trainer",
        "--no-ui",
        "--threads",
        str(args.threads),
        "--max-running-requests",
        str(args.concurrency),
        *args.serve_args.split(),
    ]
    log = (data / "server.log").open("w")
    env = {**os.environ, "ADAFLASH_DATA": str(data)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise SystemExit(f"server did not start; see {data / 'server.log'}")
        compile_s = wait_compiled(url)
        started = rss_mb(proc.pid)
        result = asyncio.run(soak(url, proc.pid, args))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    out = {
        "benchmark": "bench/soak.py",
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "note")},
        "compile_wait_s": compile_s,
        "rss_idle_mb": round(started, 1),
        **result,
        "machine": {"platform": platform.platform(), "cpu": cpu_info(), "cpus": os.cpu_count()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "note": args.note,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(
        f"{result['requests']} requests, {result['errors']} errors; RSS idle {started:.0f} MB, "
        f"after warm-up {result['rss_after_warmup_mb']:.0f} MB, end {result['rss_end_mb']:.0f} MB "
        f"(peak +{100 * result['peak_over_warmup']:.1f}%): "
        f"{'flat' if result['flat'] else 'GROWING'}"
    )


if __name__ == "__main__":
    main()
