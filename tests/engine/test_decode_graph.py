"""The compiled decode steps (models/decode_graph.py), one request and batched: the same tokens
as HF ``generate`` in fp32 for plain and speculative engines, across KV-pool growth and row
moves, and the eager step whenever the graph is not there (compiling, failed, switched off)."""

import json
import time

import pytest
import torch

from adaflash.config import EngineConfig, SamplingParams
from adaflash.engine.engine import Engine
from adaflash.models import decode_graph, gemv
from adaflash.models.decode_graph import DecodeGraph, Route
from adaflash.models.target import PackedBatch, load_target
from tests.engine.conftest import random_drafter
from tests.engine.oracle import OracleEngine, PinnedCost, from_references
from tests.engine.test_exactness import PROMPTS, hf_greedy

NEW = 24


@pytest.fixture(scope="module")
def compiled(tiny):
    """A target of its own (the session's is shared by eager tests) with both graphs; two
    verification widths: 2–4 tokens pad to 4, 5–16 to 16."""
    folder, _, ref = tiny
    target = load_target(folder, "float32")
    drafter = random_drafter(target)
    graph = target.compile_decode((), background=False, batches=(4,))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADAFLASH_VERIFY_GRAPHS", "4,16")
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
def test_speculative_engine_with_captured_features_stays_exact(compiled, no_recompiles):
    target, drafter, references = compiled
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
def test_padded_verification_equals_the_eager_pass(compiled, no_recompiles):
    """Every width 2–16 on the compiled widths 4 and 16 (padded but for 4 and 16): the same
    logits and captured features as the eager pass, and the same keys/values left behind."""
    target, drafter, _ = compiled
    layers = tuple(drafter.cfg.target_layer_ids)

    def run() -> list[torch.Tensor]:
        cache = target.new_cache(initial_capacity=8)  # grows on the way
        slot = cache.allocate()
        target(PackedBatch(torch.tensor([3, 4, 5]), (slot,), (3,)), cache, logits="none")
        out = []
        for n in range(2, 17):
            ids = torch.arange(n) * 7 % 50 + 3
            res = target(PackedBatch(ids, (slot,), (n,)), cache, capture_layers=layers)
            out += [res.logits, res.features]
            cache.truncate(slot, cache.length(slot) - n // 2)  # a partial accept
        row = cache.data[cache.row(slot), :, :, :, : cache.length(slot)]
        return [*out, row.clone()]

    assert compiled_steps_matching_eager(target, run) == 15


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


@pytest.mark.slow  # compiles the graphs (minutes on two cores)
def test_batched_verification_equals_the_eager_pass(compiled, no_recompiles):
    """Two to four requests verifying 1–4 tokens each on the compiled batch of 4 × 4 tokens
    (padded in both): the same logits and features as the eager pass, in packed order, and
    the same keys/values left in every row; wider or larger passes stay eager."""
    target, drafter, _ = compiled
    layers = tuple(drafter.cfg.target_layer_ids)
    graph = target.decode_graph
    assert graph.batch_verify(layers, (2, 4, 1)) == (layers, 4, 4)
    assert graph.batch_verify(layers, (2, 5)) is None  # wider than the compiled width
    assert graph.batch_verify(layers, (2,) * 5) is None  # more requests than the batch
    assert graph.batch_verify(layers, (1, 1)) is None  # plain decode: the batched decode step

    def run() -> list[torch.Tensor]:
        cache = target.new_cache(initial_capacity=8, initial_rows=2)  # rows and length grow
        slots = [cache.allocate() for _ in range(4)]
        for slot, p in zip(slots, ([3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 15], [13]), strict=True):
            target(PackedBatch(torch.tensor(p), (slot,), (len(p),)), cache, logits="none")
        out = []
        for lengths in ((2, 4, 1, 3), (4, 4), (1, 2, 3), (3, 1, 1, 4)):
            use = tuple(slots[: len(lengths)])
            ids = torch.arange(sum(lengths)) * 5 % 50 + 3
            res = target(PackedBatch(ids, use, lengths), cache, capture_layers=layers)
            out += [res.logits, res.features]
            for slot, n in zip(use, lengths, strict=True):
                cache.truncate(slot, cache.length(slot) - n // 2)  # partial accepts
        rows = [cache.data[cache.row(s), :, :, :, : cache.length(s)].clone() for s in slots]
        return [*out, *rows]

    assert compiled_steps_matching_eager(target, run) == 4


@pytest.mark.slow  # compiles the graphs (minutes on two cores)
def test_batched_drafting_engine_verifies_through_the_batched_graph_exactly(
    compiled, no_recompiles
):
    target, _, references = compiled
    graph = target.decode_graph
    before, tokens = graph.steps, graph.tokens
    drafter = random_drafter(target, block_size=4)  # the same captured layers: the same graphs
    cfg = EngineConfig(policy="fixed", max_running_requests=4)  # k̂ = 4: the compiled width
    engine = OracleEngine(target, drafter, cfg, continuation=from_references(references))
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert list(res.output_ids) == references[tuple(prompt)][len(prompt) : len(prompt) + NEW]
    assert graph.tokens - tokens > 2 * (graph.steps - before)  # several tokens a compiled step


def test_a_verification_takes_the_smallest_compiled_width_that_holds_it(tiny, monkeypatch):
    folder, _, _ = tiny
    graph = DecodeGraph(load_target(folder, "float32"))
    assert not graph.ready((), 1) and graph.width((), 3) is None
    step = lambda *a: ()  # noqa: E731 - stands in for a compiled function
    graph.graphs = {((), 1, 1): step, ((), 4, 1): step, ((), 16, 1): step, ((7,), 8, 1): step}
    graph.graphs[((), 1, 4)] = step  # a batched decode step is no verification width
    assert [graph.width((), n) for n in (1, 2, 4, 5, 16, 17)] == [1, 4, 4, 16, 16, None]
    assert graph.width((7,), 1) is None and graph.width((7,), 3) == 8
    # what the cost model is told: batch sizes, graph count, batched verifications (none here),
    # one-request verification widths
    assert graph.compiled(()) == ((4,), 4, (), (4, 16))
    assert graph.compiled((7,)) == ((), 1, (), (8,))
    monkeypatch.setenv("ADAFLASH_VERIFY_GRAPHS", "16, 8,1")
    assert decode_graph.verify_widths() == (8, 16)
    monkeypatch.setenv("ADAFLASH_VERIFY_GRAPHS", "0")
    assert decode_graph.verify_widths() == ()


def test_a_batched_verification_takes_the_smallest_batch_then_width_that_holds_it(
    tiny, monkeypatch
):
    folder, _, _ = tiny
    graph = DecodeGraph(load_target(folder, "float32"))
    step = lambda *a: ()  # noqa: E731 - stands in for a compiled function
    graph.graphs = {k: step for k in (((), 1, 4), ((), 4, 4), ((), 8, 4), ((), 4, 8), ((7,), 4, 4))}
    assert graph.batch_verify((), (2, 3)) == ((), 4, 4)
    assert graph.batch_verify((), (2, 6, 1)) == ((), 8, 4)
    assert graph.batch_verify((), (2,) * 5) == ((), 4, 8)
    assert graph.batch_verify((), (5,) * 5) is None  # no graph both that wide and that large
    assert graph.batch_verify((), (1, 1, 1)) is None  # plain decode: the batched decode step
    assert graph.batch_verify((), (3,)) is None  # one request: its own verification width
    assert graph.batch_verify((7,), (4, 4)) == ((7,), 4, 4)
    assert graph.batch_size((), 3) == 4 and graph.width((), 4) is None  # neither is one
    assert graph.compiled(()) == ((4,), 4, ((4, 4), (4, 8), (8, 4)), ())  # (batch size, width)
    # what an engine asks for: batched verification only with drafting, default width 4
    monkeypatch.setattr(graph, "_compile", lambda key: None)
    monkeypatch.setattr(decode_graph, "native_bf16", lambda: True)
    graph.request((), multi=False, background=False, batches=(4, 8))
    assert ((), 4, 4) not in graph._asked
    graph.request((7,), multi=True, background=False, batches=(4, 8))
    assert {((7,), 4, 4), ((7,), 4, 8)} <= graph._asked
    # without native bf16 only where the kernel takes every row (elsewhere bf16 GEMMs crawl)
    monkeypatch.setattr(decode_graph, "native_bf16", lambda: False)
    monkeypatch.setattr(decode_graph.gemv_kernel, "max_rows", lambda: 16)
    graph.request((9,), multi=True, background=False, batches=(4, 8))
    assert ((9,), 4, 4) in graph._asked and ((9,), 4, 8) not in graph._asked
    monkeypatch.setenv("ADAFLASH_BATCH_VERIFY_GRAPHS", "0")
    assert decode_graph.batch_verify_widths() == ()


def test_the_routes_measured_are_those_that_went_both_ways_on_cpus_of_a_class(monkeypatch):
    K, T, D = Route(True, True), Route(False, True), Route(False, False)  # D: oneDNN
    K1 = Route(True, False)  # the kernel, wider GEMMs on oneDNN
    for flags, kernel, candidates in (
        ({"avx512f"}, False, (T,)),  # no native bf16, no kernel: the template widens in registers
        ({"avx2", "fma"}, True, (K, T)),  # the kernel against the template (one row)
        ({"avx512_bf16", "amx_bf16"}, False, (T,)),  # AMX: the template won over oneDNN
        ({"avx512_bf16", "amx_bf16"}, True, (K, T)),
        # AVX512-BF16 alone: oneDNN won on one CPU, lost on another, and so did the kernel
        ({"avx512_bf16"}, False, (T, D)),
        ({"avx512_bf16"}, True, (K1, T, D)),
    ):
        monkeypatch.setattr(decode_graph, "cpu_flags", lambda flags=flags: frozenset(flags))
        monkeypatch.setattr(decode_graph.gemv_kernel, "available", lambda kernel=kernel: kernel)
        monkeypatch.delenv("ADAFLASH_AUTOTUNE", raising=False)
        assert decode_graph.routes() == candidates, flags
        monkeypatch.setenv("ADAFLASH_AUTOTUNE", "0")
        assert decode_graph.routes() == ((K1,) if kernel else ()) + (D,)
        monkeypatch.setenv("ADAFLASH_AUTOTUNE", "1")
        assert decode_graph.routes() == ((K,) if kernel else ()) + (T,)


@pytest.mark.parametrize("fastest", [0, 1, 2])
def test_where_the_route_is_measured_the_fastest_graph_serves_and_is_remembered(
    tiny_llama, tmp_path, monkeypatch, fastest
):
    """Every candidate route is built for the first graph and timed; the fastest serves, every
    later graph (and a later process on this machine, for this model) takes the same route
    without measuring again. Builds are stand-ins: this is about the choice, not inductor."""
    _, target, _ = tiny_llama
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path))
    candidates = (Route(True, False), Route(False, True), Route(False, False))
    monkeypatch.setattr(decode_graph, "routes", lambda: candidates)
    best = candidates[fastest]
    built: list[tuple[tuple, Route]] = []

    def build(self, key, route):  # a step that takes 1 ms the fastest way, 6 ms else
        built.append((key, route))
        return lambda *args: time.sleep(0.001 if route == best else 0.006)

    monkeypatch.setattr(DecodeGraph, "_build", build)
    graph = DecodeGraph(target)
    graph.request((), multi=True, background=False)
    assert graph.route == best and not graph.failed
    assert decode_graph.compiled_route(target) is None  # (this graph is not the target's)
    first = [(((), 1, 1), r) for r in candidates]
    assert built == first + [(((), w, 1), best) for w in decode_graph.verify_widths()]
    assert decode_graph.remembered_route(target, candidates) == best
    assert decode_graph.remembered_route(target, candidates[fastest + 1 :]) is None  # not now
    built.clear()
    again = DecodeGraph(target)  # a later process: remembered, nothing measured
    again.request((), background=False)
    assert built == [(((), 1, 1), best)]


