"""The dashboard's charts say why they are empty instead of drawing nothing."""

from __future__ import annotations

from adaflash.metrics import SpecCounters
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
