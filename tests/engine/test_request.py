"""The drafter context a speculative engine keeps: each request's target features, position by
position, exactly those of its committed tokens, however they were committed (prefill chunks,
plain steps, verified rounds with accepted drafts) and however many requests a step held."""

import pytest
import torch

from adaflash.config import EngineConfig, SamplingParams
from adaflash.engine import request as request_module
from adaflash.engine.request import FeatureStore
from adaflash.models.target import PackedBatch
from tests.engine.conftest import random_drafter
from tests.engine.oracle import OracleEngine, PinnedCost, greedy_continuation

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [30], [40, 41, 42, 43, 44]]


def test_a_reserved_feature_pool_holds_the_context_up_to_its_byte_cap(monkeypatch):
    """Room for every position a request may reach, from the start, up to ``RESERVE_BYTES``
    (then it grows as before); never fewer than 256 positions."""
    store = FeatureStore.reserve(8, torch.bfloat16, rows=4, positions=1000)
    assert store.data.shape == (4, 1000, 8)
    monkeypatch.setattr(request_module, "RESERVE_BYTES", 4 * 8 * 2 * 300)  # 300 positions' worth
    assert FeatureStore.reserve(8, torch.bfloat16, rows=4, positions=1000).data.shape[1] == 300
    assert FeatureStore.reserve(8, torch.float32, rows=4, positions=1000).data.shape[1] == 256
    store = FeatureStore.reserve(8, torch.bfloat16, rows=4, positions=100)
    assert store.data.shape[1] == 256
    slot = store.allocate()
    store.append(slot, torch.ones(400, 8, dtype=torch.bfloat16))  # past it: the pool grows
    assert store.data.shape[1] >= 400 and store.view(slot).shape == (400, 8)


@pytest.mark.parametrize("one_copy_min", [2, request_module.ONE_COPY_MIN])
def test_append_many_equals_appends_one_slot_at_a_time(monkeypatch, one_copy_min):
    """Across growth of the pool (capacity 4 → more) and after a free moved a row; with 2 the
    4 and 3 slots here go in one copy, with the default one at a time."""
    monkeypatch.setattr(request_module, "ONE_COPY_MIN", one_copy_min)
    g = torch.Generator().manual_seed(0)
    one, many = (
        FeatureStore(3, torch.float32, capacity=4, rows=2),
        FeatureStore(3, torch.float32, capacity=4, rows=2),
    )
    slots = [(one.allocate(), many.allocate()) for _ in range(4)]
    for step in range(6):
        if step == 3:  # the first slot ends: the last row moves into its place
            a, b = slots.pop(0)
            one.free(a)
            many.free(b)
        counts = [(step + i) % 3 + 1 for i in range(len(slots))]
        src = torch.randn(sum(counts) + 2, 3, generator=g)  # 2 rows nobody keeps
        parts, first = [], 1
        for (a, b), n in zip(slots, counts, strict=True):
            one.append(a, src[first : first + n])
            parts.append((b, first, n))
            first += n
        many.append_many(parts, src)
    for a, b in slots:
        assert one.length[a] == many.length[b] > 4
        torch.testing.assert_close(many.view(b), one.view(a))


def test_append_many_holds_rows_back_until_read_freed_or_enough_wait(monkeypatch):
    """Steps' rows wait (lengths count them) and are written in one copy when a slot is read,
    when one is freed (rows move), or before the step that would make ``DEFER_ROWS`` wait; a
    copy that fails keeps them waiting and records nothing of the step that triggered it."""
    monkeypatch.setattr(request_module, "DEFER_ROWS", 8)
    store = FeatureStore(2, torch.float32, capacity=4, rows=2)
    a, b = store.allocate(), store.allocate()
    store.data.fill_(-1.0)  # the pool is never cleared: mark what nothing wrote

    def step(i: int) -> torch.Tensor:  # rows 1 and 2 kept: a's and b's
        src = torch.full((3, 2), float(i))
        src[2] += 0.5
        store.append_many([(a, 1, 1), (b, 2, 1)], src)
        return src

    step(1)
    assert store.length == {a: 1, b: 1} and store.deferred_rows == 2
    assert (store.data == -1.0).all()  # nothing written yet
    assert store.view(a).tolist() == [[1.0, 1.0]] and store.deferred_rows == 0
    for i in (2, 3, 4):
        step(i)
    assert store.deferred_rows == 6
    step(5)  # 6 + 2 would reach 8: the six are written first, these two wait
    assert store.deferred_rows == 2
    assert store.data[store.rows.row[b], :4, 0].tolist() == [1.5, 2.5, 3.5, 4.5]
    calls = []

    def broken(positions: int) -> None:
        calls.append(positions)
        raise MemoryError("no room")

    for i in (6, 7):
        step(i)
    assert store.deferred_rows == 6
    monkeypatch.setattr(store, "_fit", broken)
    with pytest.raises(MemoryError):
        step(8)
    assert calls and store.length == {a: 7, b: 7} and store.deferred_rows == 6
    monkeypatch.undo()
    store.free(a)  # b moves into a's row: what waited is written first
    assert store.deferred_rows == 0 and store.rows.row[b] == 0
    assert store.view(b)[:, 0].tolist() == [1.5 + i for i in range(7)]


