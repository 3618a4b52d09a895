"""The DFlash diffusion drafter (SPEC §2), loadable from and savable to published checkpoints.

One forward pass drafts a whole block: slot 0 holds the anchor (the last committed token), slots
1…k−1 hold ``mask_token_id``; slot i predicts the token at absolute position p+i through the
target's frozen LM head. Context enters by KV injection: the target's hidden states at K layers
are fused (``fc`` then ``hidden_norm``) into one vector c_t per committed position, and every
drafter layer projects c with its own k_proj/v_proj (+k_norm, +RoPE) and prepends them to the
block's keys/values. Queries come only from the block; attention is bidirectional inside the block
and sees all context. The drafter owns no embedding and no LM head; with a draft vocabulary
(``models/draft_vocab.py``) it scores only those rows of the target's LM head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adaflash.config import DrafterConfig
from adaflash.models import draft_vocab as dv
from adaflash.models import gemv
from adaflash.models.batch_attention import gqa_attend
from adaflash.models.checkpoint import load_tensors, resolve_dtype, save_tensors
from adaflash.models.layers import (
    Mask,
    Packed,
    Projection,
    RMSNorm,
    Rotary,
    SwiGLU,
    apply_rope,
    attend,
    linear,
    pack,
)
from adaflash.models.length_head import LengthHead

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: (kv_heads, n, d) each
HEAD_PREFIX = "length_head."


@dataclass(frozen=True)
class BatchedContext:
    """The context of B requests for one drafter pass at serving time: per layer, keys and
    values padded to the longest context (B, kv_heads, C, d), and each request's length."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor  # (B,)

    @classmethod
    def stack(cls, per_request: list[list[KV]], min_length: int = 0) -> BatchedContext:
        """Per request, per layer (kv_heads, C_b, d) → padded per layer, to at least
        ``min_length`` positions (a compiled pass's dynamic size starts at 2)."""
        lengths = torch.tensor([kv[0][0].shape[1] for kv in per_request])
        longest = max(int(lengths.max()), min_length)
        keys, values = [], []
        for li in range(len(per_request[0])):
            k0 = per_request[0][li][0]
            kk = k0.new_zeros(len(per_request), k0.shape[0], longest, k0.shape[2])
            vv = torch.zeros_like(kk)
            for b, kv in enumerate(per_request):
                n = kv[li][0].shape[1]
                kk[b, :, :n], vv[b, :, :n] = kv[li][0], kv[li][1]
            keys.append(kk)
            values.append(vv)
        return cls(keys, values, lengths)

    def bias(self, block: int) -> torch.Tensor:
        """(B, 1, 1, Q, C + Q) additive mask: padding keys hidden, the whole block visible."""
        longest = self.keys[0].shape[2]
        hidden = torch.arange(longest)[None, :] >= self.lengths[:, None]  # (B, C)
        ctx = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
        full = torch.cat([ctx, torch.zeros(len(self.lengths), block)], dim=1)  # (B, C + Q)
        return full[:, None, None, None, :].expand(-1, 1, 1, block, -1)


