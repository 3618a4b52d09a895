import pytest

from adaflash.datagen.prompts import (
    Deduplicator,
    RequestFilter,
    normalize,
    stdlib_variants,
)


@pytest.mark.parametrize(
    ("text", "finish", "why"),
    [
        ("Can you help me plan a beach trip with my family?", "stop", None),
        ("Write a short poem about the sea.", "stop", None),
        ("I need a Python function that reverses a list.", "stop", None),
        ("Can you help me plan a beach trip with my family?", "length", "unfinished"),
        ("Hi", "stop", "too_short"),
        ("word " * 200, "stop", "too_long"),
        ("What is this?<|im_end|>\n<|im_start|>assistant", "stop", "template_text"),
        ("¿Puedes ayudarme con mi código en español, por favor?", "stop", "not_english"),
        ("BEGIN THE NAVBERRY ALEMA CURRENT ASLEEP GREETINGS?", "stop", "shouting"),
        ("The weather was nice yesterday and we went out.", "stop", "not_a_request"),
        ("Can you explain it in simple terms?", "stop", "needs_context"),
    ],
)
def test_request_filter_reasons(text, finish, why):
    assert RequestFilter().reason(text, finish) == why


def test_small_talk_admits_statements_but_not_garbage():
    f = RequestFilter()
    assert f.reason("The weather was nice yesterday and we went out.", "stop", False) is None
    assert f.reason("The weather was nice yesterday", "length", False) == "unfinished"


def test_normalize_drops_case_punctuation_and_accents():
    assert normalize("  Café?  What's UP!! ") == "cafe what s up"


def test_deduplicator_exact_near_and_distinct():
    d = Deduplicator()
    base = "Can you give me a simple recipe for a vegan chocolate cake with few ingredients?"
    d.add(base)
    assert d.seen(base.upper() + "  ") == "exact"
    near = "Can you give me a simple recipe for a vegan chocolate cake with very few ingredients?"
    assert d.seen(near) == "near"
    assert d.seen("How do I change a flat tyre on a mountain bike without tools?") is None
    assert len(d) == 1


def test_deduplicator_is_deterministic_across_instances():
    texts = [f"Tell me about topic number {i} in history and science" for i in range(50)]
    a, b = Deduplicator(), Deduplicator()
    verdicts = []
    for d in (a, b):
        out = []
        for t in texts:
            out.append(d.seen(t))
            if out[-1] is None:
                d.add(t)
        verdicts.append(out)
    assert verdicts[0] == verdicts[1]


def test_stdlib_variants_reuse_the_stub():
    prompt = 'Implement this Python function.\n\n```python\ndef f(x):\n    """Double x."""\n```'
    variants = stdlib_variants(prompt)
    assert [tag for tag, _ in variants] == ["complete", "tests", "usage"]
    assert all('def f(x):\n    """Double x."""' in text for _, text in variants)
    assert stdlib_variants("Explain what this Python function does.\n\n```python\nx\n```") == []
