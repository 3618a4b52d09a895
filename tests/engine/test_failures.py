"""One request's failure never hurts another (issue: a top_p of 5e-324 used to fail every request
of the step with a 500), and sampling is numerically safe for every accepted parameter value."""

import pytest
import torch

from adaflash.config import EngineConfig, SamplingParams
from adaflash.decoding.sampling import sample, target_probs
from adaflash.engine import round as round_module
from adaflash.engine.engine import Engine
from tests.engine.conftest import random_drafter

PROMPTS = [[5, 6, 7], [10, 11, 12, 13], [30], [40, 41, 42]]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [
        (1.0, 0, 5e-324),  # below float32's smallest number: rounds to 0
        (1.0, 0, 1e-45),
        (1e-30, 0, 1.0),  # logits / T overflows without the max shift
        (100.0, 10**9, 0.5),  # top_k beyond the vocabulary
        (2.0, 1, 1e-300),
    ],
)
def test_target_probs_is_a_distribution_for_extreme_parameters(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 30
    probs = target_probs(logits, temperature, top_k, top_p)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(6))
    top = logits.argmax(-1)
    assert (probs[torch.arange(6), top] > 0).all()  # the most likely token always survives
    sample(probs, g)  # torch.multinomial accepts it


def test_tiny_top_p_and_temperature_are_greedy(tiny_llama):
    _, target, _ = tiny_llama
    greedy = Engine(target, None, EngineConfig(policy="ar")).generate(
        PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True)
    )
    for params in (
        SamplingParams(temperature=1.0, top_p=5e-324, max_new_tokens=6, ignore_eos=True, seed=1),
        SamplingParams(temperature=1e-30, max_new_tokens=6, ignore_eos=True, seed=1),
    ):
        out = Engine(target, None, EngineConfig(policy="ar")).generate(PROMPTS, params)
        assert [r.output_ids for r in out] == [r.output_ids for r in greedy]


def test_a_request_failing_in_a_step_ends_alone(tiny_llama, monkeypatch):
    """Acceptance raises for one request (marked by its temperature); the others, in the same
    steps, finish with exactly their normal output."""
    _, target, _ = tiny_llama
    real = round_module.sampled_accept

    def flaky(logits, drafts, temperature, *args):
        if temperature == 0.777:
            raise RuntimeError("boom")
        return real(logits, drafts, temperature, *args)

    monkeypatch.setattr(round_module, "sampled_accept", flaky)
    good = SamplingParams(max_new_tokens=12, ignore_eos=True)
    bad = SamplingParams(temperature=0.777, max_new_tokens=12, ignore_eos=True, seed=3)
    reference = Engine(target, None, EngineConfig(policy="ar")).generate(PROMPTS, good)
    engine = Engine(target, random_drafter(target), EngineConfig(policy="fixed"))
    events = []
    ids = [
        engine.add_request(p, bad if i == 1 else good, on_event=events.append)
        for i, p in enumerate(PROMPTS)
    ]
    while engine.has_work:
        engine.step()
    finals = {e.request_id: e for e in events if e.finished}
    assert finals[ids[1]].finish_reason == "error" and "boom" in finals[ids[1]].error
    for i in (0, 2, 3):
        assert finals[ids[i]].finish_reason == "length"
        toks = [t for e in events if e.request_id == ids[i] for t in e.token_ids]
        assert toks == list(reference[i].output_ids)
    assert engine.stats.request_errors == 1
    assert not engine.running and len(engine.cache) == 0


def test_a_failing_shared_target_pass_is_narrowed_to_its_culprit(tiny_llama, monkeypatch):
    """The packed target pass raises whenever it holds the third request (KV slot 2): its
    requests are rolled back and retried one per step; only the one failing alone is ended."""
    _, target, _ = tiny_llama
    real_forward = type(target).forward

    def forward(self, batch, cache, **kw):
        if 2 in batch.slots:
            raise RuntimeError("bad kernel")
        return real_forward(self, batch, cache, **kw)

    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    reference = Engine(target, None, EngineConfig(policy="ar")).generate(PROMPTS, params)
    monkeypatch.setattr(type(target), "forward", forward)
    engine = Engine(target, random_drafter(target), EngineConfig(policy="head"))
    prompts = [*PROMPTS[:2], [50, 3, 4], *PROMPTS[2:]]
    records = engine.generate(prompts, params)
    assert records[2].finish_reason == "error"
    kept = [r for i, r in enumerate(records) if i != 2]
    assert [r.output_ids for r in kept] == [r.output_ids for r in reference]
    assert engine.stats.request_errors == 1
