"""A single request's target step as one compiled graph: inductor, weights frozen, a C++ wrapper.

At batch 1 a decode step is 121 GEMVs with ~2,500 small PyTorch ops around them, and on a CPU
the ops between the GEMVs cost about as much as the GEMVs (measured on this project's machine,
2 threads: 25.7 ms a step, 13.6 of them GEMVs). Compiled, the step runs as generated C++ with
fused elementwise kernels and prepacked weights, no Python between ops, and GEMMs autotuned
against inductor's own C++ GEMV template (12.7 ms a step, docs/results/engine/).

The graph reads the request's past keys/values straight from its KV-pool row — a block
``(layers, 2, kv_heads, capacity, d)`` whose strides depend only on the capacity, marked dynamic,
so one compile serves every capacity — and returns the new tokens' keys/values for the caller to
write. Attention splits in two under one softmax: the past (positions < pos) and the new tokens
(causal among them). Same math as ``TargetModel.forward``; the fp32 exactness tests run it
against HF ``generate``.

Graphs are keyed by the captured layers — none for plain decoding, the drafter's for speculative
serving (its plain steps keep the drafter's context) — and by one token (decode) or a few
(verification, up to ``MAX_TOKENS``, the count dynamic). Compiling one took 83–134 s here, in a
background thread: until it is ready, and wherever it fails, the eager step serves.
``ADAFLASH_COMPILE=0`` or ``serve --no-compile`` switches it off.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from adaflash.models.layers import apply_rope

if TYPE_CHECKING:
    from adaflash.models.kv_cache import KVCache
    from adaflash.models.target import DecoderLayer, TargetModel

log = logging.getLogger(__name__)

Key = tuple[tuple[int, ...], bool]  # (captured layers, several new tokens)


def compile_enabled() -> bool:
    return os.environ.get("ADAFLASH_COMPILE", "1") != "0"


def options(device: torch.device) -> dict[str, object]:
    """Inductor settings: weights frozen (constants, prepacked), a C++ wrapper, and on a CPU
    the GEMMs autotuned between ATen/oneDNN and inductor's own C++ micro-kernel template — the
    template's AVX-512 GEMV measured ~1.8× faster than oneDNN's on all 120 per-layer projections
    at batch 1 (``ADAFLASH_AUTOTUNE=0``: oneDNN only, a shorter compile)."""
    opts: dict[str, object] = {"freezing": True}
    if device.type == "cpu":
        opts["cpp_wrapper"] = True
        if os.environ.get("ADAFLASH_AUTOTUNE", "1") != "0":
            opts |= {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
    return opts


class DecodeStep(nn.Module):
    """The target's step for one request and one token, written for the compiler. Shares the
    target's weights (fused q|k|v and gate|up where the target fused them)."""

    def __init__(self, target: TargetModel, capture: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.target, self.capture = target, capture
        self.qkv = nn.ParameterList()
        self.gate_up = nn.ParameterList()
        for layer in cast("list[DecoderLayer]", target.layers):
            a, m = layer.self_attn, layer.mlp
            qkv = (
                a.qkv
                if a.qkv is not None
                else torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            )
            gu = (
                m.gate_up
                if m.gate_up is not None
                else torch.cat([m.gate_proj.weight, m.up_proj.weight])
            )
            self.qkv.append(nn.Parameter(qkv.detach(), requires_grad=False))
            self.gate_up.append(nn.Parameter(gu.detach(), requires_grad=False))

    def forward(
        self,
        ids: torch.Tensor,  # (T,) new tokens of one request (decode: 1; verify: k̂)
        pos: torch.Tensor,  # (1,) position of the first = the request's committed length
        past: torch.Tensor,  # (layers, 2, kv_heads, capacity, d) the request's pool row
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        t = self.target
        n, cap = ids.shape[0], past.shape[3]
        x = t.embed_tokens(ids)  # (T, H)
        cos, sin = t.rotary(pos + torch.arange(n, device=ids.device), x.dtype)  # (T, d)
        hidden = (torch.arange(cap, device=ids.device) >= pos)[None, None, None, :]  # past ≥ pos
        ahead = torch.ones(n, n, dtype=torch.bool, device=ids.device).triu(1)  # (T, T) j > i
        new_kv, captured = [], {}
        for i, layer in enumerate(cast("list[DecoderLayer]", t.layers)):
            a, m = layer.self_attn, layer.mlp
            nh, kvh, d = a.heads, a.kv_heads, a.head_dim
            g = nh // kvh
            qkv = F.linear(layer.input_layernorm(x), self.qkv[i], a.qkv_bias)
            q, k, v = qkv.split([nh * d, kvh * d, kvh * d], dim=-1)
            q, k, v = q.view(n, nh, d), k.view(n, kvh, d), v.view(n, kvh, d)
            if a.q_norm is not None and a.k_norm is not None:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            new_kv.append(torch.stack([k, v]))  # (2, T, kv_heads, d)
            # attention in fp32: the past (masked to < pos) and the new tokens (causal), one softmax
            qg = q.view(n, kvh, g, d).permute(1, 2, 0, 3).float() * d**-0.5  # (kvh, g, T, d)
            kn = k.permute(1, 0, 2)[:, None].float()  # (kvh, 1, T, d)
            vn = v.permute(1, 0, 2)[:, None].float()
            keys, values = past[i, 0, :, None].float(), past[i, 1, :, None].float()  # (kvh,1,cap,d)
            s_past = torch.matmul(qg, keys.transpose(-1, -2)).masked_fill(hidden, float("-inf"))
            s_new = torch.matmul(qg, kn.transpose(-1, -2)).masked_fill(ahead, float("-inf"))
            p = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)  # (kvh, g, T, cap + T)
            o = torch.matmul(p[..., :cap], values) + torch.matmul(p[..., cap:], vn)  # (kvh,g,T,d)
            o = o.permute(2, 0, 1, 3).reshape(n, nh * d).to(x.dtype)
            x = x + F.linear(o, a.o_proj.weight, a.o_proj.bias)
            h = layer.post_attention_layernorm(x)
            gate, up = F.linear(h, self.gate_up[i], m.gate_up_bias).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, m.down_proj.weight, m.down_proj.bias)
            if i in self.capture:
                captured[i] = x
        logits = F.linear(t.norm(x), t.lm_head.weight).float()  # (T, V)
        features = torch.cat([captured[i] for i in self.capture], -1) if self.capture else None
        # (T, V), (layers, 2, T, kv_heads, d), (T, K·H)
        return logits, torch.stack(new_kv), features