def test_the_route_decides_the_one_row_step_and_wider_steps_keep_the_kernel(
    tiny_llama, monkeypatch
):
    _, target, _ = tiny_llama
    monkeypatch.setattr(decode_graph.gemv_kernel, "max_rows", lambda: 16)
    steps: list[tuple[type, bool]] = []
    real = decode_graph._Step.__init__

    def record(self, target, capture=(), widen=False, gemv=True):
        steps.append((type(self), gemv))
        real(self, target, capture, widen, gemv)

    monkeypatch.setattr(decode_graph._Step, "__init__", record)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lambda *args: None)
    graph = DecodeGraph(target)
    for key in (((), 1, 1), ((), 4, 1), ((), 1, 4)):
        graph._build(key, Route(False, True))
    assert steps == [
        (decode_graph.DecodeStep, False),  # one row: the template, as the route says
        (decode_graph.DecodeStep, True),  # four rows: the kernel, where it takes them
        (decode_graph.BatchDecodeStep, True),
    ]


def test_wide_bf16_graphs_multiply_with_fp32_weights_where_bf16_is_not_native(monkeypatch):
    for native, kernel_rows, dtype, tokens, env, wide in (
        (False, 0, torch.bfloat16, 16, None, True),
        (False, 0, torch.bfloat16, 8, None, True),
        (False, 0, torch.bfloat16, 4, None, False),  # few rows: bf16 streams half the bytes
        (False, 0, torch.bfloat16, 16, "0", False),  # switched off
        (False, 0, torch.bfloat16, 4, "4", True),
        (True, 0, torch.bfloat16, 16, None, False),  # native bf16 multiplies bf16 itself
        (False, 0, torch.float32, 16, None, False),  # fp32 weights already
        (False, 16, torch.bfloat16, 16, None, False),  # the GEMV kernel widens in registers
        (False, 4, torch.bfloat16, 8, None, True),  # … up to its rows
    ):
        monkeypatch.setattr(decode_graph, "native_bf16", lambda native=native: native)
        monkeypatch.setattr(decode_graph.gemv_kernel, "max_rows", lambda r=kernel_rows: r)
        if env is None:
            monkeypatch.delenv("ADAFLASH_WIDEN_TOKENS", raising=False)
        else:
            monkeypatch.setenv("ADAFLASH_WIDEN_TOKENS", env)
        assert decode_graph.widen(dtype, tokens) is wide


