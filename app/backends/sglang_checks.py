"""The SGLang backend (CUDA hosts, ``pip install 'adaflash[sglang]'``): what is checked here.

SGLang 0.5.x serves DFlash drafters with ``speculative_algorithm="DFLASH"``; AdaFlash's drafter
checkpoints are written in that layout (SPEC §2, §8). This module holds the parts that can be
checked on any machine: selecting the backend (refused at start-up without CUDA or without the
package, with a sentence that says why) and checking that a drafter folder loads as a plain
DFlash drafter under SGLang's loader rules. The serving side is ``app/sglang_engine.py``;
``LACKS`` lists what it cannot do that the embedded AdaFlash engine does.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from safetensors import safe_open

# Features of the embedded engine that SGLang's stock DFLASH worker does not provide.
LACKS = (
    "the adaptive length head and the ar/head policies (SGLang's DFLASH verifies the whole block "
    "every round; an `sglang.srt.plugins` speculative algorithm that reads length_head.* is not "
    "written yet), so the trainer's refitted head is not used while SGLang serves",
    "per-round records (SGLang reports per-request totals in meta_info['spec_*'] only), so the "
    "dashboard's per-slot acceptance curve stays empty",
    "token provenance colours in the chat view",
    "per-request draft and verify time (meta_info spec_draft_time_ms / spec_verify_time_ms are "
    "null)",
)

# Parameter names SGLang's DFlashDraftModel.load_weights maps (the fused qkv/gate_up are built
# from these); anything else in the file is ignored by its loader.
LAYER_KEYS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
TOP_KEYS = ("norm.weight", "fc.weight", "hidden_norm.weight")


class BackendUnavailable(ValueError):
    """The selected backend cannot run on this machine; the message says why."""


def require_sglang() -> None:
    """Refuse the SGLang backend unless CUDA and the ``sglang`` package are both present."""
    if not torch.cuda.is_available():
        raise BackendUnavailable(
            "the SGLang backend needs an NVIDIA GPU with CUDA, and this machine has none "
            "(torch.cuda.is_available() is False); use the default backend (--backend adaflash)"
        )
    if importlib.util.find_spec("sglang") is None:
        raise BackendUnavailable(
            "the SGLang backend needs the sglang package: pip install 'adaflash[sglang]'"
        )


def dflash_compat_problems(folder: str | Path) -> list[str]:
    """Why SGLang's DFLASH loader would refuse this drafter folder (empty list: it loads)."""
    folder = Path(folder)
    problems: list[str] = []
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return [f"config.json unreadable: {exc}"]
    dflash = cfg.get("dflash_config") or {}
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if key not in cfg:
            problems.append(f"config.json lacks {key}")
    if "mask_token_id" not in dflash and "mask_token" not in dflash:
        problems.append("dflash_config needs mask_token_id (or mask_token)")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append("SGLang's DFlash MLP supports only hidden_act = silu")
    layers = int(cfg.get("num_hidden_layers", 0))
    target_layers = dflash.get("num_target_layers", cfg.get("num_target_layers"))
    layer_ids = dflash.get("target_layer_ids")
    if (
        layer_ids is not None
        and target_layers is not None
        and any(not 0 <= int(i) < int(target_layers) for i in layer_ids)
    ):
        problems.append("dflash_config.target_layer_ids out of range for num_target_layers")
    try:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            keys = set(f.keys())
            fc_shape = tuple(f.get_slice("fc.weight").get_shape()) if "fc.weight" in keys else ()
    except Exception as exc:
        return [*problems, f"model.safetensors unreadable: {exc}"]
    wanted = {f"layers.{i}.{k}" for i in range(layers) for k in LAYER_KEYS} | set(TOP_KEYS)
    missing = sorted(wanted - keys)
    if missing:
        problems.append(f"weights missing: {missing[:6]}")
    hidden = int(cfg.get("hidden_size", 0))
    k = len(layer_ids) if layer_ids is not None else layers
    if fc_shape and fc_shape != (hidden, k * hidden):
        problems.append(f"fc.weight is {fc_shape}, SGLang expects {(hidden, k * hidden)}")
    extra = sorted(x for x in keys - wanted if not x.startswith("length_head."))
    if extra:
        problems.append(f"unexpected weights outside length_head.*: {extra[:6]}")
    return problems
