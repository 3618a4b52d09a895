"""User turns for drafter training: Magpie prefixes, request filters and de-duplication.

Magpie (arXiv 2406.08464): an aligned chat model given its template only up to the user turn
(``<|im_start|>user\\n``) samples a realistic user request, so the prompts are in the target's own
distribution. A *steering* system prompt shifts what users it imagines (as Magpie-Pro does for
domains); the answer is always generated under the target's default system prompt, as served.
"""

from __future__ import annotations

import re
import unicodedata
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

# System prompts that steer the imagined user (None: the template's own default).
STEERS: dict[str, str | None] = {
    "general": None,
    "code": "You are a helpful AI assistant named SmolLM, trained by Hugging Face. "
    "You help users write, fix and understand Python code.",
    "writing": "You are a helpful AI assistant named SmolLM, trained by Hugging Face. "
    "You help users write and edit short texts: emails, stories, summaries and poems.",
    "knowledge": "You are a helpful AI assistant named SmolLM, trained by Hugging Face. "
    "You answer questions about science, history, everyday life and how things work.",
    "casual": "You are SmolLM, a friendly chatbot. People make small talk with you in short "
    "messages about themselves, their day, their opinions and your own.",
}
# Steers whose user turns are small talk: a statement is as good as a request there.
SMALL_TALK = ("casual",)

_REQUEST_CUES = re.compile(
    r"\b(can|could|would|will) you\b|\bplease\b|\bhow (do|can|to|does|should|would|is|are)\b|"
    r"^(what|why|how|when|where|which|who|is|are|do|does|should|explain|write|create|give|"
    r"tell|describe|list|suggest|help|compare|summari[sz]e|make|generate|provide|design|find|"
    r"recommend|translate|convert|calculate|implement|fix|debug|show)\b|"
    r"\bi (need|want|would like|am looking|'m looking|am trying|'m trying|have a question)\b|"
    r"\?",
    re.IGNORECASE | re.MULTILINE,
)
_CONTEXTLESS = re.compile(
    r"^\W*(can you |could you |please )?(explain|elaborate|continue)\b"
    r".{0,30}\b(it|that|this|more)\b",
    re.IGNORECASE,
)
_FUNCTION_WORDS = """a an the to of and or in on at for with from about by as is are was be do does
    did can could would will should i you my me your we our it this that what how why when which who
    not have has please help"""
_ENGLISH = frozenset(_FUNCTION_WORDS.split())
_SPECIAL = re.compile(
    r"<\|im_(start|end)\|>|<\|endoftext\|>|^(user|assistant|system)\s*$", re.MULTILINE
)


@dataclass(frozen=True)
class RequestFilter:
    """What a sampled user turn must look like to become a training prompt."""

    min_chars: int = 12
    max_words: int = 160
    min_ascii_letters: float = 0.95  # English prompts (the eval is English), with function words
    max_upper: float = 0.3

    def reason(self, text: str, finish_reason: str, request: bool = True) -> str | None:
        """Why ``text`` is refused (a short tag for the data card's counts), or None;
        ``request=False`` (small talk) admits statements too."""
        t = text.strip()
        if finish_reason != "stop":
            return "unfinished"
        if len(t) < self.min_chars:
            return "too_short"
        if len(t.split()) > self.max_words:
            return "too_long"
        if _SPECIAL.search(t):
            return "template_text"
        letters = [c for c in t if c.isalpha()]
        if not letters or sum(c.isascii() for c in letters) < self.min_ascii_letters * len(letters):
            return "not_english"
        words = normalize(t).split()
        if len(words) >= 4 and sum(w in _ENGLISH for w in words) < 0.1 * len(words):
            return "not_english"
        if sum(c.isupper() for c in letters) > self.max_upper * len(letters):
            return "shouting"
        if request and not _REQUEST_CUES.search(t):
            return "not_a_request"
        if len(t.split()) <= 8 and _CONTEXTLESS.search(t):
            return "needs_context"
        return None


def normalize(text: str) -> str:
    """Lower case, accents and punctuation dropped, whitespace collapsed: the exact-duplicate
    key."""
    t = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    return " ".join(re.sub(r"[^a-z0-9]+", " ", t).split())


def _shingles(norm: str, n: int = 3) -> set[int]:
    words = norm.split()
    grams = [" ".join(words[i : i + n]) for i in range(max(1, len(words) - n + 1))]
    return {zlib.crc32(g.encode()) for g in grams}


_PRIME = (1 << 61) - 1
_PERMS = [((0x9E3779B1 * (i + 1)) % _PRIME, (0x85EBCA77 * (i + 7)) % _PRIME) for i in range(32)]


@dataclass
class Deduplicator:
    """Exact (normalised text) and near-duplicate detection: MinHash over word 3-grams in LSH
    bands (``bands`` × ``rows`` = 32 hashes; a pair at Jaccard 0.6 meets in a band with
    probability 0.999), then the exact Jaccard of the candidates against ``threshold`` (a
    prompt is short: one changed word moves a third of its 3-grams). Deterministic (crc32,
    fixed permutations), so a resumed job drops the same prompts."""

    threshold: float = 0.6
    bands: int = 16
    rows: int = 2
    _exact: set[str] = field(default_factory=set)
    _buckets: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    _sets: list[set[int]] = field(default_factory=list)

    def _signature(self, sh: set[int]) -> list[int]:
        return [min((a * x + b) % _PRIME for x in sh) for a, b in _PERMS]

    def seen(self, text: str) -> str | None:
        """'exact' / 'near' when ``text`` duplicates something added before, else None."""
        norm = normalize(text)
        if norm in self._exact:
            return "exact"
        sh = _shingles(norm)
        sig = self._signature(sh)
        for band in range(self.bands):
            key = (band, hash(tuple(sig[band * self.rows : (band + 1) * self.rows])))
            for j in self._buckets.get(key, ()):
                other = self._sets[j]
                if len(sh & other) >= self.threshold * len(sh | other):
                    return "near"
        return None

    def add(self, text: str) -> None:
        norm = normalize(text)
        self._exact.add(norm)
        sh = _shingles(norm)
        sig = self._signature(sh)
        idx = len(self._sets)
        self._sets.append(sh)
        for band in range(self.bands):
            key = (band, hash(tuple(sig[band * self.rows : (band + 1) * self.rows])))
            self._buckets.setdefault(key, []).append(idx)

    def add_all(self, texts: Iterable[str]) -> None:
        for t in texts:
            self.add(t)

    def __len__(self) -> int:
        return len(self._sets)


STDLIB_TASKS = (
    ("complete", "Complete the following Python function.\n\n```python\n{stub}\n```"),
    ("tests", "Write unit tests with pytest for this Python function.\n\n```python\n{stub}\n```"),
    (
        "usage",
        "Show how to call this Python function, with a short example.\n\n```python\n{stub}\n```",
    ),
)


def stdlib_variants(implement_prompt: str) -> list[tuple[str, str]]:
    """Further tasks on the stub of an "Implement this Python function." prompt of
    ``workloads/code_train.jsonl``: (task tag, prompt) pairs; none for other prompts."""
    m = re.search(r"```python\n(.*)\n```", implement_prompt, re.DOTALL)
    if not implement_prompt.startswith("Implement this Python function.") or not m:
        return []
    return [(tag, tpl.format(stub=m.group(1))) for tag, tpl in STDLIB_TASKS]
