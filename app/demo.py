"""``adaflash demo``: watch the drafter adapt to a new domain while it serves.

It streams a shifted-domain workload — by default the math prompts, which the default drafter
never saw — through a server's real OpenAI API at a steady concurrency. The trainer beside the
server learns from those rounds, the gate promotes each better version and the engine hot-swaps
it, so a person watching ``/ui`` (Dashboard) sees τ, verify length and tokens/s move, with a
marker per version. The demo prints the same numbers as it goes, windowed from ``/metrics``,
and stops by itself ``settle_s`` after the ``versions``-th new version went live, or after
``minutes`` minutes (Ctrl-C: now). At
the end it prints one row per version served: requests, τ, verify length, tokens/s.

    adaflash demo                          # starts `serve` (trains every 120 new trajectories)
    adaflash demo --url http://host:8000   # a running server, with its own training settings
    adaflash demo --prompts my.jsonl -- --policy head   # any JSONL with a "prompt" per line;
                                                        # after `--`: flags for `serve`

A server it started stops with it, unless ``--keep-serving``.
"""

from __future__ import annotations

import itertools
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from adaflash.metrics import SpecCounters
from adaflash.paths import repo_relative
from adaflash.workloads import WORKLOADS_DIR, read_prompt_file
from app.serve_process import alive, wait_until_up

DEFAULT_PROMPTS = WORKLOADS_DIR / "math_train.jsonl"


# how a server the demo starts trains: a round per 120 new trajectories, four epochs, 64 anchors
# a sequence, and 64 of the shipped chat and code trajectories a round beside them, as
# bench/demo_adapt.py does by default: math τ +38.8% in five versions, chat and code within 3%
# (docs/results/adapt/zen4_1207_c120). Rounds of 24 and 16 anchors moved math τ half as far
# (zen4_1206_opd_chunk24); two epochs +24% in five versions, four +32% (zen4_1206_both,
# xeon_1207_epochs4); 96 new and none retained lost 8.9% on code (xeon_1207b_opd)
@dataclass(frozen=True)
class DemoTraining:
    min_new: int = 120  # a round per this many new trajectories
    epochs: int = 4
    anchors: int = 64  # a sequence
    retain: int = 64  # shipped chat and code trajectories a round beside the new ones

    def flags(self) -> tuple[str, ...]:
        """As `adaflash serve` (its trainer) takes them."""
        return (
            *("--min-new", str(self.min_new), "--epochs", str(self.epochs)),
            *("--anchors", str(self.anchors), "--retain", str(self.retain)),
        )


TRAINING = DemoTraining()


@dataclass(frozen=True)
class DemoConfig:
    url: str | None = None  # a running server; None: the one on ``port``, started if down
    port: int = 8000
    prompts: str = str(DEFAULT_PROMPTS)
    # one in flight: where the default policy's drafting shows on this CPU (docs/results/adapt/
    # zen4_1207_c120: at one request 1.00x -> 1.20x of plain decoding over the versions, at four
    # 0.96-1.06x, a verify pass dearer against batched plain steps, so served τ barely moves)
    concurrency: int = 1
    max_tokens: int = 128
    temperature: float = 0.0
    versions: int = 3  # stop once this many new versions were served (0: only ``minutes``)
    settle_s: float = 60.0  # … and serve on this long after the last (its τ measured, not a blip)
    minutes: float = 60.0  # three versions took 48 min on 2 cores (demo_live_zen4_1207b.json)
    poll_s: float = 2.0  # /metrics reads (a version's window starts within this of its swap)
    report_s: float = 10.0  # a progress line this often
    keep_serving: bool = False
    serve_args: tuple[str, ...] = ()  # extra `serve` flags for a server the demo starts
    start_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("--concurrency and --max-tokens must be ≥ 1")
        if self.versions < 0 or self.minutes <= 0 or self.settle_s < 0:
            raise ValueError("--versions and --settle-s must be ≥ 0 and --minutes > 0")


@dataclass(frozen=True)
class Snapshot:
    """The server's counters at one moment (``/metrics``)."""

    t: float
    version: str
    policy: str
    rounds: int
    verified: int
    accepted: int
    output_tokens: int
    requests: int
    swaps: int
    probed: int = 0  # draft slots the cost policy's probes checked (shadow drafts) …
    probe_hits: int = 0  # … and found accepted

    @classmethod
    def parse(cls, text: str, t: float) -> Snapshot:
        values: dict[str, float] = {}
        version, policy = "?", "?"
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "adaflash_active_version":
                    version, policy = s.labels["version"], s.labels["policy"]
                elif s.name == "adaflash_policy_check_total":
                    values[f"adaflash_{s.labels['term']}"] = s.value
                elif not s.labels:
                    values[s.name.removesuffix("_total")] = s.value

        def n(name: str) -> int:
            return int(values.get(f"adaflash_{name}", 0))

        return cls(
            t,
            version,
            policy,
            n("rounds"),
            n("verified_draft_tokens"),
            n("accepted_draft_tokens"),
            n("output_tokens"),
            n("requests"),
            n("swaps"),
            n("probe_slots_compared"),
            n("probe_slots_accepted"),
        )