def test_a_widened_step_computes_the_bf16_step(tiny):
    """Uncompiled (the arithmetic, not the compiler): fp32 weights, products rounded back to
    bf16, give the bf16 step's logits up to bf16 rounding, and the same top token."""
    folder, _, _ = tiny
    target = load_target(folder, "bfloat16")
    cache = target.new_cache()
    slot = cache.allocate()
    target(PackedBatch(torch.tensor(PROMPTS[0]), (slot,), (len(PROMPTS[0]),)), cache)
    past = cache.data[cache.row(slot)]
    ids, pos = torch.tensor([5, 9, 11, 3]), torch.tensor([cache.length(slot)])
    with torch.no_grad():
        plain = decode_graph.DecodeStep(target, (1,))(ids, pos, past)
        wide = decode_graph.DecodeStep(target, (1,), widen=True)(ids, pos, past)
    assert wide[0].dtype == plain[0].dtype == torch.float32  # logits
    torch.testing.assert_close(wide[0], plain[0], atol=0.1, rtol=0.05)
    assert torch.equal(wide[0].argmax(-1), plain[0].argmax(-1))
    assert wide[1].dtype == torch.bfloat16  # new keys/values stay in the pool's dtype
    torch.testing.assert_close(wide[1].float(), plain[1].float(), atol=0.05, rtol=0.05)


