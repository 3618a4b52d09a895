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


# -- the training losses on a top-K teacher and a draft vocabulary --------------------------------


def topk_teacher(p_logits, k, vocab=None):
    """A TopKTeacher from full teacher logits (what the cache keeps), in draft coordinates."""
    from adaflash.losses import TopKTeacher
    from adaflash.models.draft_vocab import lookup_table
    from adaflash.teacher_cache import topk_rows

    ids, logp, tail = topk_rows(p_logits, k)
    index = ids if vocab is None else lookup_table(vocab, p_logits.shape[-1])[ids]
    return TopKTeacher(index, logp, tail)


def test_topk_losses_equal_the_exact_ones_when_k_covers_the_vocabulary():
    from adaflash.losses import opd_loss_topk, osd_loss_topk

    g = torch.Generator().manual_seed(0)
    q, p = torch.randn(6, 40, generator=g), 3 * torch.randn(6, 40, generator=g)
    t = topk_teacher(p, 40)
    assert torch.allclose(opd_loss_topk(q, t, 0.8, 0.01), opd_loss(q, p, 0.8, 0.01), atol=1e-5)
    assert torch.allclose(osd_loss_topk(q, t), osd_loss(q, p), atol=1e-5)
    # and the gradients reaching the drafter are the same
    grads = []
    for fn in (lambda x: opd_loss(x, p), lambda x: opd_loss_topk(x, t)):
        x = q.clone().requires_grad_(True)
        fn(x).sum().backward()
        grads.append(x.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_topk_losses_stay_close_to_exact_on_a_peaked_teacher():
    """Departure 2 (uniform tail), K = 32 of 4096 tokens, a peaked teacher as a target's
    next-token distribution is: the hard term is exact; the rKL moves (a broad q puts mass on
    tail tokens whose p̃ is flattened), but the gradient reaching the drafter keeps its
    direction, for a broad and for a peaked drafter."""
    from adaflash.losses import opd_loss_topk

    g = torch.Generator().manual_seed(1)
    v = 4096
    p = torch.randn(8, v, generator=g) * 2.0
    top = torch.randint(0, v, (8,), generator=g)
    p[torch.arange(8), top] += 12.0
    t = topk_teacher(p, 32)
    broad = torch.randn(8, v, generator=g)
    peaked = broad * 2 + 10 * torch.nn.functional.one_hot(top, v)
    for q in (broad, peaked):
        assert torch.allclose(opd_loss(q, p, alpha=1.0), opd_loss_topk(q, t, alpha=1.0))
        assert (opd_loss(q, p) - opd_loss_topk(q, t)).abs().max() < 0.5
        grads = []
        for fn in (lambda x: opd_loss(x, p), lambda x: opd_loss_topk(x, t)):
            x = q.clone().requires_grad_(True)
            fn(x).sum().backward()
            grads.append(x.grad.flatten())
        assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.999


def test_draft_vocabulary_restricts_q_and_skips_an_uncovered_top1():
    """Departure 1: q lives on V_d. The rKL sums over V_d; a row whose teacher top-1 lies outside
    V_d has no hard term."""
    from adaflash.losses import opd_loss_topk

    g = torch.Generator().manual_seed(2)
    v, vocab = 30, torch.tensor([3, 7, 1, 20, 11, 0])
    p = torch.randn(4, v, generator=g)
    p[0, 7] = 9.0  # row 0: top-1 inside the vocabulary
    p[1, 25] = 9.0  # row 1: top-1 outside
    q_sub = torch.randn(4, vocab.numel(), generator=g)
    t = topk_teacher(p, v, vocab)
    got = opd_loss_topk(q_sub, t, alpha=1.0)  # the hard term alone
    log_q = torch.log_softmax(q_sub, -1)
    assert math.isclose(float(got[0]), -float(log_q[0, 1]), rel_tol=1e-5)  # 7 is draft index 1
    assert float(got[1]) == 0.0
    # the rKL alone is the exact clipped sum over the draft vocabulary
    rkl = opd_loss_topk(q_sub, t, alpha=0.0, delta=0.01)
    log_p = torch.log_softmax(p, -1)[:, vocab]
    want = torch.clamp(log_q.exp() * (log_q - log_p), max=0.01).sum(-1)
    assert torch.allclose(rkl, want, atol=1e-5)
