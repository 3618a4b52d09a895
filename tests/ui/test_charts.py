"""The dashboard's charts say why they are empty instead of drawing nothing."""

from __future__ import annotations

from adaflash.metrics import Bucket, SpecCounters
from ui import charts


def texts(fig) -> str:
    return " ".join(t.get_text() for ax in fig.axes for t in ax.texts)


def test_slot_chart_explains_an_empty_window():
    assert "no rounds in this window yet" in texts(charts.slots(SpecCounters(16)))
    only_k1 = SpecCounters(16)
    for _ in range(5):
        only_k1.add_round(verify_len=1, accepted=0, drafted=15)
    assert "5 rounds in this window, none verified a draft token" in texts(charts.slots(only_k1))
    some = SpecCounters(16)
    some.add_round(verify_len=4, accepted=2, drafted=15)
    fig = charts.slots(some)
    assert texts(fig) == "" and len(fig.axes[0].lines) == 1


def test_timeline_draws_the_probes_drafter_tau_even_with_no_drafting_rounds():
    now = 1000.0
    assert "no rounds in this window yet" in texts(charts.timeline([], [], now))
    probed = [Bucket(940.0, SpecCounters.from_totals(16, 4, 20, 6), 0, 30.0)]
    fig = charts.timeline([], [(900.0, "v0000"), (950.0, "v0001")], now, probed)
    (line,) = fig.axes[0].lines[:1]
    assert line.get_label() == "drafter τ, whole blocks (probes)"
    assert list(line.get_ydata()) == [2.5] and list(line.get_xdata()) == [-1.0]
    assert "v0001" in texts(fig)  # the version marker drawn over it


def test_timeline_steps_the_gate_tau_at_each_version_marker():
    now = 1000.0
    buckets = [Bucket(880.0, SpecCounters.from_totals(16, 10, 10, 0), 10, 20.0)]
    versions = [(880.0, "v0000"), (940.0, "v0001"), (970.0, "v0002")]
    gates = {"v0001": (1.4, 1.6), "v0002": (1.55, 1.7)}  # v0000 (shipped) has no gate
    fig = charts.timeline(buckets, versions, now, None, gates)
    (line,) = [ln for ln in fig.axes[0].lines if ln.get_label().startswith("drafter τ at each")]
    assert list(line.get_xdata()) == [-2.0, -1.0, -1.0, -1.0, -0.5, -0.5, -0.5, 0.0]
    assert list(line.get_ydata()) == [1.4, 1.4, 1.4, 1.6, 1.6, 1.55, 1.7, 1.7]
    plain = charts.timeline(buckets, versions, now)  # no gates given: no step drawn
    assert not [ln for ln in plain.axes[0].lines if "gate" in ln.get_label()]