@pytest.mark.parametrize(
    ("policy", "copy"), [("fixed", "one"), ("cost", "one"), ("fixed", "fallback")]
)
def test_the_drafter_context_holds_the_features_of_every_committed_position(
    tiny_llama, monkeypatch, caplog, policy, copy
):
    """Snapshots each request's features as it finishes, and checks them against one target
    pass over its prompt and reply (every committed position: all but the last token). With
    ``fallback`` the step's one copy raises, and the features go in request by request."""
    _, target, _ = tiny_llama
    monkeypatch.setattr(request_module, "ONE_COPY_MIN", 2)  # 4 requests: the one copy
    copies = []
    if copy == "fallback":

        def broken(self, parts, src):
            copies.append(len(parts))
            raise RuntimeError("boom")

        monkeypatch.setattr(FeatureStore, "append_many", broken)
    drafter = random_drafter(target)
    cfg = EngineConfig(policy=policy, max_batch_tokens=40, max_prefill_tokens=8)
    engine = OracleEngine(target, drafter, cfg, continuation=greedy_continuation(target))
    if policy == "cost":
        engine.cost = PinnedCost()
    kept: dict[str, torch.Tensor] = {}
    finish = engine._finish

    def snapshot(r):
        assert r.features is not None and engine.features is not None
        kept[r.id] = engine.features.view(r.features).clone()
        finish(r)

    engine._finish = snapshot  # type: ignore[method-assign]
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert all(r.finish_reason == "length" for r in results)
    assert engine.stats.request_errors == 0
    fell_back = "request by request" in caplog.text
    if copy == "fallback":
        assert copies and max(copies) > 1  # several requests' copy failed: each went alone
    assert fell_back == (copy == "fallback")
    if policy == "fixed":  # rounds that accepted several drafts appended several rows
        assert engine.counters.accept_len > 2.0, engine.counters.summary()
    layers = tuple(drafter.cfg.target_layer_ids)
    for prompt, res in zip(PROMPTS, results, strict=True):
        seq = prompt + list(res.output_ids)[:-1]
        cache = target.new_cache()
        slot = cache.allocate()
        with torch.inference_mode():
            out = target(
                PackedBatch(torch.tensor(seq), (slot,), (len(seq),)), cache, capture_layers=layers
            )
        assert out.features is not None
        torch.testing.assert_close(kept[res.request_id], out.features, atol=1e-4, rtol=1e-4)


def test_the_engine_reserves_a_row_per_request_it_may_run(tiny_llama, monkeypatch):
    """Target KV, drafter KV and features hold ``max_running_requests`` rows from the start, so
    a full batch never grows them (each growth of a pool copied it into fresh memory mid-step);
    the KV pools' capacity still grows where a request needs it, and the features (never
    cleared: only the pages written are backed) hold ``max_context`` positions from the start."""
    _, target, _ = tiny_llama
    cfg = EngineConfig(policy="fixed", max_running_requests=3, max_batch_tokens=40)
    engine = OracleEngine(
        target, random_drafter(target), cfg, continuation=greedy_continuation(target)
    )
    assert engine.drafting is not None and engine.features is not None
    pools = {
        "target": engine.cache,
        "drafter": engine.drafting.cache,
        "features": engine.features,
    }
    assert {name: pool.data.shape[0] for name, pool in pools.items()} == dict.fromkeys(pools, 3)
    assert engine.features.data.shape[1] == engine.max_context
    grown: list[tuple[str, int, int]] = []

    def watched(name, resize):
        def grow(rows: int, capacity: int) -> None:
            grown.append((name, rows, capacity))
            resize(rows, capacity)

        return grow

    for name, pool in pools.items():
        monkeypatch.setattr(pool, "_resize", watched(name, pool._resize))
    long = [5 + i % 80 for i in range(300)]  # past the initial capacity of 256 positions
    results = engine.generate(
        [*PROMPTS[:2], long], SamplingParams(max_new_tokens=8, ignore_eos=True)
    )
    assert all(r.finish_reason == "length" for r in results)
    assert grown and all(rows == 3 for _, rows, _ in grown)  # capacity only …
    assert "features" not in {name for name, _, _ in grown}  # … of the KV pools