@pytest.mark.skipif(not gemv.panels(), reason="no panels kernel for this CPU")
def test_a_step_multiplies_through_the_eager_steps_panels(tiny, monkeypatch):
    """Uncompiled: the step's projections go through the panels the fused target packed (the
    same tensors: no second copy) and give the step without panels up to bf16 rounding."""
    folder, _, _ = tiny
    target = load_target(folder, "bfloat16")
    target.fuse()
    cache = target.new_cache()
    slot = cache.allocate()
    target(PackedBatch(torch.tensor(PROMPTS[0]), (slot,), (len(PROMPTS[0]),)), cache)
    past = cache.data[cache.row(slot)]
    ids, pos = torch.tensor([5, 9, 11, 3]), torch.tensor([cache.length(slot)])
    step = decode_graph.DecodeStep(target, (1,))
    layers = len(target.layers)
    assert len(step.panels) == 4 * layers + 1  # every projection and the LM head fit
    attn, mlp = target.layers[0].self_attn, target.layers[0].mlp
    assert step.panel(0, 0).data_ptr() == attn.qkv_packed.panels.data_ptr()
    assert step.panel(0, 3).data_ptr() == mlp.down_proj.packed.panels.data_ptr()
    assert step.panel(layers, 0).data_ptr() == target.lm_head.packed.panels.data_ptr()
    calls = []
    real = gemv.panel_linear
    monkeypatch.setattr(gemv, "panel_linear", lambda x, p: calls.append(p) or real(x, p))
    with torch.no_grad():
        got = step(ids, pos, past)
    assert len(calls) == 4 * layers + 1
    monkeypatch.setenv("ADAFLASH_PANELS", "0")
    with torch.no_grad():
        want = decode_graph.DecodeStep(target, (1,))(ids, pos, past)
    torch.testing.assert_close(got[0], want[0], atol=0.1, rtol=0.05)
    assert torch.equal(got[0].argmax(-1), want[0].argmax(-1))
    torch.testing.assert_close(got[1].float(), want[1].float(), atol=0.05, rtol=0.05)


