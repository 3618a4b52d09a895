"""Dashboard figures (matplotlib's object API: safe to build on Gradio's worker threads)."""

from __future__ import annotations

import time
from typing import Any

from matplotlib.figure import Figure

from adaflash.metrics import Bucket, SpecCounters

GREEN, ORANGE, BLUE, GRAY, PURPLE = "#2e7d32", "#ef6c00", "#1565c0", "#757575", "#6a1b9a"


def _figure(title: str) -> tuple[Figure, Any]:
    fig = Figure(figsize=(7.2, 3.0), dpi=100)
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    fig.set_layout_engine("tight")
    return fig, ax


def _markers(ax: Any, versions: list[tuple[float, str]], now: float) -> None:
    for ts, name in versions[1:]:
        ax.axvline((ts - now) / 60, color=GRAY, ls="--", lw=1)
        ax.text((ts - now) / 60, ax.get_ylim()[1], f" {name}", fontsize=8, color=GRAY, va="top")


def _empty(ax: Any, text: str = "no rounds in this window yet") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color=GRAY)


def timeline(
    buckets: list[Bucket],
    versions: list[tuple[float, str]],
    now: float | None = None,
    probes: list[Bucket] | None = None,
    gates: dict[str, tuple[float, float]] | None = None,
) -> Figure:
    """Served τ and verify length per bucket; where the cost policy probed, the τ its probes
    measured for whole blocks; and at each version marker the gate's step: the replaced
    version's τ and the new one's on the same held-out rows. The last two show how good the
    drafter is whether or not it pays to draft (a drafter learning a new domain shows there)."""
    now = now or time.time()
    fig, ax = _figure("acceptance length τ and verify length (windowed)")
    if not buckets and not probes:
        _empty(ax)
        return fig
    steps = _gate_steps(versions, gates or {}, now, buckets)
    if steps:
        ax.plot(*steps, color=PURPLE, lw=2, label="drafter τ at each gate (held-out rows)")
    if probes:
        ax.plot(
            [(b.start - now) / 60 for b in probes],
            [b.counters.accept_len for b in probes],
            color=BLUE,
            ls=":",
            marker="^",
            ms=3,
            label="drafter τ, whole blocks (probes)",
        )
    x = [(b.start - now) / 60 for b in buckets]
    ax.plot(
        x,
        [b.counters.accept_len for b in buckets],
        color=GREEN,
        marker="o",
        ms=3,
        label="τ (accept_len)",
    )
    ax.plot(
        x,
        [b.counters.verify_len for b in buckets],
        color=ORANGE,
        marker="s",
        ms=3,
        label="verify_len",
    )
    ax.set_xlabel("minutes ago")
    ax.set_ylabel("tokens per round")
    ax.set_ylim(bottom=0)
    _markers(ax, versions, now)
    ax.legend(loc="upper left", fontsize=8)
    return fig


def _gate_steps(
    versions: list[tuple[float, str]],
    gates: dict[str, tuple[float, float]],
    now: float,
    buckets: list[Bucket],
) -> tuple[list[float], list[float]] | None:
    """A step line in minutes: before each gated marker the τ of the version it replaced, after
    it the new version's, held until the next marker (or now)."""
    gated = [((ts - now) / 60, gates[name]) for ts, name in versions if name in gates]
    if not gated:
        return None
    start = (min([b.start for b in buckets] + [versions[0][0]]) - now) / 60
    xs, ys = [start], [gated[0][1][0]]
    for x, (before, after) in gated:  # along at the level held, down/up to before, up to after
        xs += [x, x, x]
        ys += [ys[-1], before, after]
    return [*xs, 0.0], [*ys, ys[-1]]


def throughput(
    buckets: list[Bucket], versions: list[tuple[float, str]], now: float | None = None
) -> Figure:
    now = now or time.time()
    fig, ax = _figure("output tokens / s (all requests)")
    if not buckets:
        _empty(ax)
        return fig
    ax.bar(
        [(b.start - now) / 60 for b in buckets],
        [b.tokens_per_s for b in buckets],
        width=(buckets[0].seconds / 60) * 0.9,
        color=BLUE,
        align="edge",
    )
    ax.set_xlabel("minutes ago")
    ax.set_xlim(right=0)  # the current bucket is still filling
    _markers(ax, versions, now)
    return fig


def slots(counters: SpecCounters) -> Figure:
    fig, ax = _figure("per-slot acceptance P(slot i accepted | verified)")
    values = counters.slot_acceptance
    xs = [i + 1 for i, v in enumerate(values) if v is not None]
    if not xs:
        _empty(
            ax,
            f"{counters.rounds} rounds in this window, none verified a draft token\n"
            "(verify length 1: plain decoding, or the length head chose k̂ = 1)"
            if counters.rounds
            else "no rounds in this window yet",
        )
        return fig
    ax.plot(xs, [v for v in values if v is not None], color=GREEN, marker="o")
    ax.set_xlabel("draft slot")
    ax.set_ylim(0, 1.02)
    return fig


def domains(per_domain: dict[str, SpecCounters]) -> Figure:
    fig, ax = _figure("τ per domain")
    if not per_domain:
        _empty(ax)
        return fig
    names = sorted(per_domain)
    ax.bar(names, [per_domain[n].accept_len for n in names], color=GREEN)
    for i, n in enumerate(names):
        ax.text(
            i,
            per_domain[n].accept_len,
            f"{per_domain[n].accept_len:.2f}\n({per_domain[n].rounds} rounds)",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylim(0, max(c.accept_len for c in per_domain.values()) * 1.35 + 0.1)
    return fig


def training(runs: list[Any]) -> Figure:
    fig, ax = _figure("training runs: drafter loss per step")
    shown = [r for r in runs if r.history][:6]
    if not shown:
        _empty(ax, "no training runs yet")
        return fig
    for r in reversed(shown):
        ax.plot(
            [h["step"] for h in r.history],
            [h["draft_loss"] for h in r.history],
            label=f"run {r.id} → {r.version_id or r.status} ({r.samples} samples)",
        )
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    return fig