@dataclass(frozen=True)
class Window:
    """What the server did between two snapshots (rates as adaflash/metrics.py defines them)."""

    version: str
    seconds: float
    requests: int
    output_tokens: int
    accept_len: float  # τ
    verify_len: float
    # the drafter's hit rate: accepted drafts per draft checked, verified or probed (a drafter
    # that does not pay is only probed: its hit rate moves before τ does)
    acceptance_rate: float
    tokens_per_s: float

    @classmethod
    def between(cls, a: Snapshot, b: Snapshot, version: str | None = None) -> Window:
        """From ``a`` to ``b``, under ``a``'s version unless told (a window that ends at a
        swap holds up to ``poll_s`` of the next version's rounds)."""
        c = SpecCounters.from_totals(
            16, b.rounds - a.rounds, b.verified - a.verified, b.accepted - a.accepted
        )
        seconds = max(b.t - a.t, 1e-9)
        tokens = b.output_tokens - a.output_tokens
        # probes' checked slots count as verified drafts (what verifying them would have said)
        hit = SpecCounters.from_totals(
            16,
            b.rounds - a.rounds,
            b.verified - a.verified + b.probed - a.probed,
            b.accepted - a.accepted + b.probe_hits - a.probe_hits,
        )
        return cls(
            version or a.version,
            round(seconds, 1),
            b.requests - a.requests,
            tokens,
            round(c.accept_len, 4),
            round(c.verify_len, 4),
            round(hit.acceptance_rate, 4),
            round(tokens / seconds, 2),
        )

    def line(self) -> str:
        return (
            f"τ {self.accept_len:.3f} | verify {self.verify_len:.2f} | "
            f"hit {100 * self.acceptance_rate:.0f}% | {self.tokens_per_s:.1f} tok/s | "
            f"{self.requests} requests"
        )


@dataclass
class Load:
    """The workload: ``concurrency`` clients, each sending the next prompt when its last
    answer arrives (a closed loop: a steady number of requests in flight)."""

    url: str
    model: str
    prompts: list[tuple[str, str]]  # (text, domain tag: the dashboard's per-domain τ)
    cfg: DemoConfig
    done: int = 0
    failed: int = 0
    last_error: str = ""
    refused: str = ""  # a 4xx answer: the request is wrong, sending more would not help
    _next: itertools.count = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for i in range(self.cfg.concurrency):
            th = threading.Thread(target=self._client, name=f"demo-client-{i}", daemon=True)
            th.start()
            self._threads.append(th)

    def stop(self, timeout_s: float = 120.0) -> None:
        """No new requests; the ones in flight finish (up to ``timeout_s``)."""
        self._stop.set()
        deadline = time.time() + timeout_s
        for th in self._threads:
            th.join(max(deadline - time.time(), 0.0))

    def _client(self) -> None:
        with httpx.Client(base_url=self.url, timeout=600.0) as client:
            while not self._stop.is_set():
                with self._lock:
                    sent = next(self._next)
                    prompt, domain = self.prompts[sent % len(self.prompts)]
                if sent == len(self.prompts):  # from here on τ is partly on prompts trained on
                    print(
                        f"[demo] all {sent} prompts sent; sending them again "
                        "(earlier rounds may have trained on them)",
                        flush=True,
                    )
                body = {
                    "model": self.model,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": self.cfg.max_tokens,
                    "temperature": self.cfg.temperature,
                    "domain": domain,
                }
                try:
                    r = client.post("/v1/chat/completions", json=body)
                except httpx.HTTPError as exc:
                    self._fail(f"{type(exc).__name__}: {exc}")
                    continue
                if r.status_code == 200:
                    with self._lock:
                        self.done += 1
                elif 400 <= r.status_code < 500 and r.status_code not in (408, 429):
                    self.refused = f"HTTP {r.status_code}: {r.text[:300]}"
                    self._stop.set()
                else:  # busy or failing: count it, wait, go on
                    self._fail(f"HTTP {r.status_code}: {r.text[:300]}")

    def _fail(self, message: str) -> None:
        with self._lock:
            self.failed += 1
            self.last_error = message
        self._stop.wait(1.0)  # the server may be restarting: do not spin


