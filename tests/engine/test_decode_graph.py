"""The compiled decode steps (models/decode_graph.py), one request and batched: the same tokens
as HF ``generate`` in fp32 for plain and speculative engines, across KV-pool growth and row
moves, and the eager step whenever the graph is not there (compiling, failed, switched off)."""

import pytest
import torch

from adaflash.config import EngineConfig, SamplingParams
from adaflash.engine.engine import Engine
from adaflash.models import decode_graph
from adaflash.models.decode_graph import DecodeGraph
from adaflash.models.target import PackedBatch, load_target
from tests.engine.conftest import random_drafter
from tests.engine.oracle import OracleEngine, PinnedCost, from_references
from tests.engine.test_exactness import PROMPTS, hf_greedy

NEW = 24


@pytest.fixture(scope="module")
def compiled(tiny):
    """A target of its own (the session's is shared by eager tests) with both graphs."""
    folder, _, ref = tiny
    target = load_target(folder, "float32")
    drafter = random_drafter(target)
    graph = target.compile_decode((), background=False, batches=(4,))
    target.compile_decode(
        tuple(drafter.cfg.target_layer_ids), multi=True, background=False, batches=(4,)
    )
    assert not graph.failed, graph.failed
    references = {tuple(p): p + hf_greedy(ref, p, NEW + 20) for p in PROMPTS}
    return target, drafter, references


@pytest.fixture
def no_recompiles():
    """Serving must hit the graphs compiled ahead: a recompile would stall a step for minutes
    (it did once: inputs made in inference mode failed the graph's guards)."""
    with torch.compiler.set_stance("fail_on_recompile"):
        yield


@pytest.mark.slow  # compiles both graphs (minutes on two cores)
def test_plain_engine_through_the_graph_matches_hf_generate(compiled, no_recompiles):
    target, _, references = compiled
    graph = target.decode_graph
    before = graph.steps
    engine = Engine(target, None, EngineConfig(policy="ar", max_running_requests=1))
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert list(res.output_ids) == references[tuple(prompt)][len(prompt) : len(prompt) + NEW]
    assert graph.steps - before >= len(PROMPTS) * (NEW - 1)  # one request at a time: compiled


@pytest.mark.slow  # compiles the graphs (minutes on two cores)
def test_batched_plain_engine_through_the_graph_matches_hf_generate(compiled, no_recompiles):
    target, _, references = compiled
    graph = target.decode_graph
    before, tokens = graph.steps, graph.tokens
    engine = Engine(target, None, EngineConfig(policy="ar", max_running_requests=3))
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert list(res.output_ids) == references[tuple(prompt)][len(prompt) : len(prompt) + NEW]
    assert graph.tokens - tokens > graph.steps - before  # several requests per compiled step


@pytest.mark.slow  # compiles the graphs (minutes on two cores)
def test_batched_speculative_engine_with_captured_features_stays_exact(compiled, no_recompiles):
    target, drafter, references = compiled
    graph = target.decode_graph
    before = graph.steps
    cfg = EngineConfig(policy="cost", max_running_requests=4)
    engine = OracleEngine(target, drafter, cfg, continuation=from_references(references))
    engine.cost = PinnedCost()
    engine.cost.drafter.pin([1.0, 0.0, 0.0])  # drafting never pays: plain batched steps, probes
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert list(res.output_ids) == references[tuple(prompt)][len(prompt) : len(prompt) + NEW]
    assert graph.steps > before


@pytest.mark.slow  # compiles both graphs (minutes on two cores)
def test_speculative_engine_with_captured_features_stays_exact(
    compiled, monkeypatch, no_recompiles
):
    target, drafter, references = compiled
    monkeypatch.setattr(decode_graph, "MAX_TOKENS", 16)  # every verification width compiled
    graph = target.decode_graph
    before, tokens = graph.steps, graph.tokens
    cfg = EngineConfig(policy="cost", max_running_requests=1)
    engine = OracleEngine(target, drafter, cfg, continuation=from_references(references))
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert list(res.output_ids) == references[tuple(prompt)][len(prompt) : len(prompt) + NEW]
    assert graph.steps > before  # plain steps (k̂ = 0) ran compiled, capturing the context …
    assert graph.tokens - tokens > graph.steps - before  # … and so did verification


