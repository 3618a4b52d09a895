"""Small randomly initialised Hugging Face checkpoints built inside the tests.

Weights are drawn with a larger spread than HF's default (std 0.02) so that next-token logits
are well separated: greedy comparisons then test our arithmetic, not floating-point ties.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

VOCAB = 96


def hf_config(kind: str, *, tie: bool = False, layers: int = 4) -> LlamaConfig | Qwen3Config:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
    )
    if kind == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 5e4})
    if kind == "qwen3":
        return Qwen3Config(
            **common, head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 1e4}
        )
    raise ValueError(kind)


def build_checkpoint(
    folder: Path, kind: str = "llama", *, seed: int = 0, tie: bool = False, layers: int = 4
) -> Path:
    """Save a random HF model of ``kind`` to ``folder`` (fp32) and return the folder."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind, tie=tie, layers=layers))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15 if "embed" not in name else 1.0)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(folder)
    return folder


def hf_model(folder: Path):  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def add_tokenizer(folder: Path) -> Path:
    """A character-level tokenizer with exactly VOCAB entries and a chat template."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    chars = list(string.ascii_letters + string.digits + " .,!?'-:;()\n")
    vocab = {t: i for i, t in enumerate((specials + chars)[:VOCAB])}
    vocab.update({f"<extra_{i}>": i for i in range(len(vocab), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return folder


def build_serving_folders(root: Path, seed: int = 21) -> tuple[Path, Path]:
    """A tiny target (with tokenizer and chat template) and a matching random drafter."""
    from adaflash.config import DrafterConfig
    from adaflash.models.drafter import DFlashDrafter, save_drafter
    from adaflash.models.target import load_target

    target_dir = add_tokenizer(build_checkpoint(root / "tiny-target", "llama", seed=seed, layers=6))
    target = load_target(target_dir)
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=2, mask_token_id=VOCAB - 1)
    drafter_dir = save_drafter(DFlashDrafter(cfg), root / "tiny-drafter")
    return target_dir, drafter_dir
