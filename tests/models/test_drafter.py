import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from adaflash.config import DrafterConfig, TargetConfig, default_target_layer_ids
from adaflash.models.drafter import DFlashDrafter, load_drafter, save_drafter

# The published z-lab DFlash layout (e.g. Qwen3-8B-DFlash-b16), at reduced sizes.
H, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, K = 48, 2, 4, 2, 16, 96, 96, 3


def published_config() -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "max_position_embeddings": 40960,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": 16,
        "num_target_layers": 36,
        "dflash_config": {"mask_token_id": 95, "target_layer_ids": [1, 17, 33]},
    }


def published_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = {}
    for i in range(LAYERS):
        p = f"layers.{i}."
        t[p + "self_attn.q_proj.weight"] = torch.randn(HEADS * HEAD_DIM, H, generator=g)
        t[p + "self_attn.k_proj.weight"] = torch.randn(KV_HEADS * HEAD_DIM, H, generator=g)
        t[p + "self_attn.v_proj.weight"] = torch.randn(KV_HEADS * HEAD_DIM, H, generator=g)
        t[p + "self_attn.o_proj.weight"] = torch.randn(H, HEADS * HEAD_DIM, generator=g)
        t[p + "self_attn.q_norm.weight"] = torch.ones(HEAD_DIM)
        t[p + "self_attn.k_norm.weight"] = torch.ones(HEAD_DIM)
        t[p + "mlp.gate_proj.weight"] = torch.randn(INTER, H, generator=g)
        t[p + "mlp.up_proj.weight"] = torch.randn(INTER, H, generator=g)
        t[p + "mlp.down_proj.weight"] = torch.randn(H, INTER, generator=g)
        t[p + "input_layernorm.weight"] = torch.ones(H)
        t[p + "post_attention_layernorm.weight"] = torch.ones(H)
    t["norm.weight"] = torch.ones(H)
    t["fc.weight"] = torch.randn(H, K * H, generator=g)
    t["hidden_norm.weight"] = torch.ones(H)
    return t


@pytest.fixture
def published(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(published_config()))
    save_file(published_tensors(), str(tmp_path / "model.safetensors"))
    return tmp_path


def test_loads_published_layout_with_right_shapes(published):
    d = load_drafter(published)
    assert d.cfg.target_layer_ids == (1, 17, 33) and d.cfg.mask_token_id == 95
    assert d.cfg.block_size == 16 and d.cfg.num_features == 3
    assert d.fc.weight.shape == (H, 3 * H)
    assert d.layers[1].self_attn.k_proj.weight.shape == (KV_HEADS * HEAD_DIM, H)
    assert d.layers[0].self_attn.q_norm.weight.shape == (HEAD_DIM,)
    assert not d.head_trained  # a plain DFlash checkpoint has no length head
    src = published_tensors()
    assert torch.equal(d.layers[1].mlp.down_proj.weight, src["layers.1.mlp.down_proj.weight"])


def test_round_trip_keeps_weights_and_head_under_its_prefix(published, tmp_path):
    d = load_drafter(published)
    torch.nn.init.normal_(d.length_head.proj.weight)
    out = save_drafter(d, tmp_path / "saved", metadata={"parent": "v0"})
    keys = set(load_file(str(out / "model.safetensors")))
    published_keys = set(published_tensors())
    assert keys - published_keys == {
        "length_head.proj.weight",
        "length_head.proj.bias",
        "length_head.out.weight",
        "length_head.out.bias",
    }
    assert published_keys <= keys  # a plain DFlash loader finds every key it expects
    raw = json.loads((out / "config.json").read_text())
    assert raw["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [1, 17, 33]}
    assert raw["block_size"] == 16 and raw["num_target_layers"] == 36
    again = load_drafter(out)
    assert again.head_trained
    for (ka, va), (kb, vb) in zip(d.state_dict().items(), again.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)


def test_refuses_corrupt_or_mismatched_weights(published):
    state = published_tensors()
    state["fc.weight"] = torch.randn(H, 2 * H)  # wrong K
    save_file(state, str(published / "model.safetensors"))
    with pytest.raises(Exception, match=r"size mismatch|do not match"):
        load_drafter(published)
    state = published_tensors()
    state["norm.weight"][0] = float("nan")
    save_file(state, str(published / "model.safetensors"))
    with pytest.raises(ValueError, match="NaN"):
        load_drafter(published)
    (published / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(Exception):  # noqa: B017 (safetensors raises its own error type)
        load_drafter(published)


def test_block_prediction_sees_context_and_is_bidirectional():
    """Slot outputs depend on the context and on later block slots (no causal mask)."""
    torch.manual_seed(0)
    tgt = TargetConfig("qwen3", VOCAB, H, INTER, 8, HEADS, KV_HEADS, HEAD_DIM)
    d = DFlashDrafter(
        DrafterConfig.for_target(tgt, num_layers=2, mask_token_id=95, block_size=4)
    ).eval()
    feats = torch.randn(5, d.cfg.num_features * H)
    ctx = d.context_kv(feats, torch.arange(5))
    block = torch.randn(1, 4, H)
    pos = torch.arange(5, 9)[None]
    base = d(block, pos, [ctx])
    other_ctx = d.context_kv(feats + 1.0, torch.arange(5))
    assert not torch.allclose(base, d(block, pos, [other_ctx]))
    changed = block.clone()
    changed[0, 3] += 1.0
    assert not torch.allclose(base[0, 0], d(changed, pos, [ctx])[0, 0])  # slot 0 sees slot 3


def test_default_feature_layers_match_dflash():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 1) == [15]


def test_batched_serving_pass_equals_the_per_request_pass():
    """draft_states (one batched pass, padded contexts, packed weights) computes what the
    per-request ``forward`` (the training path) computes: train and serve see the same drafter."""
    import copy

    from adaflash.models.drafter import BatchedContext

    torch.manual_seed(0)
    cfg = DrafterConfig(48, 96, 2, 4, 2, 12, VOCAB, 6, (1, 3), VOCAB - 1, block_size=4)
    drafter = DFlashDrafter(cfg).eval()
    g = torch.Generator().manual_seed(1)
    lengths = [7, 3, 12]
    ctx = [
        drafter.context_kv(torch.randn(n, 2 * 48, generator=g), torch.arange(n)) for n in lengths
    ]
    block = torch.randn(3, 4, 48, generator=g)
    positions = torch.tensor(lengths)[:, None] + torch.arange(4)
    with torch.no_grad():
        want = drafter(block, positions, ctx)
        got = drafter.draft_states(block, positions, BatchedContext.stack(ctx))
    assert torch.allclose(want, got, atol=1e-5)
    served = copy.deepcopy(drafter).to(torch.bfloat16)
    served.prepare_inference()
    ctx16 = [[(k.bfloat16(), v.bfloat16()) for k, v in kv] for kv in ctx]
    with torch.inference_mode():
        fast = served.draft_states(block.bfloat16(), positions, BatchedContext.stack(ctx16))
    assert torch.allclose(want, fast.float(), atol=0.1, rtol=0.05)
