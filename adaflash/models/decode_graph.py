"""The target's decode step as one compiled graph: inductor, weights frozen, a C++ wrapper.

At batch 1 a decode step is 121 GEMVs with ~2,500 small PyTorch ops around them, and on a CPU
the ops between the GEMVs cost about as much as the GEMVs (measured on this project's machine,
2 threads: 25.7 ms a step, 13.6 of them GEMVs). Compiled, the step runs as generated C++ with
fused elementwise kernels and prepacked weights, no Python between ops, and GEMMs autotuned
against inductor's own C++ GEMV template where that wins (12.7 ms a step, docs/results/engine/),
or with the one-row projections through our GEMV kernel (``Route``: where the choice differs
between CPUs, the first graph is built each way, timed, and the choice remembered per machine).

The graph reads the request's past keys/values straight from its KV-pool row — a block
``(layers, 2, kv_heads, capacity, d)`` whose strides depend only on the capacity, marked dynamic,
so one compile serves every capacity — and returns the new tokens' keys/values for the caller to
write. Attention splits in two under one softmax: the past (positions < pos) and the new tokens
(causal among them). Same math as ``TargetModel.forward``; the fp32 exactness tests run it
against HF ``generate``. Where the C++ kernels built, attention is one call of their op per layer
(``gemv.attention``), which reads only the positions in use; elsewhere (``_Step.attend``) inductor
decomposes it over the whole capacity, masked, with one horizontal sum per position: a batch-1
step with 200 positions in use took 12.2 vs 15.2 ms in a 1024-position pool, level within the
noise in a 256-position one (13.4 vs 13.6 ms; Zen 4 EPYC, 2 threads, template route, interleaved).

Several requests decoding together (one token each) take a batched graph: the same layers over
B rows, each reading its own row of the whole pool (pool rows and capacity dynamic, B static —
the C++ GEMM template tunes for a fixed row count), padded up to the next compiled size. On a CPU
without native bf16 its GEMMs widen the bf16 weights in registers, where the eager step streams
fp32 copies (``models/layers.py``): 52 ms for a step of 8 requests against 114 ms eager (AVX-512
Xeon, 2 threads, quiet).

One request verifying several tokens takes a graph of a static width (``verify_widths``:
4, 8 and 16 by default), padded up to the next one: the pads come after the real tokens, so the
causal mask keeps them out of the real tokens' outputs, and their keys/values are dropped. A
static width lets the GEMMs tune for their row count; with the count dynamic they lost to the
eager step beyond 4 tokens (AMX Xeon, one thread: 16 tokens 92 ms compiled vs 52 ms eager). On
a CPU without native bf16, graphs of 8 tokens or more multiply with fp32 copies of the weights
(``widen``): 16 tokens 56.7 ms instead of 121.8 (AVX2 AMD EPYC, 2 threads).

Several requests verifying together take a batched graph of a static width too
(``batch_verify_widths``: 4 by default, one per batch size): each request's tokens are padded
after its last, the batch with copies of the first request, and the pads' outputs and
keys/values are dropped. Without them every pass of two or more drafting requests ran eager,
while plain decoding of the same requests ran compiled. Where bf16 is not native they are built
only where the GEMV kernel takes all their rows (elsewhere the graph's bf16 GEMMs crawl).

Graphs are keyed by the captured layers — none for plain decoding, the drafter's for speculative
serving (its plain steps keep the drafter's context) — by the new tokens per request (1: decode,
or a verification width) and by the request count (1, or a batch size of ``batch_sizes``).
Compiling one took 60–430 s on the machines here, in a background thread: until it is ready,
and wherever it fails, the eager step serves. ``ADAFLASH_COMPILE=0`` or ``serve --no-compile``
switches them all off, ``ADAFLASH_BATCH_GRAPHS=0`` the batched ones, ``ADAFLASH_VERIFY_GRAPHS=0``
the one-request verification ones, ``ADAFLASH_BATCH_VERIFY_GRAPHS=0`` the batched verification
ones.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import queue
import statistics
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from adaflash.cost_model import batched_verification, verification_width
from adaflash.hardware import cpu_flags, cpu_info, cpuinfo, native_bf16
from adaflash.models import gemv as gemv_kernel
from adaflash.models.layers import apply_rope
from adaflash.paths import write_text_atomic
from adaflash.pull import cache_dir

if TYPE_CHECKING:
    from adaflash.models.drafter import DFlashDrafter
    from adaflash.models.kv_cache import KVCache
    from adaflash.models.layers import Packed
    from adaflash.models.target import DecoderLayer, PackedBatch, TargetModel

log = logging.getLogger(__name__)

Key = tuple[tuple[int, ...], int, int]  # (captured layers, new tokens per request, requests)


def _sizes(variable: str, default: str) -> list[int]:
    """The sizes ≥ 2 listed in ``variable`` (comma-separated; ``0`` or empty: none), sorted."""
    raw = os.environ.get(variable, default).strip()
    return sorted({int(x) for x in raw.split(",") if x.strip()} - {0, 1}) if raw else []


def verify_widths() -> tuple[int, ...]:
    """The verification widths compiled for one request, from ``ADAFLASH_VERIFY_GRAPHS``
    (default 4,8,16; ``0`` or empty: none): verifying n ≥ 2 tokens runs on the smallest
    width ≥ n, padded; more than the largest run eager."""
    return tuple(_sizes("ADAFLASH_VERIFY_GRAPHS", "4,8,16"))


def batch_verify_widths() -> tuple[int, ...]:
    """The verification widths compiled for several requests at once, from
    ``ADAFLASH_BATCH_VERIFY_GRAPHS`` (default 4; ``0`` or empty: none): a verification pass of
    n ≥ 2 requests, each of at most w tokens, runs on the smallest batch size ≥ n and width
    ≥ every request's tokens, padded (one graph per batch size and width)."""
    return tuple(_sizes("ADAFLASH_BATCH_VERIFY_GRAPHS", "4"))


