"""Tokenizer and chat template of the target, read from its folder (no hub access)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class Tokenizer:
    def __init__(self, tok: PreTrainedTokenizerBase) -> None:
        self.tok = tok

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        return cls(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.tok.eos_token_id
        return () if eos is None else (int(eos),)

    @property
    def turn_end_ids(self) -> tuple[int, ...]:
        """Tokens that end a chat turn: the template's end-of-turn marker where it has one
        (ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``), and EOS."""
        ids = set(self.eos_token_ids)
        for name in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
            tid = self.tok.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != self.tok.unk_token_id:
                ids.add(tid)
        return tuple(sorted(ids))

    def mask_token_id(self, vocab_size: int) -> int:
        """The drafter's mask token: the first embedding row no token uses (151669 for Qwen3),
        else a special token that never appears in chat traffic (SmolLM2's ``<empty_output>``,
        SPEC §2)."""
        if len(self.tok) < vocab_size:
            return len(self.tok)
        for name in ("<empty_output>", "<jupyter_script>"):
            tid = self.tok.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != self.tok.unk_token_id:
                return tid
        raise ValueError(
            "the vocabulary has no spare row and no known unused special token; "
            "pass --mask-token-id"
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, ready for the
        assistant's reply."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        out: Any = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out  # transformers 5 returns a dict
        return [int(t) for t in ids]

    def user_turn_prefix(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a conversation rendered up to where the next user turn's text starts
        (``…<|im_start|>user\\n`` for ChatML): what a Magpie sampler continues."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template")
        marker = "\x00user-turn\x00"
        text = self.tok.apply_chat_template(
            [*messages, {"role": "user", "content": marker}], tokenize=False
        )
        if not isinstance(text, str) or marker not in text:
            raise ValueError("the chat template does not render user text verbatim")
        return self.encode(text.split(marker)[0])
