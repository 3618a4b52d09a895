"""The drafter's serving pass (``DFlashDrafter.draft_states``) as one compiled graph.

A drafting round at one request pays a drafter pass beside the verification, and on a CPU that
pass is mostly the ops between its 18 projections: the block's states of a 3-layer drafter took
3.3 ms eager, 1.8 of them in the projections (8 rows, 300 context positions, Zen 4 EPYC, one
thread, profiled). Compiled, the norms, RoPE, attention and SwiGLU fuse into a few C++ loops
around the same projection kernel: 2.4–2.5 against 3.0–3.6 ms for the same pass (interleaved,
beside a training job); in an engine verifying 4 tokens a round the drafter's part of a round
fell from 5.0–5.4 to 4.2–4.4 ms.

The weights are the graph's inputs, not constants: a hot-swapped version of the same layout runs
on the graph compiled for the one before (no recompile, no stall). Context length and request
count are dynamic (one graph for one request, one for several: the compiler specialises a size
of 1), so a graph is built twice per layout, in a background thread, while the eager pass
serves. It serves only where every projection has its weight in panels (``models/gemv.py``):
there the graph multiplies through the same kernel as the eager pass; elsewhere the eager pass
keeps its own routes (AMX tiles, oneDNN, fp32 copies). A call that raises drops the graph for
good and that pass, and every later one, runs eager.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from adaflash.models import gemv as gemv_kernel
from adaflash.models.decode_graph import quick_gil_handoff, trace_fx_once_here
from adaflash.models.layers import Projection, apply_rope

if TYPE_CHECKING:
    from adaflash.models.drafter import BatchedContext, DFlashDrafter, NewContext

log = logging.getLogger(__name__)

# (projected, new) context lengths each graph is run at when built (both dims are dynamic)
WARM_SIZES = ((24, 3), (40, 5))


def draft_pass(
    drafter: DFlashDrafter,
    head: torch.Tensor,  # the draft head's panels (``DFlashDrafter.head_panels``)
    block: torch.Tensor,  # (B, Q, H) target embeddings of [anchor, mask, …]
    positions: torch.Tensor,  # (B, Q) absolute positions
    keys: list[torch.Tensor],  # per layer (B, kv_heads, C, d): context projected before
    values: list[torch.Tensor],
    lengths: torch.Tensor,  # (B,) positions of ``keys`` in use per request
    features: torch.Tensor,  # (B, N, K·H) target features of positions not projected yet
    new_positions: torch.Tensor,  # (B, N) their absolute positions
    new_lengths: torch.Tensor,  # (B,) rows of ``features`` in use per request
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A whole drafting pass in one graph: the new context positions' fusion and keys/values
    (``DFlashDrafter.context_kv``), the block's states (``draft_states``) attending to the old
    context, the new one and itself, and each mask slot's best draft-vocabulary index — every
    projection through its weight's panels, attention in fp32.

    Returns the final normed block states (B, Q, H), the draft indices (B, Q − 1) and the new
    positions' keys/values (B, layers, 2, kv_heads, N, d) for the drafter's cache."""
    b, q_len, h = block.shape
    n_new = features.shape[1]
    longest = keys[0].shape[2]
    cos, sin = drafter.rotary(positions.reshape(-1), block.dtype)  # (B·Q, d)
    c = drafter.hidden_norm(_linear(drafter.fc, features.to(block.dtype)))  # (B, N, H)
    c = c.reshape(b * n_new, h)
    c_cos, c_sin = drafter.rotary(new_positions.reshape(-1), block.dtype)  # (B·N, d)
    old_hidden = torch.arange(longest)[None, :] >= lengths[:, None]  # (B, C) padding
    new_hidden = torch.arange(n_new)[None, :] >= new_lengths[:, None]  # (B, N) padding
    hidden = torch.cat([old_hidden, new_hidden, torch.zeros(b, q_len, dtype=torch.bool)], 1)
    bias = torch.zeros(hidden.shape, dtype=block.dtype).masked_fill(hidden, float("-inf"))
    bias = bias[:, None, None]  # (B, 1, 1, L): every query of a request sees the same keys
    both_cos, both_sin = torch.cat([c_cos, cos]), torch.cat([c_sin, sin])  # (B·N + B·Q, d)
    x = block
    new_kv = []
    for li, layer in enumerate(drafter.drafter_layers):
        a = layer.self_attn
        nh, kvh, d = a.heads, a.kv_heads, a.head_dim
        assert a.qkv_panels is not None
        # the new context (no input norm, no MLP: its k/v alone are used) and the block's
        # normed states through one q|k|v projection
        rows = torch.cat([c, layer.input_layernorm(x).reshape(b * q_len, h)])  # (B·N + B·Q, H)
        qkv = gemv_kernel.panel_linear(rows, a.qkv_panels)  # (B·N + B·Q, (heads + 2 kv)·d)
        q = qkv[b * n_new :, : nh * d].reshape(b * q_len, nh, d)
        k = qkv[:, nh * d : (nh + kvh) * d].reshape(-1, kvh, d)
        v = qkv[:, (nh + kvh) * d :].reshape(-1, kvh, d)
        q = apply_rope(a.q_norm(q), cos, sin)
        k = apply_rope(a.k_norm(k), both_cos, both_sin)
        ck = k[: b * n_new].view(b, n_new, kvh, d).transpose(1, 2)  # (B, kv, N, d)
        cv = v[: b * n_new].view(b, n_new, kvh, d).transpose(1, 2)
        new_kv.append(torch.stack([ck, cv], 1))  # (B, 2, kv, N, d)
        k_blk = k[b * n_new :].view(b, q_len, kvh, d).transpose(1, 2)  # (B, kv, Q, d)
        v_blk = v[b * n_new :].view(b, q_len, kvh, d).transpose(1, 2)
        k_all = torch.cat([keys[li], ck, k_blk], 2)  # (B, kv, C + N + Q, d)
        v_all = torch.cat([values[li], cv, v_blk], 2)
        q_all = q.view(b, q_len, nh, d).transpose(1, 2)  # (B, heads, Q, d)
        # one fused attention (fp32 inside); each kv head serves its g query heads
        out = F.scaled_dot_product_attention(q_all, k_all, v_all, attn_mask=bias, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b, q_len, nh * d)  # (B, Q, heads·d)
        x = x + _linear(a.o_proj, out)
        m = layer.mlp
        assert m.gate_up_packed is not None and m.gate_up_packed.panels is not None
        gu = gemv_kernel.panel_linear(layer.post_attention_layernorm(x), m.gate_up_packed.panels)
        gate, up = gu.chunk(2, dim=-1)
        x = x + _linear(m.down_proj, F.silu(gate) * up)
    states = drafter.norm(x)  # (B, Q, H)
    logits = gemv_kernel.panel_linear(states[:, 1:], head)  # (B, Q − 1, V_d)
    # argmax in fp32: exact widening, the same index as the eager pass (first of ties)
    return states, logits.float().argmax(-1), torch.stack(new_kv, 1)


