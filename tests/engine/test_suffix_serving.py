"""Suffix drafts served: the ``cost`` policy verifies them where they pay, the output stays the
target's (fp32 greedy equals Hugging Face ``generate``), they teach the suffix profile and not
the drafter's, and ``EngineConfig.suffix`` scopes what a request drafts from."""

import pytest

from adaflash.config import EngineConfig, SamplingParams
from adaflash.engine.engine import Engine
from tests.engine.conftest import random_drafter
from tests.engine.oracle import PinnedCost
from tests.engine.test_exactness import PROMPTS, hf_greedy

NEW = 60


@pytest.fixture(scope="module")
def references(tiny):
    _, _, ref = tiny
    return {tuple(p): hf_greedy(ref, p, NEW) for p in PROMPTS}


def engine(target, policy: str = "cost", suffix: str = "global") -> Engine:
    e = Engine(target, random_drafter(target, block_size=8), EngineConfig(policy, suffix=suffix))
    e.cost = PinnedCost()  # choices from fixed costs, not this machine's timings
    return e


def serve_twice(e: Engine) -> list[list[int]]:
    """The prompts, then the same prompts again once the first answers are served."""
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    first = e.generate(PROMPTS, params)
    second = e.generate(PROMPTS, params)
    return [list(r.output_ids) for r in first + second]


def test_served_history_is_drafted_from_and_the_output_stays_the_targets(tiny, references):
    _, target, _ = tiny
    e = engine(target)
    taught: list[int] = []  # the drafter's profile: the widths of the rounds it learnt from
    observe = e._policy.observe
    e._policy.observe = lambda r, w, a, k: (taught.append(w), observe(r, w, a, k))  # type: ignore[method-assign]
    outputs = serve_twice(e)
    assert outputs == [references[tuple(p)] for p in PROMPTS] * 2
    suffix, dflash = e.source_counters["suffix"], e.source_counters["dflash"]
    # the repeated prompts drafted from the first answers, which were right far ahead
    assert suffix.rounds > 0 and suffix.accept_len > 3.0, suffix.summary()
    # a random drafter never pays: no round of its own, and the suffix rounds taught it nothing
    assert dflash.rounds == 0 and max(taught) == 1


def test_request_scope_drafts_from_its_own_tokens_alone(tiny, references):
    _, target, _ = tiny
    e = engine(target, suffix="request")
    assert e.history is None
    assert serve_twice(e) == [references[tuple(p)] for p in PROMPTS] * 2
    # the tiny model's replies do not repeat themselves: nothing to draft from
    assert e.source_counters["suffix"].rounds == 0


@pytest.mark.parametrize(("policy", "suffix"), [("cost", "off"), ("fixed", "global")])
def test_off_and_other_policies_propose_no_suffix_drafts(tiny, references, policy, suffix):
    _, target, _ = tiny
    e = engine(target, policy, suffix)
    assert serve_twice(e) == [references[tuple(p)] for p in PROMPTS] * 2
    assert e.source_counters["suffix"].rounds == 0


def test_suffix_tokens_stream_with_their_own_kind(tiny):
    _, target, _ = tiny
    e = engine(target)
    serve_twice(e)  # the history now holds the answers
    kinds: list[str] = []
    e.add_request(
        PROMPTS[1],
        SamplingParams(max_new_tokens=NEW, ignore_eos=True),
        on_event=lambda ev: kinds.extend(ev.kinds),
    )
    while e.has_work:
        e.step()
    assert "suffix" in kinds and "draft" not in kinds and kinds.count("target") >= 1