@dataclass(frozen=True)
class NewContext:
    """The target features of B requests' positions not projected into their drafter context
    yet, for one compiled drafter pass (``models/draft_graph.py``): padded to the most rows."""

    features: torch.Tensor  # (B, N, K·H)
    positions: torch.Tensor  # (B, N) absolute positions (padding rows repeat the last one)
    lengths: torch.Tensor  # (B,) rows in use

    @classmethod
    def stack(cls, per_request: list[tuple[torch.Tensor, int]], min_rows: int = 2) -> NewContext:
        """Per request (features (n_b, K·H), position of its first row) → padded, to at least
        ``min_rows`` rows (a compiled pass's dynamic size starts at 2)."""
        lengths = torch.tensor([f.shape[0] for f, _ in per_request])
        rows = max(int(lengths.max()), min_rows)
        first = per_request[0][0]
        features = first.new_zeros(len(per_request), rows, first.shape[1])
        positions = torch.zeros(len(per_request), rows, dtype=torch.long)
        for b, (f, start) in enumerate(per_request):
            features[b, : f.shape[0]] = f
            positions[b] = start + torch.arange(rows).clamp(max=max(f.shape[0] - 1, 0))
        return cls(features, positions, lengths)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = Projection(h, cfg.num_heads * d, bias=False)
        self.k_proj = Projection(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = Projection(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = Projection(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        # q|k|v in one weight in the panels kernel's layout, for the compiled pass (serving)
        self.qkv_panels: torch.Tensor | None = None

    def project_kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """h (n, H) → keys, values (kv_heads, n, d) at the positions of cos/sin."""
        n = h.shape[0]
        k = self.k_norm(self.k_proj(h).view(n, self.kv_heads, self.head_dim))
        k = apply_rope(k, cos, sin)
        v = self.v_proj(h).view(n, self.kv_heads, self.head_dim)
        return k.transpose(0, 1), v.transpose(0, 1)

    def batched(
        self,
        x: torch.Tensor,  # (B, Q, H) block states after input_layernorm
        cos: torch.Tensor,  # (B·Q, d)
        sin: torch.Tensor,
        ctx_keys: torch.Tensor,  # (B, kv_heads, C, d)
        ctx_values: torch.Tensor,
        bias: torch.Tensor,  # (B, 1, 1, Q, C + Q)
    ) -> torch.Tensor:
        """Serving: every request's block in one set of projections and one GQA attention."""
        b, q_len, h = x.shape
        flat = x.reshape(b * q_len, h)
        q = self.q_norm(self.q_proj(flat).view(b * q_len, self.heads, self.head_dim))
        q = apply_rope(q, cos, sin).view(b, q_len, self.heads, self.head_dim)
        k_blk, v_blk = self.project_kv(flat, cos, sin)  # (kv_heads, B·Q, d)
        k_blk = k_blk.view(self.kv_heads, b, q_len, self.head_dim).transpose(0, 1)
        v_blk = v_blk.view(self.kv_heads, b, q_len, self.head_dim).transpose(0, 1)
        keys = torch.cat([ctx_keys, k_blk], dim=2)  # (B, kv_heads, C + Q, d)
        values = torch.cat([ctx_values, v_blk], dim=2)
        out = gqa_attend(q, keys, values, bias)  # (B, Q, heads, d)
        return self.o_proj(out.reshape(b, q_len, -1))

    def forward(
        self,
        x: torch.Tensor,  # (B, Q, H) block states after input_layernorm
        cos: torch.Tensor,  # (B, Q, d)
        sin: torch.Tensor,
        ctx_kv: list[KV],  # per item: context keys/values of this layer (kv_heads, C_b, d)
        masks: list[Mask] | None,  # per item (Q, C_b + Q) bool or BlockMask, None = see all
    ) -> torch.Tensor:
        b, q_len, _ = x.shape
        outs = []
        for i in range(b):
            q = self.q_norm(self.q_proj(x[i]).view(q_len, self.heads, self.head_dim))
            q = apply_rope(q, cos[i], sin[i])  # (Q, heads, d)
            k_blk, v_blk = self.project_kv(x[i], cos[i], sin[i])  # (kv_heads, Q, d)
            k = torch.cat([ctx_kv[i][0], k_blk], dim=1)  # (kv_heads, C_b + Q, d)
            v = torch.cat([ctx_kv[i][1], v_blk], dim=1)
            outs.append(attend(q, k, v, None if masks is None else masks[i]))
        return self.o_proj(torch.stack(outs))  # (B, Q, H)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_kv: list[KV],
        masks: list[Mask] | None,
    ) -> torch.Tensor:
        # Context never passes this layer's input norm or MLP: only its k/v projections.
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_kv, masks)
        return x + self.mlp(self.post_attention_layernorm(x))


def _head_key(lm_head_weight: torch.Tensor) -> tuple[int, torch.dtype, torch.device]:
    """What a cached draft head was built from (the target's LM-head weight)."""
    return (lm_head_weight.data_ptr(), lm_head_weight.dtype, lm_head_weight.device)


class DFlashDrafter(nn.Module):
    """Drafter layers, fusion and the adaptive length head (saved under ``length_head.*``)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = Projection(cfg.num_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.length_head = LengthHead(h, cfg.length_head_hidden)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.head_trained = True  # False when loaded from a plain DFlash checkpoint
        self.draft_vocab: torch.Tensor | None = None  # (V_d,) target ids; None = all of them
        self.draft_vocab_info: dict[str, Any] = {}
        self._head: (
            tuple[tuple[int, torch.dtype, torch.device], torch.Tensor, Packed | None] | None
        ) = None

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the draft head behind: a cache built from the target's
        weights where the drafter serves (``prepare_inference``)."""
        state = super().__getstate__()
        state["_head"] = None
        return state

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def drafter_layers(self) -> list[DrafterLayer]:
        return [layer for layer in self.layers if isinstance(layer, DrafterLayer)]

    def set_draft_vocab(self, ids: torch.Tensor | None, info: dict[str, Any] | None = None) -> None:
        """Draft only from these target ids (rank order); None drafts from the whole vocabulary."""
        if ids is not None:
            assert ids.dim() == 1 and int(ids.max()) < self.cfg.vocab_size, "ids out of range"
            ids = ids.long().cpu()
        self.draft_vocab, self.draft_vocab_info, self._head = ids, dict(info or {}), None

    @property
    def draft_vocab_size(self) -> int:
        return self.cfg.vocab_size if self.draft_vocab is None else self.draft_vocab.numel()

    def draft_head(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The rows of the target's LM head this drafter scores: (V_d, H), kept between calls."""
        return self._draft_head(lm_head_weight)[0]

    def _draft_head(self, lm_head_weight: torch.Tensor) -> tuple[torch.Tensor, Packed | None]:
        key = _head_key(lm_head_weight)
        if self._head is None or self._head[0] != key:
            # a plain (non-inference) tensor: training saves it for the backward pass
            with torch.inference_mode(False), torch.no_grad():
                if self.draft_vocab is None:
                    head = lm_head_weight
                else:
                    head = lm_head_weight[self.draft_vocab.to(lm_head_weight.device)].clone()
            self._head = (key, head, None if self.training else pack(head, rows_scale=2))
        return self._head[1], self._head[2]

    def head_panels(self, lm_head_weight: torch.Tensor) -> torch.Tensor | None:
        """The draft head in the panels kernel's layout (``models/gemv.py``), where it has one
        (a drafter packed for serving on a CPU that packs panels)."""
        packed = self._draft_head(lm_head_weight)[1]
        return None if packed is None else packed.panels

    def draft_logits(self, states: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Block states (N, H) → logits over the draft vocabulary (N, V_d). A 2-D contiguous
        input keeps torch on one GEMM."""
        head, packed = self._draft_head(lm_head_weight)
        if packed is not None and not torch.is_grad_enabled():
            return linear(states.to(head.dtype), head, None, packed)
        return states.to(head.dtype) @ head.T

    def argmax_drafts(self, states: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Block states (N, H) → each row's draft: the target id of its best draft-vocabulary
        logit (N,). The argmax runs in float32: torch's bf16 argmax is a slow path (8 × 7 rows of
        a 16,384-row draft vocabulary, Zen 5: 1.71 ms against 0.31 with the copy, ~20% of a
        batch-8 drafter pass); the widening is exact, so the index is the same, first of ties
        included."""
        return self.to_target_ids(self.draft_logits(states, lm_head_weight).float().argmax(-1))

    def to_target_ids(self, draft_index: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices → target token ids (identity without a draft vocabulary)."""
        if self.draft_vocab is None:
            return draft_index
        return self.draft_vocab.to(draft_index.device)[draft_index]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (n, K·H) → context vectors c (n, H)."""
        assert features.shape[-1] == self.fc.in_features, "features must be K·H wide"
        return self.hidden_norm(self.fc(features))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Per layer keys/values of the context: features (n, K·H), positions (n,)."""
        c = self.fuse(features.to(self.dtype))  # (n, H)
        cos, sin = self.rotary(positions, c.dtype)
        return [layer.self_attn.project_kv(c, cos, sin) for layer in self.drafter_layers]

    def context_layers(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``context_kv`` stacked: features (n, K·H), positions (n,) → every layer's keys and
        values (layers, 2, kv_heads, n, d), as the drafter's cache lays them out."""
        kv = self.context_kv(features, positions)
        return torch.stack([torch.stack(pair) for pair in kv])

    def draft_states(
        self,
        block: torch.Tensor,  # (B, Q, H) target embeddings of [anchor, mask, …]
        positions: torch.Tensor,  # (B, Q) absolute positions
        ctx: BatchedContext,
    ) -> torch.Tensor:
        """Serving: the final normed block states (B, Q, H) of B requests at once (same result
        as ``forward`` with per-request contexts and no masks)."""
        q_len = block.shape[1]
        cos, sin = self.rotary(positions.reshape(-1), block.dtype)  # (B·Q, d)
        bias = ctx.bias(q_len)
        x = block
        for li, layer in enumerate(self.drafter_layers):
            # Context never passes a layer's input norm or MLP: only its k/v projections.
            h = layer.input_layernorm(x)
            x = x + layer.self_attn.batched(h, cos, sin, ctx.keys[li], ctx.values[li], bias)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def prepare_inference(
        self, lm_head_weight: torch.Tensor | None = None, like: DFlashDrafter | None = None
    ) -> None:
        """Serving only (never on a drafter that trains): packed weights for oneDNN and a
        fused gate|up; with ``lm_head_weight``, the draft head too, now rather than in the
        first drafting step (gathering, cloning and packing the draft vocabulary's rows took
        0.1 s there: a stall of every fresh engine's and every hot swap's first round). The
        head is ``like``'s (the version served before) where both score the same rows of the
        same weight: versions of one drafter share it instead of each packing its own."""
        for layer in self.drafter_layers:
            layer.mlp.fuse()
            a = layer.self_attn
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(a, proj).pack_weight()
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
            a.qkv_panels = gemv.pack_panels(qkv) if a.q_proj.packed is not None else None
        self.fc.pack_weight()
        self._head = None  # the draft head gets packed with the new dtype
        if lm_head_weight is None:
            return
        if like is not None and like._head is not None and self._same_rows(like, lm_head_weight):
            self._head = like._head
        else:
            self._draft_head(lm_head_weight)

    def _same_rows(self, other: DFlashDrafter, lm_head_weight: torch.Tensor) -> bool:
        """Whether ``other``'s draft head is the one this drafter would build."""
        assert other._head is not None
        if other._head[0] != _head_key(lm_head_weight) or other.training or self.training:
            return False
        mine, theirs = self.draft_vocab, other.draft_vocab
        if mine is None or theirs is None:
            return mine is theirs
        return torch.equal(mine, theirs)

    def forward(
        self,
        block: torch.Tensor,  # (B, Q, H) target embeddings of [anchor, mask, …]
        positions: torch.Tensor,  # (B, Q) absolute positions
        ctx_kv: list[list[KV]],  # [item][layer] context keys/values
        masks: list[Mask] | None = None,
    ) -> torch.Tensor:
        """Final normed block states (B, Q, H); the target LM head turns them into drafts."""
        b, q_len, _ = block.shape
        assert positions.shape == (b, q_len) and len(ctx_kv) == b
        cos, sin = self.rotary(positions.reshape(-1), block.dtype)
        cos, sin = cos.view(b, q_len, -1), sin.view(b, q_len, -1)  # (B, Q, d)
        x = block
        for li, layer in enumerate(self.layers):
            x = layer(x, cos, sin, [kv[li] for kv in ctx_kv], masks)
        return self.norm(x)


# -- checkpoint format ------------------------------------------------------------------------


def save_drafter(
    drafter: DFlashDrafter,
    folder: str | Path,
    metadata: dict[str, Any] | None = None,
    dtype: str | torch.dtype | None = None,
) -> Path:
    """Write a DFlash-format folder: ``config.json`` + ``model.safetensors`` (head included)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(drafter.cfg.to_hf_dict(), indent=2) + "\n")
    state = drafter.state_dict()
    if dtype is not None:
        dt = resolve_dtype(dtype)
        state = {k: v.to(dt) for k, v in state.items()}
    meta = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}}
    save_tensors(state, folder / "model.safetensors", meta)
    vocab_file = folder / dv.FILE
    if drafter.draft_vocab is not None:
        dv.save_draft_vocab(folder, drafter.draft_vocab, drafter.draft_vocab_info)
    elif vocab_file.is_file():
        vocab_file.unlink()  # an overwritten folder must not keep a stale vocabulary
    return folder


def load_drafter(
    folder: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu"
) -> DFlashDrafter:
    """Load a DFlash drafter folder. A plain DFlash checkpoint (no ``length_head.*``) loads with a
    freshly initialised head; ``drafter.head_trained`` says which."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a drafter folder needs a config.json")
    cfg = DrafterConfig.from_hf_dict(json.loads(path.read_text()))
    state = load_tensors(folder, resolve_dtype(dtype))
    drafter = DFlashDrafter(cfg).to(resolve_dtype(dtype))
    has_head = any(k.startswith(HEAD_PREFIX) for k in state)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [k for k in missing if has_head or not k.startswith(HEAD_PREFIX)]
    if missing or unexpected:
        raise ValueError(
            f"{folder}: weights do not match the DFlash layout of its config.json "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    for name, t in state.items():
        if torch.isnan(t).any() or torch.isinf(t).any():
            raise ValueError(f"{folder}: tensor {name} holds NaN or Inf values")
    drafter.head_trained = has_head
    vocab = dv.load_draft_vocab(folder, cfg.vocab_size)
    if vocab is not None:
        drafter.set_draft_vocab(*vocab)
    return drafter.to(device).eval()
