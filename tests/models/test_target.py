import pytest
import torch

from adaflash.models.target import PackedBatch, load_target
from tests.tiny import VOCAB, build_checkpoint, hf_model


@pytest.fixture(
    scope="module",
    params=[("llama", False), ("llama", True), ("qwen3", False)],
    ids=["llama", "llama-tied", "qwen3"],
)
def ckpt(request, tmp_path_factory):
    kind, tie = request.param
    return build_checkpoint(tmp_path_factory.mktemp(kind), kind, seed=3, tie=tie)


def test_logits_match_hf_fp32(ckpt):
    ours, ref = load_target(ckpt, "float32"), hf_model(ckpt)
    ids = torch.randint(0, VOCAB, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits[0]  # (23, V)
    cache = ours.new_cache()
    slot = cache.allocate()
    got = ours(PackedBatch(ids[0], (slot,), (23,)), cache).logits
    assert got is not None
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def test_packed_ragged_batch_equals_single_requests_with_cache(ckpt):
    """Three requests with different prompt and step lengths, packed, match one-by-one runs."""
    ours, ref = load_target(ckpt, "float32"), hf_model(ckpt)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 17, 9)]
    splits = [(3, 2), (10, 7), (1, 8)]  # (prefill, then verify-sized second chunk)
    cache = ours.new_cache(initial_capacity=4)  # forces the cache to grow
    slots = tuple(cache.allocate() for _ in seqs)
    first = PackedBatch(
        torch.cat([s[:a] for s, (a, _) in zip(seqs, splits, strict=True)]),
        slots,
        tuple(a for a, _ in splits),
    )
    ours(first, cache, logits="none")
    second = PackedBatch(
        torch.cat([s[a:] for s, (a, _) in zip(seqs, splits, strict=True)]),
        slots,
        tuple(b for _, b in splits),
    )
    out = ours(second, cache, capture_layers=(0, 2))
    assert out.logits is not None and out.features is not None
    assert out.features.shape == (sum(b for _, b in splits), 2 * 64)
    off = 0
    for s, (a, b) in zip(seqs, splits, strict=True):
        with torch.no_grad():
            r = ref(s[None], output_hidden_states=True)
        assert torch.allclose(out.logits[off : off + b], r.logits[0, a:], atol=1e-4)
        feats = torch.cat([r.hidden_states[1][0, a:], r.hidden_states[3][0, a:]], dim=-1)
        assert torch.allclose(out.features[off : off + b], feats, atol=1e-4)
        off += b


def test_truncate_then_continue_matches_fresh_run(ckpt):
    """Rejected drafts dropped from the cache leave no trace on later positions."""
    ours = load_target(ckpt, "float32")
    ids = torch.arange(3, 15)
    cache = ours.new_cache()
    slot = cache.allocate()
    ours(PackedBatch(ids[:6], (slot,), (6,)), cache, logits="none")
    ours(PackedBatch(torch.tensor([50, 51, 52, 53]), (slot,), (4,)), cache, logits="none")
    cache.truncate(slot, 6)
    got = ours(PackedBatch(ids[6:], (slot,), (6,)), cache).logits
    fresh_cache = ours.new_cache()
    fresh = fresh_cache.allocate()
    want = ours(PackedBatch(ids, (fresh,), (12,)), fresh_cache).logits
    assert got is not None and want is not None
    assert torch.allclose(got, want[6:], atol=1e-4)


def test_bf16_load_runs_and_roughly_agrees(ckpt):
    ours32, ours16 = load_target(ckpt, "float32"), load_target(ckpt, "bfloat16")
    assert ours16.dtype == torch.bfloat16
    ids = torch.arange(1, 11)
    outs = []
    for m in (ours32, ours16):
        c = m.new_cache()
        s = c.allocate()
        outs.append(m(PackedBatch(ids, (s,), (10,)), c).logits)
    cos = torch.nn.functional.cosine_similarity(outs[0], outs[1], dim=-1)
    assert cos.min() > 0.98


def test_sharded_checkpoint_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    src = build_checkpoint(tmp_path / "one", "qwen3", seed=5)
    model = AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, b = load_target(src), load_target(tmp_path / "sharded")
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)


def test_refuses_unknown_architecture(tmp_path):
    import json

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )
    )
    with pytest.raises(ValueError, match="not supported"):
        load_target(tmp_path)


def test_pool_rows_move_on_free_and_batched_attention_matches_single_requests(ckpt):
    """The KV pool compacts rows when a request leaves; the batched decode/verify attention over
    the pool (rows not in the batch masked out) gives the same logits as one request alone."""
    ours = load_target(ckpt)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 90, (n,), generator=g) for n in (9, 40, 5, 14)]
    cache = ours.new_cache(initial_capacity=8)
    slots = [cache.allocate() for _ in seqs]
    # prefill all (the 40-token one attends alone, the others in the batched call)
    ours(PackedBatch(torch.cat(seqs), tuple(slots), tuple(len(s) for s in seqs)), cache)
    cache.free(slots[0])  # the last row moves into row 0
    assert cache.row(slots[3]) == 0 and len(cache) == 3
    # a verify step for two of the three (slot 2 sits out), 3 and 1 new tokens
    new = [torch.tensor([11, 12, 13]), torch.tensor([21])]
    out = ours(PackedBatch(torch.cat(new), (slots[1], slots[3]), (3, 1)), cache).logits
    for seq, add, rows in ((seqs[1], new[0], out[:3]), (seqs[3], new[1], out[3:])):
        alone = ours.new_cache()
        s = alone.allocate()
        want = ours(PackedBatch(torch.cat([seq, add]), (s,), (len(seq) + len(add),)), alone)
        assert torch.allclose(rows, want.logits[len(seq) :], atol=1e-4)


def test_fused_and_packed_bf16_target_matches_the_plain_one(ckpt):
    """Inference layout (fused q|k|v and gate|up, oneDNN-packed bf16 weights) against the
    plain layout of the same bf16 checkpoint: same greedy tokens, logits within bf16 noise."""
    plain = load_target(ckpt, "bfloat16", fuse=False)
    fast = load_target(ckpt, "bfloat16")
    prompt = torch.tensor([5, 9, 13, 17, 21, 25])
    outs = []
    for model in (plain, fast):
        cache = model.new_cache()
        slot = cache.allocate()
        ids, toks, logits = prompt, [], []
        for _ in range(12):
            out = model(PackedBatch(ids, (slot,), (len(ids),)), cache, logits="last").logits
            logits.append(out[0])
            ids = out.argmax(-1)
            toks.append(int(ids))
        outs.append((toks, torch.stack(logits)))
    assert outs[0][0] == outs[1][0]
    assert torch.allclose(outs[0][1], outs[1][1], atol=0.05, rtol=0.02)
