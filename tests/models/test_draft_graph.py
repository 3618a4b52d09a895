"""The compiled drafter pass: the eager pass's context keys, states and drafts in one graph, the
same graph for a hot-swapped version and any draft vocabulary, eager wherever it does not serve."""

import copy

import pytest
import torch

from adaflash.config import DrafterConfig
from adaflash.models import draft_graph
from adaflash.models import gemv as gemv_kernel
from adaflash.models.draft_graph import DraftGraph, in_panels
from adaflash.models.drafter import BatchedContext, DFlashDrafter, NewContext

pytestmark = pytest.mark.skipif(not gemv_kernel.panels(), reason="no panels kernel for this CPU")

# every projection's shape fits panels (out features % 32, in features even)
CFG = DrafterConfig(64, 128, 2, 4, 2, 16, 96, 6, (1, 3), 95, block_size=4)
LM_HEAD = torch.randn(96, 64, generator=torch.Generator().manual_seed(3)).bfloat16()


def served(seed: int, vocab: int | None = None) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(CFG).eval().requires_grad_(False).to(torch.bfloat16)
    if vocab is not None:
        d.set_draft_vocab(torch.arange(vocab).flip(0))
    d.prepare_inference(LM_HEAD)
    return d


@pytest.fixture
def no_recompiles():
    """Serving must hit the graphs built ahead (a recompile stalls a step for seconds)."""
    with torch.compiler.set_stance("fail_on_recompile"):
        yield


def inputs(d: DFlashDrafter, lengths: list[int], fresh: list[int], seed: int = 1):
    """A pass's inputs as the engine builds them: per request ``lengths`` positions projected
    before and ``fresh`` new ones; and the new positions' features, per request."""
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        feats = [
            torch.randn(n + f, 2 * 64, generator=g).bfloat16()
            for n, f in zip(lengths, fresh, strict=True)
        ]
        old = [d.context_kv(x[:n], torch.arange(n)) for x, n in zip(feats, lengths, strict=True)]
        new = [x[n:] for x, n in zip(feats, lengths, strict=True)]
        block = torch.randn(len(lengths), 4, 64, generator=g).bfloat16()
        positions = torch.tensor([n + f for n, f in zip(lengths, fresh, strict=True)])[
            :, None
        ] + torch.arange(4)
        ctx = BatchedContext.stack(old, min_length=2)
        fresh_ctx = NewContext.stack([(x, n) for x, n in zip(new, lengths, strict=True)])
    return block, positions, ctx, fresh_ctx, feats


def eager(d: DFlashDrafter, block, positions, feats):
    """The eager pass over the whole context: states, drafts (draft-vocabulary indices)."""
    with torch.inference_mode():
        full = [d.context_kv(x, torch.arange(len(x))) for x in feats]
        states = d.draft_states(block, positions, BatchedContext.stack(full))
        logits = d.draft_logits(states[:, 1:].reshape(-1, 64).contiguous(), LM_HEAD)
    return states, logits.view(len(feats), 3, -1)


@pytest.fixture(scope="module")
def graph() -> DraftGraph:
    g = DraftGraph()
    g.request(served(0), background=False)
    assert g.failed is None and len(g.ready) == 2
    return g


@pytest.mark.parametrize(
    ("lengths", "fresh"), [([9], [3]), ([0], [30]), ([7, 3, 12], [1, 5, 2]), ([2, 40], [1, 1])]
)
def test_the_compiled_pass_computes_the_eager_pass(graph, lengths, fresh, no_recompiles):
    d = served(0)
    block, positions, ctx, new, feats = inputs(d, lengths, fresh)
    out = graph.draft(d, d.head_panels(LM_HEAD), block, positions, ctx, new)
    assert out is not None
    states, index, new_kv = out
    assert states.shape == (len(lengths), 4, 64) and index.shape == (len(lengths), 3)
    want_states, want_logits = eager(d, block, positions, feats)
    # bf16 projections in another order of additions: close, not equal
    assert torch.allclose(states.float(), want_states.float(), atol=0.05, rtol=0.05)
    # each draft is the best draft-vocabulary row, up to near-ties between the two orders
    picked = want_logits.float().gather(-1, index[..., None])[..., 0]
    assert torch.all(picked >= want_logits.float().amax(-1) - 0.1)
    for b, (n, f) in enumerate(
        zip(lengths, fresh, strict=True)
    ):  # the new positions' keys and values
        with torch.inference_mode():
            want = d.context_layers(feats[b][n:], torch.arange(n, n + f))
        assert torch.allclose(new_kv[b, :, :, :, :f].float(), want.float(), atol=0.05, rtol=0.05)


def test_a_hot_swapped_version_and_another_vocabulary_run_on_the_same_graph(graph, no_recompiles):
    out = {}
    for name, d in {"old": served(0), "new": served(7), "small": served(7, vocab=64)}.items():
        block, positions, ctx, fresh, feats = inputs(d, [11], [2])  # context of each version
        out[name] = graph.draft(d, d.head_panels(LM_HEAD), block, positions, ctx, fresh)
        assert out[name] is not None
        want = eager(d, block, positions, feats)[0]
        assert torch.allclose(out[name][0].float(), want.float(), atol=0.05, rtol=0.05)
    assert not torch.equal(out["old"][0], out["new"][0])
    assert int(out["small"][1].max()) < 64  # indices into the 64-row draft vocabulary


def test_where_it_does_not_serve_the_caller_gets_none_and_runs_eager(graph):
    d = served(0)
    block, positions, ctx, fresh, _ = inputs(d, [8], [1])
    assert graph.draft(d, None, block, positions, ctx, fresh) is None  # no head in panels
    plain = copy.deepcopy(d)
    plain.layers[0].self_attn.qkv_panels = None  # a weight not in panels
    assert not in_panels(plain)
    assert graph.draft(plain, d.head_panels(LM_HEAD), block, positions, ctx, fresh) is None
    assert DraftGraph().draft(d, d.head_panels(LM_HEAD), block, positions, ctx, fresh) is None


def test_a_call_that_raises_drops_the_graph_for_good():
    g = DraftGraph()
    d = served(0)
    g.ready.add((draft_graph._layout(d), False))  # as if built
    block, positions, ctx, fresh, _ = inputs(d, [8], [2])
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("kernel fault")

    g._fn = broken
    head = d.head_panels(LM_HEAD)
    assert g.draft(d, head, block, positions, ctx, fresh) is None
    assert g.failed == "RuntimeError: kernel fault"
    assert g.draft(d, head, block, positions, ctx, fresh) is None and calls == [1]


def test_compile_now_builds_both_graphs_for_an_unprepared_drafter(monkeypatch):
    monkeypatch.setattr(draft_graph, "_shared", None)
    torch.manual_seed(0)
    raw = DFlashDrafter(CFG)
    seconds = draft_graph.compile_now(raw, torch.bfloat16)
    assert set(seconds) == {"one request", "several requests"}
    assert raw.layers[0].self_attn.q_proj.packed is None  # the caller's drafter is left as it was
    assert raw.dtype == torch.float32
    assert draft_graph.compile_now(raw, torch.float32) == {}  # fp32: no panels, nothing built
