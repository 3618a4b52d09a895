"""Greedy speculative output equals Hugging Face ``generate(do_sample=False)`` in fp32."""

import copy
import time

import pytest
import torch

from adaflash.config import EngineConfig, SamplingParams
from adaflash.engine import policy as policy_module
from adaflash.engine.engine import Engine
from adaflash.engine.policy import CostPolicy
from adaflash.engine.request import Request
from tests.engine.conftest import random_drafter
from tests.engine.oracle import OracleEngine, PinnedCost, from_references

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [30], [40, 41, 42, 43, 44]]
NEW = 40


def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    ref.generation_config.eos_token_id = None
    out = ref.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def references(tiny):
    _, _, ref = tiny
    return {tuple(p): p + hf_greedy(ref, p, NEW + 20) for p in PROMPTS}


@pytest.mark.parametrize("policy", ["ar", "fixed", "head", "cost"])
@pytest.mark.parametrize("drafter_kind", ["random", "oracle"])
def test_greedy_matches_hf_generate(tiny, references, policy, drafter_kind):
    _, target, _ = tiny
    cfg = EngineConfig(policy=policy, max_batch_tokens=40, max_prefill_tokens=8, gamma=1.3)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    drafter = random_drafter(target)
    if drafter_kind == "oracle":
        engine = OracleEngine(target, drafter, cfg, continuation=from_references(references))
    else:
        engine = Engine(target, drafter, cfg)
    if policy == "cost":  # choices from fixed costs, not this machine's timings of the moment
        engine.cost = PinnedCost()
    results = engine.generate(PROMPTS, params)
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert list(res.output_ids) == references[tuple(prompt)][len(prompt) : len(prompt) + NEW]
        assert res.finish_reason == "length"
    c = engine.counters
    if policy == "ar":
        assert c.verify_len == 1.0 and c.accept_len == 1.0
    elif drafter_kind == "oracle":
        # long acceptances happened: truncation after partial acceptance and bonus tokens (the
        # cost policy verifies fewer slots where the tiny target makes each one expensive)
        assert c.accept_len > (1.5 if policy == "cost" else 3.0), c.summary()
        assert 0 < c.acceptance_rate < 1
    if policy == "head":
        assert c.verify_len < 16  # the head chose shorter blocks than the fixed k
    if policy == "cost":
        st = engine.stats
        # the engine checked the policy's predicted step times against measured ones, and the
        # tokens it expected of steps with a drafter pass against what they committed
        assert st.predicted_drafting_s > 0 and st.measured_drafting_s > 0
        assert st.expected_drafting_tokens > 0 and st.realised_drafting_tokens > 0
        assert st.probes > 0 and st.probe_slots >= st.probes  # probed first, probes answered
        if drafter_kind == "oracle":  # every width happened: plain steps and verified drafts
            assert c.rounds > c.slot_verified[0] > 0
            # all four drafted with nobody queued, and what that gained the batch was measured
            assert st.whole_steps > 0 and st.whole_planned > 0 and st.whole_gained > 0
        else:  # drafts that are never right: probed, never verified, every step a plain one
            assert st.probe_accepted == 0 and c.slot_verified[0] == 0
            assert st.predicted_plain_s > 0 and st.measured_plain_s > 0


def test_a_drafting_step_beside_a_prompt_chunk_teaches_no_step_time(tiny, references):
    """Beside a prompt chunk the chunk's eager pass is most of a step's price and of its error
    (priced 1.07 s, took 0.46 s): such a step's time is not learnt as what drafting steps
    take (``drafting_bias``; its tokens are). Exact output all the same."""
    _, target, _ = tiny
    cfg = EngineConfig(policy="cost", max_batch_tokens=40, max_prefill_tokens=2)
    engine = OracleEngine(
        target, random_drafter(target), cfg, continuation=from_references(references)
    )
    engine.cost = PinnedCost()
    priced: list[tuple[bool, float | None]] = []  # (a prompt chunk in the pass, price taught)
    check = engine._check_prediction

    def spy(res, **kw) -> None:
        chunk = len(res.passed) > len(res.verified)  # a request still reading its prompt

        def observe(predicted, measured, expected=None, committed=None) -> None:
            priced.append((chunk, predicted))

        engine.cost.observe_drafting_step = observe  # type: ignore[method-assign]
        check(res, **kw)

    engine._check_prediction = spy  # type: ignore[method-assign]
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert list(res.output_ids) == references[tuple(prompt)][len(prompt) : len(prompt) + NEW]
    assert any(chunk for chunk, _ in priced) and any(not chunk for chunk, _ in priced), priced
    assert all((p == 0.0) == chunk for chunk, p in priced)


