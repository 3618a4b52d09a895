"""Accepting drafts against one target verification pass (SPEC §1).

The target scored the k̂ block slots [anchor, d_1 … d_{k̂−1}]; row j of its output predicts the
token after slot j. Drafts are argmax tokens of the drafter, i.e. q is a point mass on d_j, so
the Leviathan et al. rule (accept d with prob min(1, p(d)/q(d)), else resample from
norm(max(0, p − q))) reduces to: draw y_j ~ p_j, accept while y_j = d_{j+1}, and emit y_j at the
first mismatch (the bonus token). y_j is p_j-distributed given an all-accepted prefix, so the
output has exactly the target's distribution. Greedy (T=0) is the same with y_j = argmax p_j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaflash.decoding.sampling import sample, target_probs


@dataclass(frozen=True)
class Acceptance:
    accepted: int  # drafts accepted (0 … k̂−1)
    bonus_token: int  # the target's own token after the accepted prefix

    @property
    def accept_len(self) -> int:
        """τ: tokens committed this round, bonus included."""
        return self.accepted + 1


def _accepted_prefix(target_tokens: torch.Tensor, drafts: torch.Tensor) -> int:
    """Length of the longest prefix where target_tokens[j] == drafts[j]."""
    mismatch = (target_tokens[: drafts.numel()] != drafts).nonzero()
    return int(mismatch[0, 0]) if mismatch.numel() else drafts.numel()


def greedy_accept(logits: torch.Tensor, drafts: torch.Tensor) -> Acceptance:
    """logits (k̂, V) from the target, drafts (k̂−1,) → accepted count and bonus token."""
    assert logits.shape[0] == drafts.numel() + 1, "one target row per verified slot"
    target_tokens = logits.argmax(dim=-1)  # (k̂,)
    m = _accepted_prefix(target_tokens, drafts)
    return Acceptance(m, int(target_tokens[m]))


def sampled_accept(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> Acceptance:
    """Lossless acceptance for T > 0 with a deterministic (argmax) drafter."""
    assert logits.shape[0] == drafts.numel() + 1, "one target row per verified slot"
    y = sample(target_probs(logits, temperature, top_k, top_p), generator)  # (k̂,)
    m = _accepted_prefix(y, drafts)
    return Acceptance(m, int(y[m]))