def batch_sizes(max_requests: int) -> tuple[int, ...]:
    """The batched decode steps worth compiling for an engine of ``max_requests`` requests,
    from ``ADAFLASH_BATCH_GRAPHS`` (default 4,8,16; ``0`` or empty: none): a decode step of
    n ≥ 2 requests runs on the smallest size ≥ n, padded. Sizes are static because the C++
    GEMM template tunes for a fixed row count."""
    sizes = _sizes("ADAFLASH_BATCH_GRAPHS", "4,8,16")
    # each size serves the counts above the one before it: keep those an engine can reach
    return tuple(
        b
        for i, b in enumerate(sizes)
        if max_requests > 1 and (i == 0 or sizes[i - 1] < max_requests)
    )


def widen(dtype: torch.dtype, tokens: int) -> bool:
    """Whether a one-request graph of ``tokens`` new tokens multiplies with fp32 copies of bf16
    weights: on a CPU without native bf16, from ``ADAFLASH_WIDEN_TOKENS`` tokens (default 8;
    ``0`` never). There inductor's bf16 GEMM turns compute-bound beyond a few rows: 30 layers
    of SwiGLU MLP over 16 rows took 64.7 ms in bf16 against 35.8 ms with fp32 weights (10.0 vs
    16.7 ms for one row, 17.7 vs 17.3 for four; AVX2 AMD EPYC, 2 threads). The fp32 copies cost
    memory: ~540 MB per widened graph. Not where the GEMV kernel takes that many rows: it
    widens in registers (16 rows 75 ms against 151 ms through fp32 copies, ``models/gemv.py``)."""
    if dtype != torch.bfloat16 or native_bf16() or tokens <= gemv_kernel.max_rows():
        return False
    least = int(os.environ.get("ADAFLASH_WIDEN_TOKENS", "8"))
    return least > 0 and tokens >= least


def compile_enabled() -> bool:
    return os.environ.get("ADAFLASH_COMPILE", "1") != "0"


@dataclass(frozen=True)
class Route:
    """How the compiled steps multiply. ``gemv``: a one-row step (batch-1 decode) sends its
    projections through the kernel (``models/gemv.py``: the weights' panels where they are
    packed, else the GEMV kernel; steps of more rows use it wherever it takes their rows,
    whatever the route); ``tune``: GEMMs autotuned between oneDNN and inductor's C++
    micro-kernel template, else oneDNN only."""

    gemv: bool
    tune: bool

    def label(self) -> str:
        return ("gemv kernel" if self.gemv else "template" if self.tune else "onednn") + (
            ", wider GEMMs autotuned" if self.gemv and self.tune else ""
        )

    def as_dict(self) -> dict[str, bool]:
        return {"gemv": self.gemv, "autotune": self.tune}


def routes() -> tuple[Route, ...]:
    """The routes worth building for the first graph (one: decided; several: each is built and
    timed there, the fastest serves: ``DecodeGraph._choose``). The one-row step goes through the
    GEMV kernel where it serves, or through the GEMM that autotuning picks — and which wins
    depends on the CPU, not on its class: with AVX512-BF16 and no AMX, the kernel won on an AMD
    EPYC of family 26 (8.6 vs 9.9 ms a step with oneDNN) and lost on one of family 25 model 17
    to inductor's template (47.2 vs 71.2 tok/s at batch 1, docs/results/engine/peers_zen4_gemv).
    Autotuning (``ADAFLASH_AUTOTUNE=1``/``0`` decides it) is on, except that with AVX512-BF16 and
    no AMX oneDNN is a candidate too: on an AMX Xeon the template won over oneDNN (9.4 vs 17.2 ms
    over the 120 per-layer projections, one thread); without native bf16 it is the one kernel
    that does not stream fp32 weight copies; with AVX512-BF16 and no AMX it went both ways (family
    26: 12.1 ms autotuned vs 9.4 ms oneDNN, 16 verified tokens 32.0 vs 15.3 ms; family 25: 9.0 vs
    15.5 ms, 16 tokens 32.0 vs 32.5), and beside the kernel the wider GEMMs stay on oneDNN (it won
    or tied on both)."""
    raw = os.environ.get("ADAFLASH_AUTOTUNE")
    flags = cpu_flags() or frozenset()
    if raw is not None:
        tunes: tuple[bool, ...] = (raw != "0",)
    elif "avx512_bf16" in flags and "amx_bf16" not in flags:
        tunes = (True, False)
    else:
        tunes = (True,)
    kernel = (Route(True, tunes[-1]),) if gemv_kernel.available() else ()
    return kernel + tuple(Route(False, t) for t in tunes)


AUTOTUNE_MARGIN = 0.05  # a measured choice is remembered when it wins by this much


def _routes_file() -> Path:
    return cache_dir() / "routes.json"


def _route_key(target: TargetModel) -> str:
    """What the route depends on: this CPU, torch and thread count, and the model's shapes,
    dtype and device."""
    fields = cpuinfo() or {}
    cpu = "/".join(fields.get(k, "?") for k in ("model name", "cpu family", "model"))
    flags = ",".join(cast("list[str]", cpu_info()["flags"]))
    c = target.cfg
    shapes = (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads)
    model = f"{c.model_type} {shapes} d{c.head_dim} vocab {c.vocab_size}"
    return (
        f"{cpu} [{flags}] torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{model} {target.dtype} on {target.device}"
    )


