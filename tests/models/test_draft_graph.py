"""The compiled drafter pass: the eager pass's states, the same graph for a hot-swapped version,
eager wherever it does not serve."""

import copy

import pytest
import torch

from adaflash.config import DrafterConfig
from adaflash.models import draft_graph
from adaflash.models import gemv as gemv_kernel
from adaflash.models.draft_graph import DraftGraph, in_panels
from adaflash.models.drafter import BatchedContext, DFlashDrafter

pytestmark = pytest.mark.skipif(not gemv_kernel.panels(), reason="no panels kernel for this CPU")

# every projection's shape fits panels (out features % 32, in features even)
CFG = DrafterConfig(64, 128, 2, 4, 2, 16, 96, 6, (1, 3), 95, block_size=4)


def served(seed: int) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(CFG).eval().requires_grad_(False).to(torch.bfloat16)
    d.prepare_inference()
    return d


@pytest.fixture
def no_recompiles():
    """Serving must hit the graphs built ahead (a recompile stalls a step for seconds)."""
    with torch.compiler.set_stance("fail_on_recompile"):
        yield


def inputs(d: DFlashDrafter, lengths: list[int], seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        ctx = [
            d.context_kv(torch.randn(n, 2 * 64, generator=g).bfloat16(), torch.arange(n))
            for n in lengths
        ]
        block = torch.randn(len(lengths), 4, 64, generator=g).bfloat16()  # as the engine's
    positions = torch.tensor(lengths)[:, None] + torch.arange(4)
    return block, positions, BatchedContext.stack(ctx)


def eager(d: DFlashDrafter, block, positions, ctx) -> torch.Tensor:
    with torch.inference_mode():
        return d.draft_states(block, positions, ctx)


@pytest.fixture(scope="module")
def graph() -> DraftGraph:
    g = DraftGraph()
    g.request(served(0), background=False)
    assert g.failed is None and len(g.ready) == 2
    return g


@pytest.mark.parametrize("lengths", [[9], [30], [7, 3, 12], [2, 40]])
def test_the_compiled_pass_computes_the_eager_pass_states(graph, lengths, no_recompiles):
    d = served(0)
    block, positions, ctx = inputs(d, lengths)
    got = graph.states(d, block, positions, ctx)
    assert got is not None and got.shape == (len(lengths), 4, 64)
    want = eager(d, block, positions, ctx)
    # bf16 projections in another order of additions: close, not equal
    assert torch.allclose(got.float(), want.float(), atol=0.05, rtol=0.05)


def test_a_hot_swapped_version_runs_on_the_same_graph_with_its_own_weights(graph, no_recompiles):
    old, new = served(0), served(7)
    block, positions, ctx = inputs(old, [11])
    a, b = graph.states(old, block, positions, ctx), graph.states(new, block, positions, ctx)
    assert a is not None and b is not None and not torch.equal(a, b)
    want = eager(new, block, positions, ctx)
    assert torch.allclose(b.float(), want.float(), atol=0.05, rtol=0.05)


def test_where_it_does_not_serve_the_caller_gets_none_and_runs_eager(graph):
    d = served(0)
    block, positions, ctx = inputs(d, [1])  # one context position: its size would specialise
    assert graph.states(d, block, positions, ctx) is None
    plain = copy.deepcopy(d)
    plain.layers[0].self_attn.q_proj.packed = None  # a weight not in panels
    assert not in_panels(plain)
    block, positions, ctx = inputs(d, [8])
    assert graph.states(plain, block, positions, ctx) is None
    assert DraftGraph().states(d, block, positions, ctx) is None  # not built yet


def test_a_call_that_raises_drops_the_graph_for_good():
    g = DraftGraph()
    d = served(0)
    g.ready.add((draft_graph._layout(d), False))  # as if built
    block, positions, ctx = inputs(d, [8])
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("kernel fault")

    g._fn = broken
    assert g.states(d, block, positions, ctx) is None
    assert g.failed == "RuntimeError: kernel fault"
    assert g.states(d, block, positions, ctx) is None and calls == [1]  # never called again


def test_compile_now_builds_both_graphs_for_an_unprepared_drafter(monkeypatch):
    monkeypatch.setattr(draft_graph, "_shared", None)
    torch.manual_seed(0)
    raw = DFlashDrafter(CFG)
    seconds = draft_graph.compile_now(raw, torch.bfloat16)
    assert set(seconds) == {"one request", "several requests"}
    assert raw.layers[0].self_attn.q_proj.packed is None  # the caller's drafter is left as it was
    assert raw.dtype == torch.float32
    assert draft_graph.compile_now(raw, torch.float32) == {}  # fp32: no panels, nothing built
