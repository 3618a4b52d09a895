"""Typed, frozen configuration for the target, the drafter and the engine.

Defaults are the paper's values (AdaFlash, arXiv 2607.19223, §3 and App. B.1) unless a line says
otherwise. Every config validates itself in ``__post_init__`` and refuses bad combinations with
a sentence that says what to change.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, get_args

SUPPORTED_TARGETS = ("llama", "qwen3")
Policy = Literal["ar", "fixed", "head", "cost"]
POLICIES: tuple[str, ...] = get_args(Policy)
DEFAULT_BLOCK_SIZE = 16  # k, drafted tokens per block (SPEC §2)


def _rope_theta(raw: dict[str, Any]) -> float:
    """transformers 5 writes ``rope_parameters``; older folders write ``rope_theta``."""
    params = raw.get("rope_parameters") or {}
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(
            f"rope type {kind!r} is not supported; AdaFlash implements 'default' and 'llama3' "
            "RoPE. Use a checkpoint with one of those or add the scaling to models/layers.py."
        )
    params["rope_type"] = "llama3"
    return params


@dataclass(frozen=True)
class TargetConfig:
    """Shape of a Llama- or Qwen3-family decoder, read from a Hugging Face ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_TARGETS:
            raise ValueError(
                f"target model_type {self.model_type!r} is not supported; AdaFlash runs "
                f"{', '.join(SUPPORTED_TARGETS)} decoders."
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises q and k per head before RoPE; Llama does not."""
        return self.model_type == "qwen3"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TargetConfig:
        model_type = raw.get("model_type", "")
        if raw.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported; set use_sliding_window")
        heads = int(raw["num_attention_heads"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            rope_scaling=_rope_scaling(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> TargetConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a target folder needs a config.json")
        return cls.from_dict(json.loads(path.read_text()))


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Feature layers spread evenly over 1 … L−3 (DFlash reference; SPEC §2).

    Example: 36 target layers, 5 features → [1, 9, 17, 25, 33].
    """
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_features - 1)) for i in range(num_features)]


@dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter: Qwen3-style layers plus the fusion ``fc`` and the block settings."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = DEFAULT_BLOCK_SIZE
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    length_head_hidden: int = 256  # H′ of the adaptive length head (SPEC §3)

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError("block_size must be at least 2 (anchor + one draft slot)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary")
        if any(not 0 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise ValueError("target_layer_ids must index layers of the target")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def num_features(self) -> int:
        """K: how many target layers feed the drafter context."""
        return len(self.target_layer_ids)

    @classmethod
    def for_target(
        cls,
        target: TargetConfig,
        *,
        num_layers: int = 3,
        mask_token_id: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_features: int | None = None,
        intermediate_size: int | None = None,
    ) -> DrafterConfig:
        """A drafter shaped like the target's layers (H equals the target hidden size)."""
        k = num_features or num_layers
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_layers=num_layers,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            num_target_layers=target.num_layers,
            target_layer_ids=tuple(default_target_layer_ids(target.num_layers, k)),
            mask_token_id=mask_token_id,
            block_size=block_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The published DFlash ``config.json`` layout: a Qwen3 config plus DFlash keys."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "adaflash": {"length_head_hidden": self.length_head_hidden},
        }

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> DrafterConfig:
        dflash = raw.get("dflash_config") or {}
        if "mask_token_id" not in dflash or "target_layer_ids" not in dflash:
            raise ValueError(
                "not a DFlash drafter config: config.json needs dflash_config.mask_token_id "
                "and dflash_config.target_layer_ids"
            )
        heads = int(raw["num_attention_heads"])
        extra = raw.get("adaflash") or {}
        return cls(
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            vocab_size=int(raw["vocab_size"]),
            num_target_layers=int(raw["num_target_layers"]),
            target_layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]),
            mask_token_id=int(dflash["mask_token_id"]),
            block_size=int(raw.get("block_size", DEFAULT_BLOCK_SIZE)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            rope_scaling=_rope_scaling(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            length_head_hidden=int(extra.get("length_head_hidden", 256)),
        )

    def check_target(self, target: TargetConfig) -> None:
        """Refuse a drafter that was built for a different target."""
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden size {self.hidden_size} ≠ target {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab {self.vocab_size} ≠ target {target.vocab_size}")
        if self.num_target_layers != target.num_layers:
            problems.append(
                f"built for {self.num_target_layers} target layers, target has {target.num_layers}"
            )
        if problems:
            raise ValueError("drafter does not match the target: " + "; ".join(problems))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. temperature 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be ≥ 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for the sampling fields it leaves out, as vLLM and SGLang do it:
    the operator's flags, else the model's ``generation_config.json``, else the OpenAI API's
    own defaults (temperature 1, top_p 1, no top-k)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    source: str = "OpenAI API defaults (the model folder has none)"

    @classmethod
    def resolve(
        cls,
        folder: str | Path,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
    ) -> SamplingDefaults:
        path = Path(folder) / "generation_config.json"
        gen: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
        model = {k: gen[k] for k in ("temperature", "top_p", "top_k") if gen.get(k) is not None}
        flags = {
            k: v
            for k, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k))
            if v is not None
        }
        parts = []
        if flags:
            parts.append("server flags (" + ", ".join(flags) + ")")
        if set(model) - set(flags):
            parts.append(
                "generation_config.json (" + ", ".join(sorted(set(model) - set(flags))) + ")"
            )
        merged = {**model, **flags}
        out = cls(
            temperature=float(merged.get("temperature", 1.0)),
            top_p=float(merged.get("top_p", 1.0)),
            top_k=int(merged.get("top_k", 0) or 0),
            source=" and ".join(parts) or cls.source,
        )
        SamplingParams(temperature=out.temperature, top_p=out.top_p, top_k=out.top_k)  # checks
        return out


