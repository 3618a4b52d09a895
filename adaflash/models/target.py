"""A compact Llama / Qwen3 decoder that runs packed ragged batches (our runtime, not HF's).

A packed batch is the new tokens of many requests concatenated into one (T,) tensor; each request
brings its own number of new tokens. Embeddings, norms, projections, MLP and LM head run on the
packed tensor; only attention loops over requests, each over its own KV-cache slot. This is what
makes variable-length verification cost Σ k̂_i tokens instead of batch × max k̂ (SPEC §5).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from adaflash.config import TargetConfig
from adaflash.models.batch_attention import AttentionPlan, attend_packed
from adaflash.models.checkpoint import load_tensors, resolve_dtype
from adaflash.models.decode_graph import DecodeGraph
from adaflash.models.kv_cache import KVCache
from adaflash.models.layers import (
    Packed,
    Projection,
    RMSNorm,
    Rotary,
    SwiGLU,
    apply_rope,
    fuse_bias,
    fuse_rows,
    linear,
    pack,
)


@dataclass(frozen=True)
class PackedBatch:
    """New tokens of several requests, packed. ``lengths[i]`` tokens belong to ``slots[i]``."""

    input_ids: torch.Tensor  # (T,)
    slots: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.input_ids.dim() == 1, "input_ids must be packed (T,)"
        assert len(self.slots) == len(self.lengths), "one length per slot"
        assert all(n > 0 for n in self.lengths), "every request brings at least one token"
        assert sum(self.lengths) == self.input_ids.numel(), "lengths must sum to T"

    @property
    def offsets(self) -> list[int]:
        out, acc = [], 0
        for n in self.lengths:
            out.append(acc)
            acc += n
        return out

    @property
    def ends(self) -> torch.Tensor:
        """(B,) each request's last row."""
        return torch.tensor(self.offsets) + torch.tensor(self.lengths) - 1


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # (T, V) for "all", (B, V) for "last"; float32
    features: torch.Tensor | None  # (T, K·H) captured layer outputs, or None


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = Projection(cfg.num_heads * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.qkv: torch.Tensor | None = None  # fused q|k|v weight (``fuse``)
        self.qkv_bias: torch.Tensor | None = None
        self.qkv_packed: Packed | None = None

    def fuse(self) -> None:
        """One projection instead of three (q, k and v weights become views of one tensor),
        packed for oneDNN where that applies; o_proj packed too."""
        self.qkv = fuse_rows(self.q_proj, self.k_proj, self.v_proj)
        if self.q_proj.bias is not None:
            self.qkv_bias = fuse_bias(self.q_proj, self.k_proj, self.v_proj)
        self.qkv_packed = pack(self.qkv, self.qkv_bias)
        self.o_proj.pack_weight()

    def forward(
        self,
        x: torch.Tensor,  # (T, H)
        cos: torch.Tensor,  # (T, d)
        sin: torch.Tensor,
        cache: KVCache,
        layer: int,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        if self.qkv is not None:
            qkv = linear(x, self.qkv, self.qkv_bias, self.qkv_packed)  # (T, (heads + 2·kv)·d)
            q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(t, self.heads, d)  # (T, heads, d)
        k = k.reshape(t, self.kv_heads, d)  # (T, kv_heads, d)
        v = v.reshape(t, self.kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(attend_packed(q, k, v, cache, layer, plan))  # (T, H)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        layer: int,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class TargetModel(nn.Module):
    """The target LLM. Frozen at serving time; its embedding and LM head also serve the drafter."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Projection(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.decode_graph: DecodeGraph | None = None  # ``compile_decode``

    def compile_decode(
        self,
        capture: tuple[int, ...] = (),
        multi: bool = False,
        background: bool = True,
        batches: tuple[int, ...] = (),
    ) -> DecodeGraph:
        """Serve steps that capture ``capture`` through compiled graphs once they are ready —
        one request's one token (decode) and, with ``multi``, several (verification), and the
        decode steps of up to each size in ``batches`` requests — the eager step serves until
        then, and if compiling fails."""
        if self.decode_graph is None:
            self.decode_graph = DecodeGraph(self)
        self.decode_graph.request(capture, multi, background, batches)
        return self.decode_graph

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, initial_capacity: int = 256, initial_rows: int = 4) -> KVCache:
        c = self.cfg
        return KVCache(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            self.dtype,
            self.device,
            initial_capacity,
            initial_rows,
        )

    def fuse(self) -> None:
        """Fused q|k|v and gate|up projections for inference (the separate weights stay as
        views, so checkpoints and state dicts keep their names)."""
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.lm_head.pack_weight(rows_scale=2)  # memory-bound: bf16 wins up to more rows

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: (N, H) → (N, V) float32."""
        return self.lm_head(self.norm(hidden)).float()

    @torch.inference_mode()
    def forward(
        self,
        batch: PackedBatch,
        cache: KVCache,
        *,
        capture_layers: tuple[int, ...] = (),
        logits: str | torch.Tensor = "all",
    ) -> TargetOutput:
        """Run the new tokens of every request; append their keys/values to the cache.

        ``capture_layers`` are layer indices whose outputs (HF ``hidden_states[i + 1]``) are
        returned concatenated as drafter context features. ``logits`` is "all" (every packed
        position), "last" (one row per request), "none", or a tensor of packed row indices.
        """
        graph = self.decode_graph
        if graph is not None and not (isinstance(logits, str) and logits == "none"):
            rows, feats, last = graph.run(batch, cache, capture_layers)
            if rows is not None:  # a compiled step ran
                if isinstance(logits, torch.Tensor):
                    picked = rows[logits.to(rows.device)] if logits.numel() else None
                else:
                    picked = last if logits == "last" else rows
                return TargetOutput(picked, feats)
        ids = batch.input_ids.to(self.device)
        for slot, n in zip(batch.slots, batch.lengths, strict=True):
            cache.reserve(slot, n)
        plan = AttentionPlan.build(cache, batch.slots, batch.lengths, self.device)
        x = self.embed_tokens(ids)  # (T, H)
        cos, sin = self.rotary(plan.positions, x.dtype)  # (T, d) each
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, plan)
            if i in capture_layers:
                captured[i] = x
        for slot, n in zip(batch.slots, batch.lengths, strict=True):
            cache.advance(slot, n)
        features = (
            torch.cat([captured[i] for i in capture_layers], dim=-1) if capture_layers else None
        )  # (T, K·H), in the order asked for
        out: torch.Tensor | None
        if isinstance(logits, torch.Tensor):
            out = self.logits(x[logits.to(self.device)]) if logits.numel() else None
        elif logits == "all":
            out = self.logits(x)  # (T, V)
        elif logits == "last":
            out = self.logits(x[batch.ends.to(self.device)])  # (B, V)
        elif logits == "none":
            out = None
        else:
            raise ValueError(f"logits must be 'all', 'last', 'none' or row indices, got {logits!r}")
        return TargetOutput(out, features)


def load_target(
    folder: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    fuse: bool = True,
) -> TargetModel:
    """Build the target from a Hugging Face folder (``config.json`` + safetensors, sharded too)."""
    cfg = TargetConfig.from_folder(folder)
    dt = resolve_dtype(dtype)
    tensors = load_tensors(folder, dt)
    state = {k.removeprefix("model."): v for k, v in tensors.items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise ValueError(f"{folder}: lm_head.weight missing and embeddings are not tied")
    with torch.device("meta"):
        model = TargetModel(cfg)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    unexpected = [k for k in unexpected if "rotary_emb" not in k]
    if missing or unexpected:
        raise ValueError(
            f"{folder}: weights do not match a {cfg.model_type} model with this config "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    model.to(device)
    model.eval().requires_grad_(False)
    if fuse:
        model.fuse()
    return model