def _linear(p: Projection, x: torch.Tensor) -> torch.Tensor:
    assert p.packed is not None and p.packed.panels is not None
    return gemv_kernel.panel_linear(x, p.packed.panels)


def in_panels(drafter: DFlashDrafter) -> bool:
    """Whether every projection of the drafter's pass has its weight in panels (packed for
    serving: ``prepare_inference``)."""
    for layer in drafter.drafter_layers:
        a, m = layer.self_attn, layer.mlp
        packs = [p.packed for p in (a.o_proj, m.down_proj, drafter.fc)]
        for packed in [*packs, m.gate_up_packed]:
            if packed is None or packed.panels is None:
                return False
        if a.qkv_panels is None:
            return False
    return True


def _layout(drafter: DFlashDrafter) -> tuple:
    """What a compiled pass is specialised on besides its inputs' sizes."""
    c = drafter.cfg
    return (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.block_size)


class DraftGraph:
    """Compiled drafter passes (``draft_pass``), one per drafter layout and process
    (``shared``), built in a background thread: ``draft`` returns None until the graph for
    this call is ready, where the draft head is not in panels, and once a call failed."""

    def __init__(self) -> None:
        # one compiled function for all layouts: Dynamo keeps a graph per layout and request
        # class (one request or several) under the function's code object, guards choosing
        self._fn = torch.compile(draft_pass)
        self.ready: set[tuple] = set()  # (layout, several requests)
        self.failed: str | None = None
        self.compile_s: dict[str, float] = {}
        self.calls = 0  # passes served compiled
        self._asked: set[tuple] = set()
        self._lock = threading.Lock()

    def request(self, drafter: DFlashDrafter, background: bool = True) -> None:
        """Build the graphs for ``drafter``'s layout (once), where its weights are in panels."""
        if not in_panels(drafter):
            return
        key = _layout(drafter)
        with self._lock:
            if key in self._asked:
                return
            self._asked.add(key)
        if not background:
            self._build(drafter, key)
            return
        trace_fx_once_here()  # before the thread starts (see its docstring)
        threading.Thread(
            target=self._build, args=(drafter, key), name="draft-graph", daemon=True
        ).start()

    def _build(self, drafter: DFlashDrafter, key: tuple) -> None:
        head = _warm_head(drafter)
        with quick_gil_handoff():
            for several in (False, True):
                t0 = time.perf_counter()
                try:
                    for ctx, new in WARM_SIZES:
                        inputs = _inputs(drafter, 2 if several else 1, ctx, new)
                        self._call(drafter, head, *inputs)
                except Exception as e:  # the eager pass keeps serving
                    self.failed = f"{type(e).__name__}: {e}"
                    log.warning("compiling the drafter pass failed; eager serves: %s", e)
                    return
                name = "several requests" if several else "one request"
                self.compile_s[name] = round(time.perf_counter() - t0, 1)
                self.ready.add((key, several))
                log.info("compiled the drafter pass (%s) in %.1f s", name, self.compile_s[name])

    def _call(
        self,
        drafter: DFlashDrafter,
        head: torch.Tensor,
        block: torch.Tensor,
        positions: torch.Tensor,
        ctx: BatchedContext,
        new: NewContext,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            return self._fn(
                drafter,
                head,
                block,
                positions,
                ctx.keys,
                ctx.values,
                ctx.lengths,
                new.features,
                new.positions,
                new.lengths,
            )

    def draft(
        self,
        drafter: DFlashDrafter,
        head: torch.Tensor | None,  # the draft head's panels, None where it has none
        block: torch.Tensor,  # (B, Q, H)
        positions: torch.Tensor,  # (B, Q)
        ctx: BatchedContext,  # at least 2 positions (``min_length``)
        new: NewContext,  # at least 2 rows
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``draft_pass`` through the compiled graph: states (B, Q, H), draft indices
        (B, Q − 1), new keys/values (B, layers, 2, kv, N, d); or None: not ready for this call
        (the caller runs the eager pass), or failed."""
        key = (_layout(drafter), block.shape[0] > 1)
        if self.failed is not None or key not in self.ready or head is None:
            return None
        if not in_panels(drafter):
            return None
        try:
            out = self._call(drafter, head, block, positions, ctx, new)
        except Exception as e:  # dropped for good: nothing was written, the eager pass serves
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("the compiled drafter pass failed; eager serves from now: %s", e)
            return None
        self.calls += 1
        return out


def _warm_head(drafter: DFlashDrafter) -> torch.Tensor:
    """Panels of a zero draft head as large as ``drafter``'s draft vocabulary (the head's rows
    are the graph's input: any vocabulary size runs on it)."""
    rows = torch.zeros(drafter.draft_vocab_size, drafter.cfg.hidden_size, dtype=drafter.dtype)
    panels = gemv_kernel.pack_panels(rows)
    assert panels is not None, "the drafter's weights are in panels, so is its head's shape"
    torch._dynamo.mark_dynamic(panels, 0)
    return panels


def _inputs(
    drafter: DFlashDrafter, requests: int, context: int, new: int
) -> tuple[torch.Tensor, torch.Tensor, BatchedContext, NewContext]:
    """Zero inputs of a pass of ``requests`` over ``context`` projected and ``new`` new
    positions, built as the engine builds them (``BatchedContext.stack``,
    ``NewContext.stack``), with the dims that vary marked dynamic: both lengths and, for
    several requests, their count."""
    from adaflash.models.drafter import BatchedContext, NewContext

    c = drafter.cfg
    q, dt = c.block_size, drafter.dtype
    with torch.inference_mode():  # as the engine's: every input an inference tensor (guarded)
        kv = [torch.zeros(c.num_kv_heads, context, c.head_dim, dtype=dt) for _ in range(2)]
        feats = torch.zeros(new, drafter.fc.in_features, dtype=dt)
        per_request = [
            [(kv[0][:, : context - i], kv[1][:, : context - i])] * c.num_layers
            for i in range(requests)
        ]
        ctx = BatchedContext.stack(per_request)
        fresh = NewContext.stack([(feats[: new - i], context - i) for i in range(requests)])
        block = torch.zeros(requests, q, c.hidden_size, dtype=dt)
        positions = (torch.arange(q)[None].expand(requests, -1) + context).contiguous()
    for t in [*ctx.keys, *ctx.values]:
        torch._dynamo.mark_dynamic(t, 2)
    for t in (fresh.features, fresh.positions):
        torch._dynamo.mark_dynamic(t, 1)
    if requests > 1:
        batched = [*ctx.keys, *ctx.values, ctx.lengths, block, positions]
        for t in [*batched, fresh.features, fresh.positions, fresh.lengths]:
            torch._dynamo.mark_dynamic(t, 0)
    return block, positions, ctx, fresh


_shared: DraftGraph | None = None


def shared() -> DraftGraph:
    """The process's compiled drafter passes (engines and versions of one layout share them)."""
    global _shared
    if _shared is None:
        _shared = DraftGraph()
    return _shared


def compile_now(drafter: DFlashDrafter, dtype: torch.dtype) -> dict[str, float]:
    """Build, in the foreground, the graphs an engine serving ``drafter`` in ``dtype`` builds in
    the background (before a benchmark times anything); seconds per graph (none where the pass
    does not serve compiled). Raises if one failed."""
    import copy

    served = copy.deepcopy(drafter).to(dtype=dtype).eval().requires_grad_(False)
    served.prepare_inference()
    if not in_panels(served):
        return {}
    graph = shared()
    graph.request(served, background=False)
    if graph.failed:
        raise RuntimeError(f"compiling the drafter pass failed: {graph.failed}")
    return dict(graph.compile_s)