def test_without_module_guards_each_step_keeps_to_its_own_graph(tiny_llama):
    """The compiled steps drop Dynamo's guards on their module and parameters (~1 ms a call).
    Each step has a code object of its own, so another step — other captured layers, same
    inputs — is not served by the first one's graph, and other input shapes still recompile
    instead of running a graph made for others. Dynamo's eager backend: the guards, not
    inductor, are the point."""
    _, target, _ = tiny_llama
    cache = target.new_cache()
    slot = cache.allocate()
    target(PackedBatch(torch.tensor(PROMPTS[0]), (slot,), (len(PROMPTS[0]),)), cache)
    past, pos = cache.data[cache.row(slot)], torch.tensor([cache.length(slot)])
    guards = {"guard_filter_fn": decode_graph.module_guards_off}
    plain, captures = (decode_graph.DecodeStep(target, c).eval() for c in ((), (0, 1)))
    run = {
        step: torch.compile(decode_graph.own_code(step), backend="eager", options=guards)
        for step in (plain, captures)
    }
    with torch.no_grad():
        one, two = torch.tensor([5]), torch.tensor([5, 9])
        assert run[plain](one, pos, past)[2] is None
        features = run[captures](one, pos, past)[2]  # not the plain step's graph
        torch.testing.assert_close(features, captures(one, pos, past)[2])
        logits = run[plain](two, pos, past)[0]  # two tokens: a graph of their own
        torch.testing.assert_close(logits, plain(two, pos, past)[0])


@pytest.mark.skipif(not gemv.available(), reason="the C++ kernels did not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_attention_op_computes_the_decomposed_attention(tiny, dtype):
    """Uncompiled: the steps' attention through the C++ op (positions < pos of each row) gives
    the decomposed attention's outputs (the whole capacity, masked), one request verifying
    several tokens and a batch of requests on rows of the pool in any order."""
    folder, _, _ = tiny
    target = load_target(folder, str(dtype).removeprefix("torch."))
    cache = target.new_cache()
    slots = [cache.allocate() for _ in PROMPTS[:3]]
    for slot, p in zip(slots, PROMPTS, strict=False):
        target(PackedBatch(torch.tensor(p), (slot,), (len(p),)), cache)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}
    one = torch.tensor([cache.length(slots[1])])
    many = torch.tensor([cache.length(s) for s in reversed(slots)])
    rows = torch.tensor([cache.row(s) for s in reversed(slots)])
    with torch.no_grad():
        single = [
            decode_graph.DecodeStep(target, (1,), attention=op)(
                torch.tensor([5, 9, 11]), one, cache.data[cache.row(slots[1])]
            )
            for op in (True, False)
        ]
        batch = [
            decode_graph.BatchDecodeStep(target, (1,), attention=op)(
                torch.tensor([5, 9, 11]), rows, many, cache.data
            )
            for op in (True, False)
        ]
    for (op_logits, op_kv, op_feats), (logits, kv, feats) in (single, batch):
        torch.testing.assert_close(op_logits, logits, **tol)
        torch.testing.assert_close(op_feats, feats, **tol)
        torch.testing.assert_close(op_kv.float(), kv.float(), **tol)
        assert torch.equal(op_kv[0], kv[0])  # the first layer's come before any attention
        if dtype == torch.float32:
            assert torch.equal(op_logits.argmax(-1), logits.argmax(-1))


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