def compiled_steps_matching_eager(target, run) -> int:
    """Run ``run()`` through the graphs, then eager; assert the logits agree; return how many
    steps ran compiled."""
    graph = target.decode_graph
    steps = graph.steps
    try:
        fast = run()
        target.decode_graph = None
        eager = run()
    finally:
        target.decode_graph = graph
    for a, b in zip(fast, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    return graph.steps - steps


@pytest.mark.slow  # compiles both graphs (minutes on two cores)
def test_graph_equals_the_eager_step_across_pool_growth(compiled, no_recompiles):
    target, _, _ = compiled

    def run() -> list[torch.Tensor]:
        cache = target.new_cache(initial_capacity=8)  # grows 8 → 16 → 32 → 64 on the way
        slot = cache.allocate()
        prompt = torch.tensor([3, 4, 5, 6, 7])
        out = target(PackedBatch(prompt, (slot,), (5,)), cache, logits="last").logits
        logits = []
        for _ in range(40):
            tok = out.argmax(-1)
            out = target(PackedBatch(tok, (slot,), (1,)), cache, logits="last").logits
            logits.append(out[0])
        return logits

    assert compiled_steps_matching_eager(target, run) == 40


@pytest.mark.slow  # compiles the graphs (minutes on two cores)
def test_batched_graph_equals_the_eager_step_across_growth_and_row_moves(compiled, no_recompiles):
    target, _, _ = compiled

    def run() -> list[torch.Tensor]:
        cache = target.new_cache(initial_capacity=8, initial_rows=2)  # rows and length grow
        slots = [cache.allocate() for _ in range(4)]
        prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 15], [13, 14]]
        out = []
        for slot, p in zip(slots, prompts, strict=True):
            out.append(
                target(
                    PackedBatch(torch.tensor(p), (slot,), (len(p),)), cache, logits="last"
                ).logits
            )
        toks = torch.cat(out).argmax(-1)
        logits = []
        for i in range(30):
            if i == 10:  # the first request ends: the last row moves into its row; 3 remain
                cache.free(slots[0])
                slots, toks = slots[1:], toks[1:]
            out = target(PackedBatch(toks, tuple(slots), (1,) * len(slots)), cache, logits="last")
            logits.append(out.logits)
            toks = out.logits.argmax(-1)
        return logits

    # 4 requests, then 3 padded to 4: all compiled
    assert compiled_steps_matching_eager(target, run) == 30


def test_a_graph_that_fails_to_compile_leaves_the_eager_step(tiny, monkeypatch):
    folder, _, _ = tiny
    target = load_target(folder, "float32")

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    graph = target.compile_decode((), background=False)
    assert graph.status() == "failed" and not graph.ready(())
    cache = target.new_cache()
    slot = cache.allocate()
    out = target(PackedBatch(torch.tensor([3]), (slot,), (1,)), cache, logits="last")
    assert out.logits is not None and graph.steps == 0


def test_engine_asks_for_the_graph_only_when_configured(tiny, monkeypatch):
    folder, _, _ = tiny
    target = load_target(folder, "float32")
    asked: list[tuple[int, ...]] = []
    monkeypatch.setattr(DecodeGraph, "request", lambda self, capture, *a: asked.append(capture))
    Engine(target, None, EngineConfig(policy="ar"))
    assert asked == []
    Engine(target, None, EngineConfig(policy="ar", compile=True))
    assert asked == [()]
    monkeypatch.setenv("ADAFLASH_COMPILE", "0")
    Engine(target, None, EngineConfig(policy="ar", compile=True))
    assert asked == [()]