def start_server(cfg: DemoConfig, log_path: Path) -> subprocess.Popen:
    """``adaflash serve`` on ``cfg.port`` with the demo's training cadence (flags in
    ``serve_args`` win: argparse keeps the last)."""
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(cfg.port)]
    cmd += [*TRAINING.flags(), *cfg.serve_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as out:
        # its own session: Ctrl-C reaches the demo, which then stops the server gracefully
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # graceful: streams end, the buffer is flushed
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def run(cfg: DemoConfig, data_dir: Path, out: Path | None = None) -> dict:
    """The demo; returns (and with ``out`` writes) its summary. Raises ValueError on a bad
    prompt file and RuntimeError when no server can be reached or started."""
    # refuse a bad file first; a row's domain (else the file's name) tags its requests
    prompts = [(p.prompt, p.domain[:32]) for p in read_prompt_file(cfg.prompts)]
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request drowns the report
    url = (cfg.url or f"http://127.0.0.1:{cfg.port}").rstrip("/")
    proc = None
    log = data_dir / "demo-serve.log"
    if not alive(url):
        if cfg.url is not None:
            raise RuntimeError(f"no server answers at {url}/health")
        print(f"[demo] starting `adaflash serve` on port {cfg.port} (log: {log})", flush=True)
        proc = start_server(cfg, log)
    try:
        wait_until_up(url, proc, cfg.start_timeout_s, log)
        return drive(cfg, url, prompts, out)
    finally:
        if proc is not None and proc.poll() is None:
            if cfg.keep_serving:
                print(f"[demo] the server keeps running (pid {proc.pid}): {url}/ui/", flush=True)
            else:
                print("[demo] stopping the server it started", flush=True)
                stop_server(proc)


def metrics(client: httpx.Client) -> Snapshot:
    r = client.get("/metrics")
    r.raise_for_status()
    return Snapshot.parse(r.text, time.time())


def drive(cfg: DemoConfig, url: str, prompts: list[tuple[str, str]], out: Path | None) -> dict:
    with httpx.Client(base_url=url, timeout=30.0) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        first = metrics(client)
        print(
            f"[demo] {len(prompts)} prompts from {cfg.prompts}, {cfg.concurrency} in flight, "
            f"{cfg.max_tokens} tokens each, to {model} (drafter {first.version}, policy "
            f"{first.policy})\n[demo] watch it live: {url}/ui/ → Dashboard",
            flush=True,
        )
        load = Load(url, model, prompts, cfg)
        load.start()
        start = since_report = version_start = first
        served: list[Window] = []
        reason = "time limit"
        reached: float | None = None  # when the versions-th new version went live
        try:
            while True:
                time.sleep(cfg.poll_s)
                now = metrics(client)
                if now.version != version_start.version:  # hot-swapped: close its window
                    served.append(Window.between(version_start, now))
                    print(
                        f"[demo] {now.t - start.t:6.0f} s  now serving {now.version} "
                        f"(was {version_start.version}: {served[-1].line()})",
                        flush=True,
                    )
                    version_start = now
                    if reached is None and cfg.versions and len(served) >= cfg.versions:
                        reached = now.t
                if now.t - since_report.t >= cfg.report_s:
                    w = Window.between(since_report, now)
                    print(f"[demo] {now.t - start.t:6.0f} s  {w.version}  {w.line()}", flush=True)
                    since_report = now
                if load.refused:
                    reason = f"the server refused a request: {load.refused}"
                    break
                if reached is not None and now.t - reached >= cfg.settle_s:
                    reason = f"{cfg.versions} new version(s) served"
                    break
                if now.t - start.t >= 60 * cfg.minutes:
                    break
        except KeyboardInterrupt:
            reason = "interrupted"
        except httpx.HTTPError as exc:
            reason = f"the server stopped answering: {exc}"
        print(f"[demo] stopping ({reason}); waiting for the requests in flight", flush=True)
        load.stop()
        try:
            end = metrics(client)
            served.append(Window.between(version_start, end))
        except httpx.HTTPError:
            end = version_start
    summary = {
        "url": url,
        "prompts": repo_relative(cfg.prompts),
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("url", "prompts")},
        "stopped": reason,
        "requests_done": load.done,
        "requests_failed": load.failed,
        "last_error": load.last_error or None,
        "seconds": round(end.t - start.t, 1),
        "overall": asdict(Window.between(start, end, "all")),
        "versions": [asdict(w) for w in served],
    }
    print_table(served)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"[demo] wrote {out}", flush=True)
    return summary


def print_table(windows: list[Window]) -> None:
    print("\n| version | seconds | requests | τ | verify length | hit rate | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for w in windows:
        print(
            f"| {w.version} | {w.seconds:.0f} | {w.requests} | {w.accept_len:.3f} | "
            f"{w.verify_len:.2f} | {100 * w.acceptance_rate:.0f}% | {w.tokens_per_s:.1f} |"
        )
    print(flush=True)