def test_probes_are_shadow_drafts_answered_by_what_the_target_commits(
    tiny, references, monkeypatch
):
    """A probe's drafts are never verified (every step stays a plain one) and its answer is
    what verifying them would have accepted: the drafts here are the target's own greedy
    continuation corrupted at slots known beforehand (``OracleEngine``), so each probe's
    answer is known too."""
    monkeypatch.setattr(policy_module, "PROBE_START_S", 1e9)  # the gap alone paces probes
    _, target, _ = tiny
    cfg = EngineConfig(policy="cost", max_batch_tokens=40, max_prefill_tokens=8)
    engine = OracleEngine(
        target, random_drafter(target), cfg, continuation=from_references(references)
    )
    engine.cost = PinnedCost()
    engine.cost.drafter.pin([1.0, 0.0, 0.0])  # a drafter pass costs 25 steps: never pays
    engine._policy = CostPolicy(engine.block_size, probe_every=4)
    answers: list[tuple[int, int, int, int]] = []
    answer = engine._answer_probe

    def spy(r: Request) -> None:  # (anchor position, output index, compared, accepted)
        shadow, st = r.shadow, copy.copy(engine.stats)
        answer(r)
        if r.shadow is None and engine.stats.probes > st.probes:
            assert shadow is not None
            compared, accepted = (
                engine.stats.probe_slots - st.probe_slots,
                engine.stats.probe_accepted - st.probe_accepted,
            )
            answers.append((len(r.prompt_ids) + shadow[0] - 1, shadow[0], compared, accepted))

    engine._answer_probe = spy  # type: ignore[method-assign]
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert list(res.output_ids) == references[tuple(prompt)][len(prompt) : len(prompt) + NEW]
    assert engine.counters.verify_len == 1.0  # nothing verified: every step a plain one
    assert len(answers) >= 5 and engine.stats.probes == len(answers)
    for pos, start, compared, accepted in answers:
        miss = next(i for i in range(1, 16) if (pos * 31 + i * 17) % 7 == 0)  # corrupted slot
        left = NEW - start  # tokens the request committed after the probe
        assert (compared, accepted) == ((miss, miss - 1) if miss <= left else (left, left))
    assert any(accepted > 3 for *_, accepted in answers)  # whole runs measured, not 3 slots
    # the dashboard's log of them: each answer once, in order, timed
    assert [(c, a) for _, c, a in engine.probe_log] == [(c, a) for *_, c, a in answers]
    stamps = [t for t, *_ in engine.probe_log]
    assert stamps == sorted(stamps) and stamps[-1] <= time.time()


def test_a_probes_slots_join_the_profile_as_tokens_decide_them(tiny, references):
    """A probe whose drafts keep matching is not answered only once its whole block is (15
    plain steps): each slot joins the profile as the committed tokens decide it, so the
    requests draft a step or two after the first probe, exactly as before."""
    _, target, _ = tiny
    cfg = EngineConfig(policy="cost", max_batch_tokens=80, max_prefill_tokens=8)
    engine = OracleEngine(
        target,
        random_drafter(target),
        cfg,
        continuation=from_references(references),
        corrupt_every=10_007,  # (almost) never corrupted: every probe matches its whole block
    )
    engine.cost = PinnedCost()
    steps: list[tuple[int, int]] = []  # per step: (probes launched, requests drafting)
    drafters = engine._policy.drafters

    def spy(ready, ctx):  # type: ignore[no-untyped-def]
        chosen = drafters(ready, ctx)
        steps.append((len(engine._policy.probes), len(chosen)))
        return chosen

    engine._policy.drafters = spy  # type: ignore[method-assign]
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert list(res.output_ids) == references[tuple(prompt)][len(prompt) : len(prompt) + NEW]
    first_probe = next(i for i, (probes, _) in enumerate(steps) if probes)
    first_draft = next(i for i, (_, chosen) in enumerate(steps) if chosen)
    assert 0 < first_draft - first_probe <= 3, steps[: first_draft + 1]


def test_budget_defers_and_chunked_prefill_stay_exact(tiny, references):
    """A verification budget of one block forces deferrals; 3-token prefill chunks force
    chunked prefill. Output is still identical."""
    _, target, _ = tiny
    cfg = EngineConfig(policy="fixed", max_batch_tokens=16, max_prefill_tokens=3)
    engine = OracleEngine(
        target, random_drafter(target), cfg, continuation=from_references(references)
    )
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert list(res.output_ids) == references[tuple(prompt)][len(prompt) : len(prompt) + NEW]
    assert engine.admission.n_hat < 2.0  # the EMA learned that about one request fits