SUFFIX_SCOPES = ("global", "request", "off")  # ``EngineConfig.suffix``


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling and verification settings of the serving engine (SPEC §5)."""

    policy: Policy = "cost"  # why it is the default: README, Results
    gamma: float = 1.0  # load-scaling factor γ of k̂ = clamp(⌊γ·â·k⌋, 1, k); paper best 1.0
    max_running_requests: int = 32
    max_batch_tokens: int = 512  # budget of verification tokens per packed pass
    max_prefill_tokens: int = 512  # prompt tokens prefilled per step (chunked beyond that)
    ema_beta: float = 0.3  # β of N̂ ← (1−β)N̂ + βN
    max_context: int | None = None  # defaults to the target's max_position_embeddings
    dtype: str = "float32"
    num_threads: int | None = None
    # single-request steps through compiled graphs (models/decode_graph.py), compiled in the
    # background; ADAFLASH_COMPILE=0 switches it off whatever this says
    compile: bool = False
    # suffix drafts (engine/suffix.py), which the ``cost`` policy weighs beside the drafter's:
    # "global" (a request's own tokens and recently served sequences), "request" (its own
    # alone: no request's speed depends on another's text), "off"
    suffix: str = "global"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if not 0.0 < self.ema_beta < 1.0:
            raise ValueError(f"ema_beta must be in (0, 1), got {self.ema_beta}")
        if self.max_running_requests < 1 or self.max_batch_tokens < 1:
            raise ValueError("max_running_requests and max_batch_tokens must be ≥ 1")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be ≥ 1")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.suffix not in SUFFIX_SCOPES:
            raise ValueError(f"suffix must be one of {SUFFIX_SCOPES}, got {self.suffix!r}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DistillConfig:
    """Drafter + length-head training (SPEC §3–4; paper App. B.1)."""

    loss: Literal["opd", "osd"] = "opd"  # osd = forward-KL baseline
    alpha: float = 0.8  # weight of the hard CE term in ℓ_OPD
    delta: float = 0.01  # entry-wise clip of the reverse KL
    drafter_lr: float = 3e-4
    head_lr: float = 2e-4
    weight_decay: float = 0.0
    anchors_per_seq: int = 32  # reference: 512 on GPU; fewer on a CPU
    epochs: int = 2  # passes over the new trajectories per training round
    batch_size: int = 1
    accumulate: int = 2  # effective batch 2 (paper)
    grad_clip: float = 1.0
    bf16_autocast: bool = False  # bf16 matmuls, fp32 weights (on a CPU: where it is faster)
    max_steps: int = -1
    max_minutes: float | None = None
    seed: int = 0
    # learning rate: linear warmup over this fraction of the run, then cosine decay to
    # min_lr_ratio × lr ("constant" keeps lr); the run's length is its steps or its minutes
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    warmup_fraction: float = 0.03
    min_lr_ratio: float = 0.1
    supervised_slots: int | None = None  # teach slots 1 … n only (None: all k−1)
    slot_decay: float = 7.0  # w_i = exp(−(i−1)/decay) (SPEC §4)
    top_k: int = 32  # teacher tokens kept per position (the tail mass covers the rest)
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"  # Lightning strategy (multi-GPU / node)
    devices: int | str = "auto"
    num_nodes: int = 1

    def __post_init__(self) -> None:
        if self.strategy not in ("auto", "ddp", "fsdp"):
            raise ValueError(f"strategy must be auto, ddp or fsdp, got {self.strategy!r}")
        if self.num_nodes < 1:
            raise ValueError("num_nodes must be ≥ 1")
        if self.loss not in ("opd", "osd"):
            raise ValueError(f"loss must be 'opd' or 'osd', got {self.loss!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.delta <= 0:
            raise ValueError(f"delta must be > 0, got {self.delta}")
        if self.anchors_per_seq < 1 or self.epochs < 1 or self.batch_size < 1:
            raise ValueError("anchors_per_seq, epochs and batch_size must be ≥ 1")
        if self.lr_schedule not in ("cosine", "constant"):
            raise ValueError(f"lr_schedule must be cosine or constant, got {self.lr_schedule!r}")
        if not 0.0 <= self.warmup_fraction < 1.0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError("warmup_fraction must be in [0, 1) and min_lr_ratio in [0, 1]")
        if self.supervised_slots is not None and self.supervised_slots < 1:
            raise ValueError("supervised_slots must be ≥ 1 (or None for every slot)")
        if self.slot_decay <= 0 or self.top_k < 1:
            raise ValueError("slot_decay must be > 0 and top_k ≥ 1")