def remembered_route(target: TargetModel, among: tuple[Route, ...]) -> Route | None:
    """The route measured earlier on this machine (``routes.json`` in the cache) if it is one
    of ``among`` (what may be chosen now), or None."""
    try:
        seen = json.loads(_routes_file().read_text())
    except (OSError, ValueError):
        return None
    entry = seen.get(_route_key(target)) if isinstance(seen, dict) else None
    chosen = entry.get("route") if isinstance(entry, dict) else None
    if not isinstance(chosen, dict):
        return None
    return next((r for r in among if r.as_dict() == chosen), None)


def remember_route(target: TargetModel, choice: Route, ms: dict[str, float]) -> None:
    """Keep the measured route for later processes on this machine (best effort; the file is
    replaced whole, never left half-written; an unreadable one starts over)."""
    path = _routes_file()
    try:
        seen = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        seen = {}
    seen = seen if isinstance(seen, dict) else {}
    seen[_route_key(target)] = {"route": choice.as_dict(), "step_ms": ms}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(seen, indent=1))
    except OSError as e:
        log.warning("could not remember the compiled steps' route in %s: %s", path, e)


def options(device: torch.device, tune: bool) -> dict[str, object]:
    """Inductor settings: weights frozen (constants, prepacked), a C++ wrapper, and on a CPU
    with ``tune`` the GEMMs autotuned (``Route``)."""
    opts: dict[str, object] = {"freezing": True}
    if device.type == "cpu":
        opts["cpp_wrapper"] = True
        if tune:
            opts |= {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
    return opts


class _Step(nn.Module):
    """The target's layers written for the compiler, over B requests × T new tokens each. Shares
    the target's weights (fused q|k|v and gate|up where the target fused them)."""

    def __init__(
        self,
        target: TargetModel,
        capture: tuple[int, ...] = (),
        widen: bool = False,
        gemv: bool = True,  # few-row projections through the GEMV kernel, where one serves
        attention: bool = True,  # attention through the kernels' op, where it serves
    ) -> None:
        super().__init__()
        self.target, self.capture, self.widen = target, capture, widen
        cpu = target.device.type == "cpu"
        cpu_bf16 = cpu and target.dtype == torch.bfloat16
        self.gemv_rows = gemv_kernel.max_rows() if cpu_bf16 and gemv else 0
        self.attention_op = attention and cpu and gemv_kernel.available()
        self.qkv = nn.ParameterList()
        self.gate_up = nn.ParameterList()
        # the weights in panels where the kernel packs them (``models/gemv.py``), shared with
        # the eager step: per layer q|k|v, o, gate|up, down, then the LM head (``panel``)
        found: list[torch.Tensor | None] = []
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
            if self.gemv_rows:
                found += [
                    _panels(a.qkv_packed, qkv, a.qkv_bias),
                    _panels(a.o_proj.packed, a.o_proj.weight, a.o_proj.bias),
                    _panels(m.gate_up_packed, gu, m.gate_up_bias),
                    _panels(m.down_proj.packed, m.down_proj.weight, m.down_proj.bias),
                ]
        if self.gemv_rows:
            found.append(_panels(target.lm_head.packed, target.lm_head.weight, None))
        kept = [p for p in found if p is not None]
        self.panels = nn.ParameterList(nn.Parameter(p, requires_grad=False) for p in kept)
        # where each weight's panels are in ``panels`` (None: it has none)
        at = iter(range(len(kept)))
        self.panel_at = [None if p is None else next(at) for p in found]

    def run(
        self,
        ids: torch.Tensor,  # (B, T) new tokens of B requests
        pos: torch.Tensor,  # (B,) position of each request's first = its committed length
        pool: torch.Tensor,  # (rows, layers, 2, kv_heads, capacity, d) the KV pool
        rows: torch.Tensor,  # (B,) the requests' rows; their past: positions < pos
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        t = self.target
        b, n = ids.shape
        x = t.embed_tokens(ids.reshape(-1))  # (B·T, H)
        positions = (pos[:, None] + torch.arange(n, device=ids.device)).reshape(-1)  # (B·T,)
        cos, sin = t.rotary(positions, x.dtype)  # (B·T, d)
        ahead = torch.ones(n, n, dtype=torch.bool, device=ids.device).triu(1)  # (T, T) j > i
        new_kv, captured = [], {}
        for i, layer in enumerate(cast("list[DecoderLayer]", t.layers)):
            a, m = layer.self_attn, layer.mlp
            nh, kvh, d = a.heads, a.kv_heads, a.head_dim
            qkv = self.linear(layer.input_layernorm(x), self.qkv[i], a.qkv_bias, self.panel(i, 0))
            q, k, v = qkv.split([nh * d, kvh * d, kvh * d], dim=-1)
            q, k, v = q.view(b * n, nh, d), k.view(b * n, kvh, d), v.view(b * n, kvh, d)
            if a.q_norm is not None and a.k_norm is not None:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            new_kv.append(torch.stack([k, v]).view(2, b, n, kvh, d))
            if self.attention_op:  # the same math in one C++ call, over positions < pos only
                # k and v from the stack: contiguous (v from the q|k|v split is not, and the op
                # copied it: 0.26 ms a 16-token step)
                kb, vb = new_kv[-1][0], new_kv[-1][1]  # (B, T, kv_heads, d)
                o = gemv_kernel.attention(q.view(b, n, nh, d), kb, vb, pool, rows, i, pos)
                o = o.view(b * n, nh * d)
            else:
                o = self.attend(q, k, v, pool[rows, i], pos, ahead).to(x.dtype)
            x = x + self.linear(o, a.o_proj.weight, a.o_proj.bias, self.panel(i, 1))
            h = layer.post_attention_layernorm(x)
            gu = self.linear(h, self.gate_up[i], m.gate_up_bias, self.panel(i, 2))
            gate, up = gu.chunk(2, dim=-1)
            down = self.panel(i, 3)
            x = x + self.linear(F.silu(gate) * up, m.down_proj.weight, m.down_proj.bias, down)
            if i in self.capture:
                captured[i] = x
        head = self.panel(len(t.layers), 0)
        logits = self.linear(t.norm(x), t.lm_head.weight, None, head).float()  # (B·T, V)
        features = torch.cat([captured[i] for i in self.capture], -1) if self.capture else None
        # (B·T, V), (layers, 2, B, T, kv_heads, d), (B·T, K·H)
        return logits, torch.stack(new_kv), features

    @staticmethod
    def attend(
        q: torch.Tensor,  # (B·T, heads, d)
        k: torch.Tensor,  # (B·T, kv_heads, d)
        v: torch.Tensor,  # (B·T, kv_heads, d)
        past: torch.Tensor,  # (B, 2, kv_heads, capacity, d) the requests' keys and values
        pos: torch.Tensor,  # (B,) positions ≥ pos are masked
        ahead: torch.Tensor,  # (T, T) j > i: the new tokens' causal mask
    ) -> torch.Tensor:
        """Attention in fp32: the past (masked to < pos) and the new tokens (causal), one
        softmax; (B·T, heads·d) fp32."""
        b, n = pos.shape[0], ahead.shape[0]
        nh, kvh, d = q.shape[1], k.shape[1], q.shape[2]
        g = nh // kvh
        qg = q.view(b, n, kvh, g, d).permute(0, 2, 3, 1, 4).float() * d**-0.5  # (B,kvh,g,T,d)
        kn = k.view(b, n, kvh, d).permute(0, 2, 1, 3)[:, :, None].float()  # (B,kvh,1,T,d)
        vn = v.view(b, n, kvh, d).permute(0, 2, 1, 3)[:, :, None].float()
        keys, values = past[:, 0, :, None].float(), past[:, 1, :, None].float()  # (B,kvh,1,cap,d)
        cap = keys.shape[3]
        hidden = (torch.arange(cap, device=q.device) >= pos[:, None])[:, None, None, None]
        s_past = torch.matmul(qg, keys.transpose(-1, -2)).masked_fill(hidden, float("-inf"))
        s_new = torch.matmul(qg, kn.transpose(-1, -2)).masked_fill(ahead, float("-inf"))
        p = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)  # (B,kvh,g,T,cap+T)
        o = torch.matmul(p[..., :cap], values) + torch.matmul(p[..., cap:], vn)
        return o.permute(0, 3, 1, 2, 4).reshape(b * n, nh * d)  # (B·T, nh·d)

    def panel(self, layer: int, which: int) -> torch.Tensor | None:
        """Layer ``layer``'s weight ``which`` (0 q|k|v, 1 o, 2 gate|up, 3 down; the LM head
        after the last layer) in panels, or None."""
        at = self.panel_at[4 * layer + which] if self.panel_at else None
        return None if at is None else self.panels[at]

    def linear(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        panels: torch.Tensor | None = None,  # w packed in panels, where it is
    ) -> torch.Tensor:
        """``F.linear``; few rows of bf16 through the kernel where one serves
        (``models/gemv.py``: the weight's panels, else the GEMV kernel); widened, the weights
        are fp32 (folded into fp32 constants when the graph freezes them) and the product is
        rounded back to the activations' dtype."""
        if not self.widen:
            rows = self.gemv_rows
            if b is None and rows and x.numel() <= rows * x.shape[-1]:
                if panels is not None:
                    return gemv_kernel.panel_linear(x, panels)
                return gemv_kernel.gemv(x, w)
            return F.linear(x, w, b)
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


class DecodeStep(_Step):
    """One request's step: T new tokens (decode: 1; verify: a compiled width ≥ k̂, padded) over
    its own KV-pool row."""

    def forward(
        self,
        ids: torch.Tensor,  # (T,) new tokens of one request
        pos: torch.Tensor,  # (1,) position of the first = the request's committed length
        past: torch.Tensor,  # (layers, 2, kv_heads, capacity, d) the request's pool row
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        rows = torch.zeros(1, dtype=torch.long, device=ids.device)
        logits, new_kv, features = self.run(ids[None], pos, past[None], rows)
        return logits, new_kv[:, :, 0], features  # (T, V), (layers, 2, T, kv_heads, d), (T, K·H)


class BatchVerifyStep(_Step):
    """B requests' verification, T new tokens each (fewer padded after the real ones), reading
    their rows of the whole KV pool."""

    def forward(
        self,
        ids: torch.Tensor,  # (B, T) new tokens per request
        rows: torch.Tensor,  # (B,) their rows in the pool
        pos: torch.Tensor,  # (B,) their committed lengths
        pool: torch.Tensor,  # (rows, layers, 2, kv_heads, capacity, d) the KV pool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        # (B·T, V), (layers, 2, B, T, kv_heads, d), (B·T, K·H)
        return self.run(ids, pos, pool, rows)


class BatchDecodeStep(_Step):
    """B requests' decode step, one new token each, reading their rows of the whole KV pool."""

    def forward(
        self,
        ids: torch.Tensor,  # (B,) one new token per request
        rows: torch.Tensor,  # (B,) their rows in the pool
        pos: torch.Tensor,  # (B,) their committed lengths
        pool: torch.Tensor,  # (rows, layers, 2, kv_heads, capacity, d) the KV pool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        logits, new_kv, features = self.run(ids[:, None], pos, pool, rows)
        return logits, new_kv[:, :, :, 0], features  # (B, V), (layers, 2, B, kv_heads, d), (B, K·H)


def _panels(
    packed: Packed | None, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """The weight's panels: the eager step's where it packed them (one copy for both), else
    packed here; None where they do not serve (a bias, a shape that does not fit)."""
    if bias is not None or not gemv_kernel.panels():
        return None
    if packed is not None and packed.panels is not None:
        return packed.panels
    return gemv_kernel.pack_panels(weight)


def own_code(step: _Step) -> _Step:
    """``step`` with a ``forward`` of its own code object. Dynamo keeps its compiled graphs and
    their guards per code object: with one per key (and route) each holds one graph, which no
    call of another key's shapes or module can reach, and a call checks one set of guards."""
    f = type(step).forward
    code = f.__code__.replace()  # equal, but another object
    own = types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    step.forward = types.MethodType(own, step)
    return step


def module_guards_off(entries: list) -> list[bool]:
    """Dynamo's guards to keep: all but those on the step module and its parameters. The
    parameters are frozen into the graph as constants (``options``), never replaced while it
    serves (the target's weights do not change; only the drafter's are swapped), and the module
    has its own code object (``own_code``); its inputs' and the global state's guards stay.
    Each call checked ~300 parameters' guards, profiled as 1.05 ms of "TorchDynamo Cache
    Lookup" in a 30.6 ms batch-1 step; without them a step took 1.3 and 0.5 ms less (medians of
    60 and 100 interleaved calls, two runs; AMD EPYC of family 25 model 1, AVX2, 2 threads)."""
    return torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)


class GraphFailed(RuntimeError):
    """A compiled step raised before it changed anything; its graph is gone, take the eager step."""


class DecodeGraph:
    """Compiled steps, compiled one after another in a background thread. A graph is keyed by
    the layers it captures (none for plain decoding; the drafter's for speculative serving), by
    the new tokens it takes per request (1: decode; a verification width), and by its request
    count: 1 (``DecodeStep``) or a batch size (``BatchDecodeStep``, one token per request)."""

    def __init__(self, target: TargetModel) -> None:
        self.target = target
        self.graphs: dict[Key, Callable[..., tuple]] = {}
        self.failed: dict[Key, str] = {}
        self.compile_s: dict[Key, float] = {}
        self._asked: set[Key] = set()
        self._queue: queue.SimpleQueue[Key] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # how the steps multiply (``Route``); None: measured at the first compile
        self.routes = routes() if target.device.type == "cpu" else (Route(False, True),)
        self.route: Route | None = self.routes[0] if len(self.routes) == 1 else None
        self.steps = 0  # steps served compiled
        self.tokens = 0  # their new tokens (more than steps: verification or batches ran compiled)

    def request(
        self,
        capture: tuple[int, ...] = (),
        multi: bool = False,
        background: bool = True,
        batches: tuple[int, ...] = (),
    ) -> None:
        """Compile the one-token step that captures ``capture``, with ``multi`` a verification
        step of each width in ``verify_widths()``, and a batched decode step for each size in
        ``batches`` (once each): in the background thread, or here."""
        c = tuple(capture)
        widths = verify_widths() if multi else ()
        keys = [(c, 1, 1)] + [(c, w, 1) for w in widths] + [(c, 1, b) for b in batches]
        if multi:  # several requests verifying together, where their rows multiply well
            rows = gemv_kernel.max_rows()
            keys += [
                (c, w, b)
                for b in batches
                for w in batch_verify_widths()
                if native_bf16() or w * b <= rows
            ]
        for key in keys:
            if key in self._asked:
                continue
            self._asked.add(key)
            if not background:
                self._compile(key)
                continue
            trace_fx_once_here()  # before the thread starts, which could trace it beside a step
            self._queue.put(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="decode-graph", daemon=True)
                self._thread.start()

    def ready(self, capture: tuple[int, ...] = (), tokens: int = 1) -> bool:
        return self.width(capture, tokens) is not None

    def width(self, capture: tuple[int, ...], tokens: int) -> int | None:
        """The compiled one-request step that takes ``tokens`` new tokens: 1 for a decode step,
        else the smallest verification width ≥ ``tokens``; None if there is none (yet)."""
        keys = list(self.graphs)  # one copy: the compile thread may add a graph meanwhile
        widths = [t for c, t, b in keys if c == tuple(capture) and b == 1]
        if tokens == 1:
            return 1 if 1 in widths else None
        return verification_width(widths, tokens)

    def batch_verify(self, capture: tuple[int, ...], lengths: tuple[int, ...]) -> Key | None:
        """The compiled batched verification that takes requests of these token counts (two or
        more requests, some with more than one token): the smallest batch size, then the
        smallest width, that hold them; None if there is none (yet)."""
        if len(lengths) < 2 or max(lengths) < 2:
            return None
        c = tuple(capture)
        pairs = [(b, t) for k, t, b in list(self.graphs) if k == c and t > 1 and b > 1]
        fit = batched_verification(pairs, len(lengths), max(lengths))
        return None if fit is None else (c, fit[1], fit[0])

    def batch_size(self, capture: tuple[int, ...], requests: int) -> int | None:
        """The smallest compiled batch size that takes ``requests`` one-token requests, or None."""
        keys = list(self.graphs)  # one copy: the compile thread may add a graph meanwhile
        sizes = [b for c, t, b in keys if c == tuple(capture) and b > 1 and t == 1]
        return min((b for b in sizes if b >= requests), default=None)

    def compiled(
        self, capture: tuple[int, ...]
    ) -> tuple[tuple[int, ...], int, tuple[tuple[int, int], ...], tuple[int, ...]]:
        """The batch sizes compiled for ``capture``, how many graphs capture it (the cost
        model's tables start over when that changes), the batched verifications' (batch
        size, width) and the one-request verification widths."""
        keys = [k for k in list(self.graphs) if k[0] == tuple(capture)]
        batches = tuple(sorted(b for _, t, b in keys if b > 1 and t == 1))
        verify = tuple(sorted((b, t) for _, t, b in keys if b > 1 and t > 1))
        return batches, len(keys), verify, tuple(sorted(t for _, t, b in keys if b == 1 and t > 1))

    def status(self) -> str:
        """'ready', 'compiling', 'failed' or 'off' (for /metrics)."""
        if self.failed:
            return "failed"
        if self._asked and self._asked <= set(self.graphs):
            return "ready"
        return "compiling" if self._asked else "off"

    def _work(self) -> None:
        while True:
            key = self._queue.get()
            with quick_gil_handoff():
                self._compile(key)

    def _compile(self, key: Key) -> None:
        t0 = time.perf_counter()
        try:
            if self.route is None:
                self.route = remembered_route(self.target, self.routes)
            fn = self._build(key, self.route) if self.route is not None else self._choose(key)
            self.graphs[key] = fn
            self.compile_s[key] = time.perf_counter() - t0
            # compiling leaves ~10⁵ long-lived objects per graph (1.4 M with a study's graphs,
            # whose full collection took 0.9–1.5 s: a pause in whichever step set it off);
            # frozen, the collector never scans them again
            gc.freeze()
            log.info("compiled the decode step %s in %.1f s", key, self.compile_s[key])
        except Exception as e:  # the eager step keeps serving
            self.failed[key] = f"{type(e).__name__}: {e}"
            log.warning("compiling the decode step %s failed; eager serves: %s", key, e)

    def _inputs(self, key: Key, cap: int) -> tuple[torch.Tensor, ...]:
        """Zero inputs of ``key``'s step over a pool of capacity ``cap`` (dims marked dynamic)."""
        _, n, batch = key
        c, dev = self.target.cfg, self.target.device
        with torch.inference_mode():  # an inference tensor, like the pool (KVCache)
            pool = torch.zeros(
                (batch + cap // 8, c.num_layers, 2, c.num_kv_heads, cap, c.head_dim),
                dtype=self.target.dtype,
                device=dev,
            )
        pos = torch.full((batch,), cap // 2, device=dev)
        if batch == 1:
            past, ids = pool[0], torch.zeros(n, dtype=torch.long, device=dev)
            torch._dynamo.mark_dynamic(past, 3)  # one graph for every capacity
            return ids, pos, past
        torch._dynamo.mark_dynamic(pool, 0)  # … and every pool size
        torch._dynamo.mark_dynamic(pool, 4)
        rows = torch.arange(batch, device=dev)
        shape = (batch, n) if n > 1 else (batch,)
        return torch.zeros(shape, dtype=torch.long, device=dev), rows, pos, pool

    def _build(self, key: Key, route: Route) -> Callable[..., tuple]:
        """Compile ``key``'s step the ``route``'s way and run it at two capacities (and pool
        sizes), which checks that the dynamic dims hold."""
        import torch._inductor.config as inductor

        capture, n, batch = key
        module = DecodeStep if batch == 1 else BatchDecodeStep if n == 1 else BatchVerifyStep
        rows = n * batch
        gemv = route.gemv or rows > 1  # the route decides the one-row step (``Route``)
        wide = widen(self.target.dtype, n if batch == 1 else 1)  # (batched rows stay bf16)
        step = own_code(module(self.target, capture, wide, gemv).eval())
        fn = torch.compile(step, fullgraph=True, options={"guard_filter_fn": module_guards_off})
        with inductor.patch(options(self.target.device, route.tune)):
            for cap in (24, 40):
                args = self._inputs(key, cap)
                with torch.no_grad():  # as served (see ``step``)
                    fn(*args)
        return fn

    def _choose(self, key: Key) -> Callable[..., tuple]:
        """``key``'s step built every way in ``routes`` and timed: the fastest serves and
        sets the route of every later graph. It is remembered for later processes when it wins
        by ``AUTOTUNE_MARGIN`` over the next (a near-tie is measured again next time). Where
        some fail to build, the fastest of the others serves, remembered only if none failed."""
        built: dict[Route, Callable[..., tuple]] = {}
        errors = []
        for route in self.routes:
            try:
                built[route] = self._build(key, route)
            except Exception as e:
                errors.append(e)
                log.warning("building the decode step %s as %s failed: %s", key, route, e)
        if not built:
            raise errors[-1]
        if len(built) == 1:
            self.route = next(iter(built))
            return built[self.route]
        ms = self._time(built, key)
        self.route = min(ms, key=ms.__getitem__)
        fast, runner_up = sorted(ms.values())[:2]
        timed = {r.label(): v for r, v in ms.items()}
        if runner_up > fast * (1 + AUTOTUNE_MARGIN) and not errors:
            remember_route(self.target, self.route, timed)
        log.info("compiled steps go through the %s here: a step %s", self.route.label(), timed)
        return built[self.route]

    def _time(self, fns: dict[Route, Callable[..., tuple]], key: Key, calls: int = 12) -> dict:
        """Median milliseconds of each of ``fns`` over a 256-position pool half in use, their
        calls interleaved (whatever else runs meanwhile slows both alike)."""
        args = self._inputs(key, 256)
        times: dict[Route, list[float]] = {k: [] for k in fns}
        with torch.no_grad():
            for i in range(calls + 2):
                for k, fn in fns.items():
                    t0 = time.perf_counter()
                    fn(*args)
                    if i >= 2:  # two untimed first
                        times[k].append(1e3 * (time.perf_counter() - t0))
        return {k: round(statistics.median(v), 3) for k, v in times.items()}

    def run(
        self, batch: PackedBatch, cache: KVCache, capture: tuple[int, ...]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``batch`` through the compiled step that takes it (one request; one token each of
        several; a batched verification): every packed row's logits (Σ n, V), features or None,
        and the last row of each request; all None where no graph takes it or its graph raised
        (``_call``): then the eager step runs."""
        lengths, slots, ids = batch.lengths, batch.slots, batch.input_ids
        try:
            if len(lengths) == 1 and self.ready(capture, lengths[0]):
                rows, feats = self.step(ids, slots[0], cache, capture)
                return rows, feats, rows[-1:]
            if max(lengths) == 1 and self.batch_size(capture, len(lengths)):
                rows, feats = self.step_batch(ids, slots, cache, capture)
                return rows, feats, rows  # one token per request
            if self.batch_verify(capture, lengths) is not None:
                rows, feats = self.step_verify(ids, lengths, slots, cache, capture)
                return rows, feats, rows[batch.ends.to(rows.device)]  # (B, V)
        except GraphFailed:  # dropped before it wrote anything
            pass
        return None, None, None

    def step(
        self, ids: torch.Tensor, slot: int, cache: KVCache, capture: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The new tokens (n,) of ``slot``, on the compiled width T ≥ n (padded with copies of
        the last, whose outputs are dropped): writes their keys/values; returns logits (n, V)
        fp32 and the captured features (n, K·H) or None."""
        n = ids.shape[0]
        width = self.width(capture, n)
        assert width is not None, f"no compiled step for {n} tokens"
        key = (tuple(capture), width, 1)
        cache.reserve(slot, n)
        row, pos = cache.row(slot), cache.length(slot)
        past = cache.data[row]  # (layers, 2, kv_heads, capacity, d) view
        # called as compiled: under no_grad, outside inference mode (in inference mode the
        # graph is another one, without prepacked weights: 1.5× slower, measured); the inputs
        # made here too: an inference tensor would fail the guards
        with torch.inference_mode(False), torch.no_grad():
            ids = ids.to(self.target.device)
            if width > n:  # after the real tokens: the causal mask hides them from the real ones
                ids = torch.cat([ids, ids[-1:].expand(width - n)])
            pos_t = torch.tensor([pos], device=ids.device)
            logits, new_kv, features = self._call(key, ids, pos_t, past)
        with torch.inference_mode():  # the pool is an inference tensor
            cache.data[row, :, :, :, pos : pos + n] = new_kv[:, :, :n].transpose(2, 3)
        cache.advance(slot, n)
        self.steps += 1
        self.tokens += n
        return logits[:n], None if features is None else features[:n]

    def step_batch(
        self,
        ids: torch.Tensor,  # (n,) one new token per request
        slots: tuple[int, ...],
        cache: KVCache,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of n requests on the compiled batch size ≥ n (``_step_many``):
        logits (n, V) fp32 and the captured features (n, K·H) or None."""
        size = self.batch_size(capture, len(slots))
        assert size is not None, f"no compiled batch for {len(slots)} requests"
        return self._step_many((tuple(capture), 1, size), ids, (1,) * len(slots), slots, cache)

    def step_verify(
        self,
        ids: torch.Tensor,  # (Σ n,) the requests' new tokens, packed
        lengths: tuple[int, ...],  # n per request
        slots: tuple[int, ...],
        cache: KVCache,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One verification pass of several requests on the compiled batch size and width that
        hold them (``batch_verify``, ``_step_many``): logits (Σ n, V) fp32 and features
        (Σ n, K·H) or None, in packed order."""
        key = self.batch_verify(capture, lengths)
        assert key is not None, f"no compiled batched verification for {lengths}"
        return self._step_many(key, ids, lengths, slots, cache)

    def _call(self, key: Key, *inputs: torch.Tensor) -> tuple:
        """``key``'s graph on ``inputs`` (it only reads them: the caller writes the cache after).
        A graph that raises is dropped for good (``failed``; /metrics then says so) and
        ``GraphFailed`` tells the caller to take the eager step: a request is never lost to a
        compiled step (a demo run once lost two to a tracer error raised inside one)."""
        try:
            return self.graphs[key](*inputs)
        except Exception as e:
            self.graphs.pop(key, None)
            self.failed[key] = f"{type(e).__name__}: {e}"
            log.warning("the compiled step %s raised; eager serves it from now on: %s", key, e)
            raise GraphFailed(key) from e

    def _step_many(
        self,
        key: Key,  # a batched graph: (capture, width, size)
        ids: torch.Tensor,  # (Σ n,) the requests' new tokens, packed
        lengths: tuple[int, ...],  # n ≤ width per request
        slots: tuple[int, ...],
        cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Several requests through ``key``'s graph: each request's tokens padded after its last
        to the width (the causal mask hides the pads from its real tokens), the batch padded to
        the size with copies of the first request; the pads' outputs and keys/values are
        dropped. Writes the real tokens' keys/values; returns their logits and features in
        packed order."""
        _, width, size = key
        for s, n in zip(slots, lengths, strict=True):
            cache.reserve(s, n)  # may grow the pool: read cache.data after
        rows = [cache.row(s) for s in slots]
        pos = [cache.length(s) for s in slots]
        dev = self.target.device
        pad = size - len(slots)
        flat, grid, b_idx, t_idx, start = ids.tolist(), [], [], [], 0
        for b, n in enumerate(lengths):
            own = flat[start : start + n]
            grid.append(own + own[-1:] * (width - n))
            b_idx += [b] * n
            t_idx += list(range(n))
            start += n
        grid += grid[:1] * pad
        # as in ``step``; the inputs made here too: an inference tensor would fail the guards
        with torch.inference_mode(False), torch.no_grad():
            rows_t = torch.tensor(rows + rows[:1] * pad, device=dev)
            pos_t = torch.tensor(pos + pos[:1] * pad, device=dev)
            ids_t = torch.tensor(grid, device=dev)  # (size, width)
            if width == 1:  # a decode graph: (size,) in, (layers, 2, size, kv_heads, d) out
                logits, new_kv, features = self._call(
                    key, ids_t.view(size), rows_t, pos_t, cache.data
                )
                new_kv = new_kv.unsqueeze(3)
            else:
                logits, new_kv, features = self._call(key, ids_t, rows_t, pos_t, cache.data)
        b_t, t_t = torch.tensor(b_idx, device=dev), torch.tensor(t_idx, device=dev)  # (Σ n,)
        real = b_t * width + t_t  # the real tokens' rows of the (size·width) outputs
        with torch.inference_mode():  # token (b, t) goes to (rows[b], pos[b] + t)
            kv = new_kv[:, :, b_t, t_t]  # (layers, 2, Σ n, kv_heads, d)
            cache.data[rows_t[b_t], :, :, :, pos_t[b_t] + t_t] = kv.permute(2, 0, 1, 3, 4)
        for s, n in zip(slots, lengths, strict=True):
            cache.advance(s, n)
        self.steps += 1
        self.tokens += sum(lengths)
        return logits[real], None if features is None else features[real]


# While a graph compiles in the background, the compiler runs Python nonstop on its thread, and
# the eager step serving meanwhile — ~2,500 ops, each releasing the GIL and waiting to take it
# back — waits up to the interpreter's switch interval (5 ms) per op: an eager SmolLM2 step took
# 4.7 s instead of 30 ms (153×; AMD EPYC, AVX2, 2 threads). With a 10 µs interval while a graph
# compiles: 0.26 s (7×): slow, but serving (bench/compile_contention.py,
# docs/results/engine/compile_contention.json). Compiling in another process would remove it.
COMPILE_SWITCH_S = 1e-5
_handoff_lock = threading.Lock()
_handoff_users = 0
_handoff_saved = 0.0


@contextlib.contextmanager
def quick_gil_handoff() -> Iterator[None]:
    """A switch interval of ``COMPILE_SWITCH_S`` for as long as any compile runs (process-wide;
    the one it replaced comes back after the last)."""
    global _handoff_users, _handoff_saved
    with _handoff_lock:
        if _handoff_users == 0:
            _handoff_saved = sys.getswitchinterval()
            sys.setswitchinterval(COMPILE_SWITCH_S)
        _handoff_users += 1
    try:
        yield
    finally:
        with _handoff_lock:
            _handoff_users -= 1
            if _handoff_users == 0:
                sys.setswitchinterval(_handoff_saved)


def trace_fx_once_here() -> None:
    """Run, on the serving thread, the one trace the compiler makes with torch.fx's plain
    ``Tracer``: the graph of ``identity`` that Inductor makes once per process
    (``loop_body.InterpreterShim._dummy_gm``). Any trace patches ``nn.Module.__call__`` for the
    whole process while it runs, and the plain ``Tracer`` raises "module is not installed as a
    submodule" for a module not under its root, so an eager step on another thread that calls a
    module meanwhile fails: live demos lost requests to it while the first graph compiled (one
    batch of 3 in 9,000 eager batches beside a tiny target's compile; the test is
    ``tests/engine/test_compile_race.py``). The compiler's other traces (``make_fx``'s) call
    foreign modules straight through and do no harm."""
    from torch._inductor.loop_body import InterpreterShim

    dummy = getattr(InterpreterShim, "_dummy_gm", None)
    if dummy is not None:
        dummy()


def compiled_route(target: TargetModel) -> dict[str, bool] | None:
    """How the target's compiled steps multiply (``Route``; None: not decided, nothing
    compiled), for benchmarks' result files."""
    graph = target.decode_graph
    return None if graph is None or graph.route is None else graph.route.as_dict()


def compile_now(
    target: TargetModel,
    captures: list[tuple[int, ...]],
    batches: tuple[int, ...] = (),
    drafter: DFlashDrafter | None = None,
) -> dict[str, float]:
    """Build, in the foreground, the graphs ``serve`` builds in the background for these
    captured-layer sets (plain decoding for ``()``; decode and verification widths for a drafter's;
    batched decode steps of ``batches`` requests) and, with ``drafter``, its compiled pass
    (``models/draft_graph.py``, where it serves), before a benchmark times anything; seconds
    per graph, by a readable name. Raises if one failed."""
    from adaflash.models import draft_graph  # (it imports this module)

    graph = None
    for capture in captures:
        graph = target.compile_decode(capture, bool(capture), False, batches)
        if graph.failed:
            raise RuntimeError(f"compiling the decode step failed: {graph.failed}")
    seconds = {} if graph is None else {name(k): round(t, 1) for k, t in graph.compile_s.items()}
    if drafter is not None:
        built = draft_graph.compile_now(drafter, target.dtype)
        seconds |= {f"drafter pass, {k}": t for k, t in built.items()}
    return seconds


def name(key: Key) -> str:
    capture, tokens, batch = key
    return f"{list(capture)}{f' verify {tokens}' if tokens > 1 else ''}" + (
        f" batch {batch}" if batch > 1 else ""
    )