def test_hot_swap_mid_generation_stays_exact(tiny, references):
    _, target, _ = tiny
    engine = OracleEngine(
        target,
        random_drafter(target, seed=0),
        EngineConfig(policy="head", max_batch_tokens=64),
        continuation=from_references(references),
    )
    results: dict = {}
    ids = [
        engine.add_request(
            p,
            SamplingParams(max_new_tokens=NEW, ignore_eos=True),
            on_finish=lambda rec: results.__setitem__(rec.request_id, rec),
        )
        for p in PROMPTS
    ]
    for _ in range(4):
        engine.step()
    engine.cost.observe_whole_step(10.0, 3.0)  # what the old drafter's plans gained …
    engine.swap_drafter(random_drafter(target, seed=1), "v1")
    while engine.has_work:
        engine.step()
    assert engine.version == "v1" and engine.stats.swaps == 1
    assert engine.cost.whole_yield == 1.0  # … does not hold for the new one
    for prompt, rid in zip(PROMPTS, ids, strict=True):
        want = references[tuple(prompt)][len(prompt) : len(prompt) + NEW]
        assert list(results[rid].output_ids) == want


def test_eos_stops_like_hf(tiny):
    """With EOS active, generation stops exactly where HF generate stops."""
    _, target, ref = tiny
    vocab_eos = None
    prompt = [3, 4, 5]
    # pick as EOS the 7th token HF would generate, so the stop happens mid-stream
    cont = hf_greedy(ref, prompt, 12)
    vocab_eos = cont[6]
    stop_at = cont.index(vocab_eos)
    engine = Engine(
        target, random_drafter(target), EngineConfig(policy="fixed"), eos_token_ids=(vocab_eos,)
    )
    (res,) = engine.generate([prompt], SamplingParams(max_new_tokens=12))
    assert list(res.output_ids) == cont[:stop_at]
    assert res.finish_reason == "stop"


def test_stop_token_ids_and_tokens_streamed_with_kinds(tiny, references):
    _, target, _ = tiny
    prompt = PROMPTS[1]
    cont = references[tuple(prompt)][len(prompt) :]
    engine = OracleEngine(
        target,
        random_drafter(target),
        EngineConfig(policy="fixed"),
        continuation=from_references(references),
    )
    events = []
    engine.add_request(
        prompt,
        SamplingParams(max_new_tokens=30, stop_token_ids=(cont[9],), ignore_eos=True),
        on_event=events.append,
    )
    while engine.has_work:
        engine.step()
    streamed = [t for e in events for t in e.token_ids]
    assert streamed == cont[: cont.index(cont[9])]
    assert events[-1].finished and events[-1].finish_reason == "stop"
    kinds = [k for e in events for k in e.kinds]
    assert "draft" in kinds and "target" in kinds and len(kinds) == len(streamed)


def test_abort_frees_the_slot(tiny):
    _, target, _ = tiny
    engine = Engine(target, random_drafter(target), EngineConfig(policy="fixed"))
    events = []
    rid = engine.add_request(
        [1, 2, 3], SamplingParams(max_new_tokens=100, ignore_eos=True), on_event=events.append
    )
    engine.step()
    engine.step()
    engine.abort(rid)
    engine.step()
    assert not engine.running and not engine.has_work
    assert events[-1].finish_reason == "abort"
    assert not any(s in engine.cache for s in range(10))


def test_requests_leaving_at_different_times_and_growing_the_pool_stay_exact(tiny_llama):
    """Short requests finish while a long one grows past the pool's first capacity (256): rows
    move on every free, the pool grows once; each output equals that request served alone."""
    _, target, _ = tiny_llama
    prompts = [[5, 6, 7], [10, 11], [30, 31, 32, 33], [40], [50, 51, 52]]
    lengths = [300, 7, 20, 3, 45]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    alone = [
        Engine(target, None, EngineConfig(policy="ar")).generate([p], [sp])[0].output_ids
        for p, sp in zip(prompts, params, strict=True)
    ]
    for policy in ("ar", "fixed"):
        engine = Engine(target, random_drafter(target), EngineConfig(policy=policy))
        together = engine.generate(prompts, params)
        assert [r.output_ids for r in together] == alone, policy
        assert engine.cache.capacity >= 300 and len(engine.cache) == 0
