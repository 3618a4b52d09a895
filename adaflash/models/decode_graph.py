"""A batch-1 decode step as one compiled graph: inductor, weights frozen, a C++ wrapper.

At batch 1 a decode step is 121 GEMVs with ~2,500 small PyTorch ops around them, and on a CPU
the ops between the GEMVs cost about as much as the GEMVs (measured on this project's machine,
2 threads: 25.7 ms a step, 13.6 of them GEMVs). Compiled, the step runs as generated C++ with
fused elementwise kernels and prepacked weights, and no Python between ops.

The graph reads one request's past keys/values straight from its KV-pool row — a block
``(layers, 2, kv_heads, capacity, d)`` whose strides depend only on the capacity, marked dynamic,
so one compile serves every capacity — and returns the new token's keys/values for the caller to
write. Attention splits in two under one softmax: the past (positions < pos) and the token itself.
Same math as ``TargetModel.forward``; the fp32 exactness tests run it against HF ``generate``.

One graph per set of captured layers: none for plain decoding, the drafter's for speculative
serving (its plain steps keep the drafter's context). Compiling one takes about 70 s on this CPU
(once per process; inductor's on-disk cache shortens later starts) in a background thread:
until it is ready, and wherever it fails, the eager step serves. ``ADAFLASH_COMPILE=0`` or
``--no-compile`` switches it off.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from adaflash.models.layers import apply_rope

if TYPE_CHECKING:
    from adaflash.models.kv_cache import KVCache
    from adaflash.models.target import TargetModel

log = logging.getLogger(__name__)


def compile_enabled() -> bool:
    return os.environ.get("ADAFLASH_COMPILE", "1") != "0"


class DecodeStep(nn.Module):
    """The target's step for one request and one token, written for the compiler. Shares the
    target's weights (fused q|k|v and gate|up where the target fused them)."""

    def __init__(self, target: TargetModel, capture: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.target, self.capture = target, capture
        self.qkv = nn.ParameterList()
        self.gate_up = nn.ParameterList()
        for layer in target.layers:
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
        ids: torch.Tensor,  # (1,)
        pos: torch.Tensor,  # (1,) the token's position = the request's committed length
        past: torch.Tensor,  # (layers, 2, kv_heads, capacity, d) the request's pool row
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        t = self.target
        cap = past.shape[3]
        x = t.embed_tokens(ids)  # (1, H)
        cos, sin = t.rotary(pos, x.dtype)  # (1, d)
        hidden = (torch.arange(cap, device=ids.device) >= pos)[None, None, :]  # (1, 1, cap)
        new_kv, captured = [], {}
        for i, layer in enumerate(t.layers):
            a, m = layer.self_attn, layer.mlp
            nh, kvh, d = a.heads, a.kv_heads, a.head_dim
            g = nh // kvh
            qkv = F.linear(layer.input_layernorm(x), self.qkv[i], a.qkv_bias)
            q, k, v = qkv.split([nh * d, kvh * d, kvh * d], dim=-1)
            q, k, v = q.view(1, nh, d), k.view(1, kvh, d), v.view(1, kvh, d)
            if a.q_norm is not None and a.k_norm is not None:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            new_kv.append(torch.stack([k[0], v[0]]))  # (2, kv_heads, d)
            # attention in fp32: the past (masked) and the token itself, one softmax
            qg = q.view(kvh, g, d).float() * d**-0.5  # (kv_heads, g, d)
            keys, values = past[i, 0].float(), past[i, 1].float()  # (kv_heads, cap, d)
            s_past = torch.matmul(qg, keys.transpose(-1, -2)).masked_fill(hidden, float("-inf"))
            s_self = (qg * k.view(kvh, 1, d).float()).sum(-1, keepdim=True)  # (kv_heads, g, 1)
            p = torch.softmax(torch.cat([s_past, s_self], dim=-1), dim=-1)  # (kv_heads, g, cap+1)
            o = torch.matmul(p[..., :cap], values) + p[..., cap:] * v.view(kvh, 1, d).float()
            attn = F.linear(o.reshape(1, nh * d).to(x.dtype), a.o_proj.weight, a.o_proj.bias)
            x = x + attn
            h = layer.post_attention_layernorm(x)
            gate, up = F.linear(h, self.gate_up[i], m.gate_up_bias).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, m.down_proj.weight, m.down_proj.bias)
            if i in self.capture:
                captured[i] = x
        logits = F.linear(t.norm(x), t.lm_head.weight).float()  # (1, V)
        features = torch.cat([captured[i] for i in self.capture], -1) if self.capture else None
        return logits, torch.stack(new_kv), features  # (1, V), (layers, 2, kv_heads, d), (1, K·H)