def test_a_compiled_step_that_raises_is_dropped_and_the_eager_step_serves_it(tiny):
    """A graph that raises when called (a tracer error once failed two demo requests) costs
    the step nothing: the eager step serves it exactly, and that graph is never called again."""
    folder, _, _ = tiny
    target, plain = load_target(folder, "float32"), load_target(folder, "float32")
    graph = DecodeGraph(target)
    target.decode_graph = graph
    calls: list[int] = []

    def broken(*inputs):
        calls.append(len(inputs))
        raise NameError("module is not installed as a submodule")

    graph.graphs = {((), 1, 1): broken, ((), 1, 4): broken}
    caches = [target.new_cache(), plain.new_cache()]
    slots = [[c.allocate() for _ in range(2)] for c in caches]
    steps = [  # (ids, lengths): both requests' prompts, one alone, then both a token each
        (torch.tensor([5, 6, 7, 8, 9]), (2, 3)),
        (torch.tensor([11]), (1,)),
        (torch.tensor([12, 13]), (1, 1)),
        (torch.tensor([14]), (1,)),
    ]
    for ids, lengths in steps:
        outs = [
            m(PackedBatch(ids, tuple(s[: len(lengths)]), lengths), c, logits="all")
            for m, c, s in zip((target, plain), caches, slots, strict=True)
        ]
        assert torch.equal(outs[0].logits, outs[1].logits)
    assert calls == [3, 4]  # each graph tried once, then dropped
    assert not graph.graphs and set(graph.failed) == {((), 1, 1), ((), 1, 4)}
    assert "NameError" in graph.failed[((), 1, 1)] and graph.status() == "failed"
    assert graph.steps == 0
    assert [caches[0].length(s) for s in slots[0]] == [caches[1].length(s) for s in slots[1]]


def test_engine_asks_for_the_graph_only_when_configured(tiny, monkeypatch):
    folder, _, _ = tiny
    target = load_target(folder, "float32")
    asked: list[tuple[tuple[int, ...], bool]] = []
    record = lambda self, capture, multi=False, *a: asked.append((capture, multi))  # noqa: E731
    monkeypatch.setattr(DecodeGraph, "request", record)
    Engine(target, None, EngineConfig(policy="ar"))
    assert asked == []
    Engine(target, None, EngineConfig(policy="ar", compile=True))
    assert asked == [((), False)]
    # with a drafter, plain steps capture its layers under every policy (a later policy drafts
    # from them), so those are the graphs; verification ones only where a policy drafts
    drafter = random_drafter(target)
    layers = tuple(drafter.cfg.target_layer_ids)
    Engine(target, drafter, EngineConfig(policy="ar", compile=True))
    Engine(target, drafter, EngineConfig(policy="cost", compile=True))
    assert asked[1:] == [(layers, False), (layers, True)]
    monkeypatch.setenv("ADAFLASH_COMPILE", "0")
    Engine(target, None, EngineConfig(policy="ar", compile=True))
    assert len(asked) == 3


def test_a_choice_that_fails_to_build_or_wins_by_a_hair_serves_but_is_not_remembered(
    tiny_llama, tmp_path, monkeypatch
):
    _, target, _ = tiny_llama
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path))
    kernel, template, onednn = Route(True, False), Route(False, True), Route(False, False)
    monkeypatch.setattr(decode_graph, "routes", lambda: (kernel, template, onednn))
    (tmp_path / "routes.json").write_text("{not json")  # a file left half-written

    def build_failing(self, key, route):
        if route.tune:
            raise RuntimeError("the template does not build here")
        return lambda *args: time.sleep(0.001 if route.gemv else 0.006)

    monkeypatch.setattr(DecodeGraph, "_build", build_failing)
    graph = DecodeGraph(target)
    graph.request((), background=False)
    assert graph.route == kernel and not graph.failed and ((), 1, 1) in graph.graphs
    # one way never ran: measure again next time
    assert decode_graph.remembered_route(target, graph.routes) is None

    monkeypatch.setattr(DecodeGraph, "_build", lambda self, key, route: lambda *args: None)
    times = {kernel: 1.02, template: 1.00, onednn: 3.0}
    monkeypatch.setattr(DecodeGraph, "_time", lambda self, fns, key: times)
    tie = DecodeGraph(target)
    tie.request((), background=False)
    assert tie.route == template and decode_graph.remembered_route(target, tie.routes) is None

    times[kernel] = 2.0
    clear = DecodeGraph(target)
    clear.request((), background=False)
    assert clear.route == template
    assert decode_graph.remembered_route(target, clear.routes) == template
    assert json.loads((tmp_path / "routes.json").read_text())  # rewritten whole
