"""bench/verify_widths.py: the drafts of a drafter of known quality (``--oracle-right``)."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import pytest

from adaflash.config import SamplingParams
from adaflash.engine.request import Request
from tests.bench.loader import bench_script


@pytest.fixture(scope="module")
def widths() -> Iterator[ModuleType]:
    with bench_script("verify_widths") as module:
        yield module


def drafts(module: ModuleType, right: float, done: int, width: int) -> list[int]:
    """``RightSometimes.drafts`` for a request that committed ``done`` tokens of its reply."""
    prompt, reply = [1, 2, 3], list(range(100, 400))
    engine = SimpleNamespace(
        references={tuple(prompt): reply},
        right=right,
        target=SimpleNamespace(cfg=SimpleNamespace(vocab_size=1000)),
    )
    r = Request("r", prompt, SamplingParams())
    r.output_ids = reply[:done]
    return module.RightSometimes.drafts(engine, r, width)


def test_drafts_are_right_with_the_given_probability_and_the_same_for_every_method(
    widths: ModuleType,
) -> None:
    reply = list(range(100, 400))
    assert drafts(widths, 1.0, 10, 15) == reply[10:25]
    assert all(d != t for d, t in zip(drafts(widths, 0.0, 10, 15), reply[10:25], strict=True))
    half = drafts(widths, 0.5, 0, 300)
    share = sum(d == t for d, t in zip(half, reply, strict=True)) / 300
    assert 0.4 < share < 0.6
    # a slot's draw belongs to its position: any round that drafts it meets the same
    assert drafts(widths, 0.5, 40, 15) == drafts(widths, 0.5, 0, 55)[40:]
    assert drafts(widths, 0.5, 295, 10)[5:] == [0] * 5  # past the reply