# new tokens a compiled step takes; more run eager. With the token count dynamic the graph's
# GEMMs lose to the eager packed ones beyond a few rows (docs/results/engine/bench_engine.json,
# batch 1, one thread: 4 tokens 29.8 ms compiled vs 40.0 eager, 8 tokens 63.5 vs 50.2, 16 tokens
# 92.0 vs 52.4), so verification of up to 4 tokens runs compiled.
MAX_TOKENS = 4


class DecodeGraph:
    """Compiled ``DecodeStep``s, compiled one after another in a background thread. A graph is
    keyed by the layers it captures (none for plain decoding; the drafter's for speculative
    serving) and by whether it takes one token (decode) or several (verification, T dynamic)."""

    def __init__(self, target: TargetModel) -> None:
        self.target = target
        self.graphs: dict[Key, Callable[..., tuple]] = {}
        self.failed: dict[Key, str] = {}
        self.compile_s: dict[Key, float] = {}
        self._fns: dict[tuple[int, ...], Callable[..., tuple]] = {}
        self._asked: set[Key] = set()
        self._queue: queue.SimpleQueue[Key] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.steps = 0  # steps served compiled
        self.tokens = 0  # their new tokens (more than steps: verification ran compiled)

    def request(
        self, capture: tuple[int, ...] = (), multi: bool = False, background: bool = True
    ) -> None:
        """Compile the one-token step that captures ``capture`` and, with ``multi``, the
        several-token one (once each): in the background thread, or here."""
        keys = [(tuple(capture), False)] + ([(tuple(capture), True)] if multi else [])
        for key in keys:
            if key in self._asked:
                continue
            self._asked.add(key)
            if not background:
                self._compile(key)
                continue
            self._queue.put(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="decode-graph", daemon=True)
                self._thread.start()

    def ready(self, capture: tuple[int, ...] = (), tokens: int = 1) -> bool:
        return (tuple(capture), tokens > 1) in self.graphs and tokens <= MAX_TOKENS

    def status(self) -> str:
        """'ready', 'compiling', 'failed' or 'off' (for /metrics)."""
        if self.failed:
            return "failed"
        if self._asked and self._asked <= set(self.graphs):
            return "ready"
        return "compiling" if self._asked else "off"

    def _work(self) -> None:
        while True:
            self._compile(self._queue.get())

    def _compile(self, key: Key) -> None:
        import torch._inductor.config as inductor

        capture, multi = key
        t0 = time.perf_counter()
        try:
            if capture not in self._fns:
                step = DecodeStep(self.target, capture).eval()
                self._fns[capture] = torch.compile(step, fullgraph=True)
            fn = self._fns[capture]
            c, dev = self.target.cfg, self.target.device
            with inductor.patch(options(dev)):
                # two capacities (and token counts) check that the dynamic dims hold
                for cap, n in ((24, 3), (40, 5)) if multi else ((24, 1), (40, 1)):
                    with torch.inference_mode():  # an inference tensor, like the pool (KVCache)
                        past = torch.zeros(
                            (c.num_layers, 2, c.num_kv_heads, cap, c.head_dim),
                            dtype=self.target.dtype,
                            device=dev,
                        )
                    ids = torch.zeros(n, dtype=torch.long, device=dev)
                    torch._dynamo.mark_dynamic(past, 3)  # one graph for every capacity
                    if multi:
                        torch._dynamo.mark_dynamic(ids, 0)  # … and every token count ≥ 2
                    with torch.no_grad():  # as served (see ``step``)
                        fn(ids, torch.tensor([cap // 2], device=dev), past)
            self.graphs[key] = fn
            self.compile_s[key] = time.perf_counter() - t0
            log.info("compiled the single-request step %s in %.1f s", key, self.compile_s[key])
        except Exception as e:  # the eager step keeps serving
            self.failed[key] = f"{type(e).__name__}: {e}"
            log.warning("compiling the single-request step failed; eager serves: %s", e)

    def step(
        self, ids: torch.Tensor, slot: int, cache: KVCache, capture: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The new tokens (T,) of ``slot``: writes their keys/values; returns logits (T, V)
        fp32 and the captured features (T, K·H) or None."""
        n = ids.shape[0]
        fn = self.graphs[(tuple(capture), n > 1)]
        cache.reserve(slot, n)
        row, pos = cache.row(slot), cache.length(slot)
        past = cache.data[row]  # (layers, 2, kv_heads, capacity, d) view
        # called as compiled: under no_grad, outside inference mode (in inference mode the
        # graph is another one, without prepacked weights: 1.5× slower, measured)
        with torch.inference_mode(False), torch.no_grad():
            logits, new_kv, features = fn(
                ids.to(self.target.device), torch.tensor([pos], device=self.target.device), past
            )
        with torch.inference_mode():  # the pool is an inference tensor
            cache.data[row, :, :, :, pos : pos + n] = new_kv.transpose(2, 3)
        cache.advance(slot, n)
        self.steps += 1
        self.tokens += n
        return logits, features


def compile_now(target: TargetModel, captures: list[tuple[int, ...]]) -> dict[str, float]:
    """Build, in the foreground, the graphs ``serve`` builds in the background for these
    captured-layer sets (plain decoding for ``()``; decode and verification for a drafter's),
    before a benchmark times anything; seconds per graph, by a readable name. Raises if one
    failed."""
    graph = None
    for capture in captures:
        graph = target.compile_decode(capture, multi=bool(capture), background=False)
        if not graph.ready(capture):
            raise RuntimeError(f"compiling the decode step failed: {graph.failed}")
    if graph is None:
        return {}
    return {
        f"{list(c)}{' verify' if multi else ''}": round(t, 1)
        for (c, multi), t in graph.compile_s.items()
    }
