import dataclasses

import pytest
import torch

from adaflash.config import DrafterConfig
from adaflash.distill import (
    accepted_drafts,
    block_attention_mask,
    block_states,
    distill_batch,
    distill_sequence,
    sample_anchors,
    simulate_acceptance,
)
from adaflash.models.drafter import DFlashDrafter
from adaflash.models.target import load_target
from adaflash.teacher_cache import teach
from adaflash.workloads import Trajectory
from tests.tiny import VOCAB, build_checkpoint


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    target = load_target(build_checkpoint(tmp_path_factory.mktemp("t"), "llama", seed=4, layers=6))
    torch.manual_seed(0)
    drafter = DFlashDrafter(
        DrafterConfig.for_target(target.cfg, num_layers=2, mask_token_id=VOCAB - 1, block_size=4)
    )
    tokens = torch.randint(3, 90, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    traj = Trajectory("t", "chat", tokens[:8], tokens[8:], "", "length")
    (teacher,) = teach(target, [traj], drafter.cfg.target_layer_ids)
    return target, drafter, teacher


def test_anchors_cover_response_positions_only():
    a = sample_anchors(5, 12, None)
    assert a.tolist() == list(range(5, 11))
    b = sample_anchors(5, 40, 7, torch.Generator().manual_seed(0))
    assert b.numel() == 7 and bool((b >= 5).all() and (b <= 38).all())
    assert torch.equal(b, b.sort().values)


def test_mask_context_strictly_before_anchor_and_blocks_isolated():
    m = block_attention_mask(torch.tensor([3, 6]), block_size=2, ctx_len=8).dense()
    assert m.shape == (4, 8 + 4)
    assert m[0, :8].tolist() == [True] * 3 + [False] * 5  # block at p=3 sees 0, 1, 2
    assert m[2, :8].tolist() == [True] * 6 + [False] * 2
    assert m[:2, 8:].tolist() == [[True, True, False, False]] * 2  # own block only
    assert m[2:, 8:].tolist() == [[False, False, True, True]] * 2


def test_blocks_never_see_context_at_or_after_their_anchor(parts):
    target, drafter, teacher = parts
    anchors = torch.tensor([10, 14])
    base = block_states(drafter, target, teacher, anchors)
    changed = dataclasses.replace(teacher, features=teacher.features.clone())
    changed.features[12:] += 5.0  # positions ≥ 12: after anchor 10, before anchor 14 sees 12,13
    after = block_states(drafter, target, changed, anchors)
    assert torch.allclose(base[0], after[0])  # block at 10 sees only 0 … 9
    assert not torch.allclose(base[1], after[1])  # block at 14 sees 12 and 13


def test_head_loss_never_reaches_drafter_and_draft_loss_never_reaches_head(parts):
    target, drafter, teacher = parts
    anchors = sample_anchors(teacher.prompt_len, teacher.tokens.numel(), None)
    out = distill_sequence(drafter, target, teacher, anchors)
    head = list(drafter.length_head.parameters())
    head_ids = set(map(id, head))
    body = [p for p in drafter.parameters() if id(p) not in head_ids]
    from_head = torch.autograd.grad(out.head_loss, body, allow_unused=True, retain_graph=True)
    assert all(g is None for g in from_head)
    from_draft = torch.autograd.grad(out.draft_loss, head, allow_unused=True, retain_graph=True)
    assert all(g is None for g in from_draft)
    to_head = torch.autograd.grad(out.head_loss, head, allow_unused=True, retain_graph=True)
    assert all(g is not None and g.abs().sum() > 0 for g in to_head)
    to_body = torch.autograd.grad(out.draft_loss, body, allow_unused=True)
    assert all(g is not None for g in to_body)  # every drafter tensor learns from ℓ_OPD


def test_accepted_drafts_counts_leading_matches():
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [9, 2, 3], [1, 2, 3]])
    recorded = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 0]])
    valid = torch.tensor([[True, True, True]] * 3 + [[True, True, False]])
    assert accepted_drafts(drafts, recorded, valid).tolist() == [3, 1, 0, 2]


def test_simulated_acceptance_counts_one_round_per_anchor(parts):
    target, drafter, teacher = parts
    tokens = teacher.tokens.tolist()
    c = simulate_acceptance(drafter, target, [(tokens, 8)], anchors_per_seq=None)
    assert c.rounds == len(tokens) - 1 - 8
    assert 1.0 <= c.accept_len <= 4.0


def test_a_batch_of_sequences_learns_exactly_what_each_alone_does(parts):
    """Padding to the most blocks and one pass for all must change no loss, count or gradient."""
    target, drafter, _ = parts
    g = torch.Generator().manual_seed(3)
    trajs = [
        Trajectory(
            f"s{n}",
            "chat",
            torch.randint(3, 90, (p,), generator=g).tolist(),
            torch.randint(3, 90, (n,), generator=g).tolist(),
            "",
            "length",
        )
        for p, n in ((8, 12), (5, 4), (11, 9))
    ]
    seqs = teach(target, trajs, drafter.cfg.target_layer_ids)
    anchors = [sample_anchors(s.prompt_len, s.tokens.numel(), None) for s in seqs]
    assert len({a.numel() for a in anchors}) == 3  # unequal: two items are padded

    def grads(loss):
        drafter.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in drafter.parameters() if p.grad is not None]

    together = distill_batch(drafter, target, seqs, anchors)
    g_together = grads(torch.stack([o.loss for o in together]).mean())
    alone = [distill_sequence(drafter, target, s, a) for s, a in zip(seqs, anchors, strict=True)]
    g_alone = grads(torch.stack([o.loss for o in alone]).mean())
    for t, a in zip(together, alone, strict=True):
        assert torch.allclose(t.loss, a.loss, atol=1e-5)
        assert torch.allclose(t.head_loss, a.head_loss, atol=1e-6)
        assert torch.equal(t.accepted, a.accepted)
        assert torch.allclose(t.a_hat, a.a_hat, atol=1e-6)
    assert len(g_together) == len(g_alone) > 0
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(g_together, g_alone, strict=True))
