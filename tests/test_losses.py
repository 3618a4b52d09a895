"""The losses pinned to hand-computed values."""

import math

import torch

from adaflash.losses import opd_loss, osd_loss, slot_weights, weighted_slot_mean


def softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


Q = [2.0, 0.0, -1.0]
P = [0.0, 1.5, -0.5]


def test_opd_matches_hand_computation():
    q, p = softmax(Q), softmax(P)
    hard = -math.log(q[1])  # the target's top-1 is token 1, not the drafter's
    entries = [q[y] * math.log(q[y] / p[y]) for y in range(3)]
    delta = 0.05
    rkl = sum(min(e, delta) for e in entries)
    expected = 0.8 * hard + 0.2 * rkl
    got = opd_loss(torch.tensor([Q]), torch.tensor([P]), alpha=0.8, delta=delta)
    assert math.isclose(float(got), expected, rel_tol=1e-5)


def test_clip_acts_per_vocabulary_entry_not_on_the_sum():
    q, p = softmax(Q), softmax(P)
    entries = [q[y] * math.log(q[y] / p[y]) for y in range(3)]
    assert entries[0] > 0.05 and min(entries) < 0  # one big positive entry, a negative one
    delta = 0.05
    per_entry = sum(min(e, delta) for e in entries)
    on_sum = min(sum(entries), delta)
    assert not math.isclose(per_entry, on_sum)
    got = opd_loss(torch.tensor([Q]), torch.tensor([P]), alpha=0.0, delta=delta)
    assert math.isclose(float(got), per_entry, rel_tol=1e-5)


def test_clipped_entries_carry_no_gradient_and_teacher_none():
    q_logits = torch.tensor([Q], requires_grad=True)
    p_logits = torch.tensor([P], requires_grad=True)
    opd_loss(q_logits, p_logits, alpha=0.0, delta=1e-9).backward()
    # every positive entry is clipped; only the negative entries move q
    assert q_logits.grad is not None and p_logits.grad is None


def test_osd_is_forward_kl():
    q, p = softmax(Q), softmax(P)
    expected = sum(p[y] * math.log(p[y] / q[y]) for y in range(3))
    assert math.isclose(
        float(osd_loss(torch.tensor([Q]), torch.tensor([P]))), expected, rel_tol=1e-5
    )


def test_slot_weights_and_weighted_mean():
    w = slot_weights(4)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-1 / 7), math.exp(-2 / 7)]))
    per_slot = torch.tensor([[1.0, 2.0, 3.0]])
    valid = torch.tensor([[True, True, False]])
    expected = (1.0 * w[0] + 2.0 * w[1]) / (w[0] + w[1])
    assert torch.isclose(weighted_slot_mean(per_slot, valid, 4), expected)
