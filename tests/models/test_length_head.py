import torch

from adaflash.models.length_head import LengthHead, acceptance_label, head_loss, verify_len


def test_verify_len_formula_and_clamping():
    a = torch.tensor([0.0, 0.01, 0.5, 0.52, 0.99, 1.0])
    assert verify_len(a, 16).tolist() == [1, 1, 8, 8, 15, 16]
    assert verify_len(a, 16, gamma=1.3).tolist() == [1, 1, 10, 10, 16, 16]
    assert verify_len(torch.tensor([0.3]), 16, gamma=0.1).tolist() == [1]


def test_head_output_range_and_detached_input():
    head = LengthHead(8, 4)
    states = torch.randn(3, 16, 8, requires_grad=True)
    a = head(states)
    assert a.shape == (3,) and bool(((a > 0) & (a < 1)).all())
    head_loss(a, acceptance_label(torch.tensor([0, 5, 15]), 16)).backward()
    assert states.grad is None  # no gradient reaches the drafter
    assert head.proj.weight.grad is not None


def test_acceptance_label():
    assert acceptance_label(15, 16).item() == 1.0
    assert acceptance_label(0, 16).item() == 1 / 16
