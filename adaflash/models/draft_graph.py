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
    from adaflash.models.drafter import BatchedContext, DFlashDrafter

log = logging.getLogger(__name__)

WARM_CONTEXT = (24, 40)  # context lengths each graph is run at when built (the dim is dynamic)


def block_states(
    drafter: DFlashDrafter,
    block: torch.Tensor,  # (B, Q, H) target embeddings of [anchor, mask, …]
    positions: torch.Tensor,  # (B, Q) absolute positions
    keys: list[torch.Tensor],  # per layer (B, kv_heads, C, d), padded to the longest context
    values: list[torch.Tensor],
    lengths: torch.Tensor,  # (B,) each request's context length
) -> torch.Tensor:
    """``DFlashDrafter.draft_states`` written for the compiler: the same math, every projection
    through its weight's panels, attention in fp32 (two matmuls over the context and the block,
    the padding keys masked); the final normed block states (B, Q, H)."""
    b, q_len, h = block.shape
    longest = keys[0].shape[2]
    cos, sin = drafter.rotary(positions.reshape(-1), block.dtype)  # (B·Q, d)
    hidden = torch.arange(longest)[None, :] >= lengths[:, None]  # (B, C) padding
    ctx_bias = torch.zeros(b, longest).masked_fill(hidden, float("-inf"))
    bias = torch.cat([ctx_bias, torch.zeros(b, q_len)], 1)[:, None, None, None]  # (B,1,1,1,L)
    x = block
    for li, layer in enumerate(drafter.drafter_layers):
        a = layer.self_attn
        nh, kvh, d = a.heads, a.kv_heads, a.head_dim
        g = nh // kvh
        flat = layer.input_layernorm(x).reshape(b * q_len, h)  # (B·Q, H)
        q = apply_rope(a.q_norm(_linear(a.q_proj, flat).view(b * q_len, nh, d)), cos, sin)
        k = apply_rope(a.k_norm(_linear(a.k_proj, flat).view(b * q_len, kvh, d)), cos, sin)
        v = _linear(a.v_proj, flat).view(b * q_len, kvh, d)
        k_all = torch.cat([keys[li], k.view(b, q_len, kvh, d).transpose(1, 2)], 2).float()
        v_all = torch.cat([values[li], v.view(b, q_len, kvh, d).transpose(1, 2)], 2).float()
        qg = q.view(b, q_len, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * q_len, d)
        scores = torch.matmul(qg.float(), k_all.transpose(-1, -2))  # (B, kv, g·Q, L)
        scores = scores.view(b, kvh, g, q_len, -1) * d**-0.5 + bias
        probs = torch.softmax(scores, dim=-1).view(b, kvh, g * q_len, -1)
        out = torch.matmul(probs, v_all).view(b, kvh, g, q_len, d)  # (B, kv, g, Q, d)
        out = out.permute(0, 3, 1, 2, 4).reshape(b, q_len, nh * d).to(x.dtype)
        x = x + _linear(a.o_proj, out)
        m = layer.mlp
        assert m.gate_up_packed is not None and m.gate_up_packed.panels is not None
        gu = gemv_kernel.panel_linear(layer.post_attention_layernorm(x), m.gate_up_packed.panels)
        gate, up = gu.chunk(2, dim=-1)
        x = x + _linear(m.down_proj, F.silu(gate) * up)
    return drafter.norm(x)


def _linear(p: Projection, x: torch.Tensor) -> torch.Tensor:
    assert p.packed is not None and p.packed.panels is not None
    return gemv_kernel.panel_linear(x, p.packed.panels)


def in_panels(drafter: DFlashDrafter) -> bool:
    """Whether every projection of the drafter's pass has its weight in panels (packed for
    serving: ``prepare_inference``)."""
    for layer in drafter.drafter_layers:
        a, m = layer.self_attn, layer.mlp
        packs = [p.packed for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.down_proj)]
        for packed in [*packs, m.gate_up_packed]:
            if packed is None or packed.panels is None:
                return False
    return True


def _layout(drafter: DFlashDrafter) -> tuple:
    """What a compiled pass is specialised on besides its inputs' sizes."""
    c = drafter.cfg
    return (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.block_size)


class DraftGraph:
    """Compiled drafter passes, one per drafter layout and process (``shared``), built in a
    background thread: ``states`` returns None until the graph for this call is ready, for a
    context of one position (its size would be specialised) and once a call failed."""

    def __init__(self) -> None:
        # one compiled function for all layouts: Dynamo keeps a graph per layout and request
        # class (one request or several) under the function's code object, guards choosing
        self._fn = torch.compile(block_states)
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
        with quick_gil_handoff():
            for several in (False, True):
                t0 = time.perf_counter()
                try:
                    for ctx in WARM_CONTEXT:
                        self._call(drafter, *_inputs(drafter, 2 if several else 1, ctx))
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
        block: torch.Tensor,
        positions: torch.Tensor,
        ctx: BatchedContext,
    ) -> torch.Tensor:
        with torch.inference_mode():
            return self._fn(drafter, block, positions, ctx.keys, ctx.values, ctx.lengths)

    def states(
        self,
        drafter: DFlashDrafter,
        block: torch.Tensor,  # (B, Q, H)
        positions: torch.Tensor,  # (B, Q)
        ctx: BatchedContext,
    ) -> torch.Tensor | None:
        """The block states (B, Q, H) through the compiled pass, or None: not ready for this
        call (the caller runs the eager pass), or failed."""
        key = (_layout(drafter), block.shape[0] > 1)
        if self.failed is not None or key not in self.ready or ctx.keys[0].shape[2] < 2:
            return None
        if not in_panels(drafter):
            return None
        try:
            out = self._call(drafter, block, positions, ctx)
        except Exception as e:  # dropped for good: nothing was written, the eager pass serves
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("the compiled drafter pass failed; eager serves from now: %s", e)
            return None
        self.calls += 1
        return out


def _inputs(
    drafter: DFlashDrafter, requests: int, context: int
) -> tuple[torch.Tensor, torch.Tensor, BatchedContext]:
    """Zero inputs of a pass of ``requests`` over ``context`` positions, built as the engine
    builds them (``BatchedContext.stack`` of per-request keys/values), with the dims that vary
    marked dynamic: context length and, for several requests, their count."""
    from adaflash.models.drafter import BatchedContext

    c = drafter.cfg
    q, dt = c.block_size, drafter.dtype
    with torch.inference_mode():
        kv = [torch.zeros(c.num_kv_heads, context, c.head_dim, dtype=dt) for _ in range(2)]
    per_request = [
        [(kv[0][:, : context - i], kv[1][:, : context - i])] * c.num_layers for i in range(requests)
    ]
    ctx = BatchedContext.stack(per_request)
    with torch.inference_mode():  # as the engine's: the target's embeddings (a guard checks)
        block = torch.zeros(requests, q, c.hidden_size, dtype=dt)
    positions = torch.arange(q)[None].expand(requests, -1) + context
    for t in [*ctx.keys, *ctx.values]:
        torch._dynamo.mark_dynamic(t, 2)
        if requests > 1:
            torch._dynamo.mark_dynamic(t, 0)
    if requests > 1:
        for t in (block, positions, ctx.lengths):
            torch._dynamo.mark_dynamic(t, 0)
    return block, positions.contiguous(), ctx


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