class DecodeGraph:
    """Compiled ``DecodeStep``s, one per set of captured layers (none for plain decoding; the
    drafter's for speculative serving), compiled one after another in a background thread."""

    def __init__(self, target: TargetModel) -> None:
        self.target = target
        self.graphs: dict[tuple[int, ...], Callable[..., tuple]] = {}
        self.failed: dict[tuple[int, ...], str] = {}
        self.compile_s: dict[tuple[int, ...], float] = {}
        self._asked: set[tuple[int, ...]] = set()
        self._queue: queue.SimpleQueue[tuple[int, ...]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.steps = 0  # decode steps served compiled

    def request(self, capture: tuple[int, ...] = (), background: bool = True) -> None:
        """Compile the step that captures ``capture`` (once): in the background thread, or here
        when ``background`` is False."""
        capture = tuple(capture)
        if capture in self._asked:
            return
        self._asked.add(capture)
        if not background:
            self._compile(capture)
            return
        self._queue.put(capture)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="decode-graph", daemon=True)
            self._thread.start()

    def ready(self, capture: tuple[int, ...] = ()) -> bool:
        return tuple(capture) in self.graphs

    def wait(self, capture: tuple[int, ...] = (), timeout: float = 600.0) -> bool:
        """Block until ``capture``'s graph is compiled or failed (for benchmarks and tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if capture in self.graphs or capture in self.failed:
                break
            time.sleep(0.05)
        return self.ready(capture)

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

    def _compile(self, capture: tuple[int, ...]) -> None:
        import torch._inductor.config as inductor

        t0 = time.perf_counter()
        try:
            fn = torch.compile(DecodeStep(self.target, capture).eval(), fullgraph=True)
            c = self.target.cfg
            with inductor.patch(freezing=True, cpp_wrapper=self.target.device.type == "cpu"):
                for cap in (24, 40):  # a second capacity checks that the dynamic dim holds
                    with torch.inference_mode():  # an inference tensor, like the pool (KVCache)
                        past = torch.zeros(
                            (c.num_layers, 2, c.num_kv_heads, cap, c.head_dim),
                            dtype=self.target.dtype,
                            device=self.target.device,
                        )
                    torch._dynamo.mark_dynamic(past, 3)  # one graph for every capacity
                    with torch.no_grad():  # as served (see ``step``)
                        fn(torch.zeros(1, dtype=torch.long), torch.tensor([cap // 2]), past)
            self.graphs[capture] = fn
            self.compile_s[capture] = time.perf_counter() - t0
            log.info(
                "compiled the batch-1 decode step %s in %.1f s", capture, self.compile_s[capture]
            )
        except Exception as e:  # the eager step keeps serving
            self.failed[capture] = f"{type(e).__name__}: {e}"
            log.warning("compiling the decode step failed; the eager step serves: %s", e)

    def step(
        self, ids: torch.Tensor, slot: int, cache: KVCache, capture: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token for ``slot``: writes its keys/values; returns logits (1, V) fp32 and the
        captured features (1, K·H) or None."""
        fn = self.graphs[tuple(capture)]
        cache.reserve(slot, 1)
        row, pos = cache.row(slot), cache.length(slot)
        past = cache.data[row]  # (layers, 2, kv_heads, capacity, d) view
        # called as compiled: under no_grad, outside inference mode (in inference mode the
        # graph is another one, without prepacked weights: 1.5× slower, measured)
        with torch.inference_mode(False), torch.no_grad():
            logits, new_kv, features = fn(
                ids.to(self.target.device), torch.tensor([pos], device=self.target.device), past
            )
        with torch.inference_mode():  # the pool is an inference tensor
            cache.data[row, :, :, :, pos] = new_kv
        cache.advance(slot, 1)
        self.steps += 1
        return logits, features
