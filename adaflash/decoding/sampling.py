"""Turning target logits into the distribution the user asked for (temperature, top-k, top-p).

The same functions serve plain decoding and speculative verification, so both sample from the
identical distribution — the precondition of losslessness. ``target_probs`` defines it over the
whole vocabulary; ``sample_tokens`` draws from it without sorting the vocabulary (FlashInfer's
idea of sorting-free top-k/top-p sampling, on a CPU): the nucleus nearly always lies among the
few hundred largest logits, so only those are sorted (``torch.topk``), the softmax's normaliser
comes from all of them, and a row whose candidates do not reach ``top_p`` takes the full path.
"""

from __future__ import annotations

import torch


def target_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """logits (N, V) → probabilities (N, V) after temperature, top-k and top-p (nucleus).

    top-k keeps the k largest logits; top-p then keeps the smallest prefix of the sorted
    distribution whose mass reaches p (the token crossing p is kept). temperature must be > 0.
    Safe for every accepted value: the most likely token always survives top-k and top-p (a
    top_p below float32's smallest number keeps exactly it), and the logits are shifted by
    their maximum before dividing, so a tiny temperature gives a point mass, never NaN.
    """
    assert temperature > 0, "greedy decoding does not build a distribution"
    x = logits.float()
    x = (x - x.max(dim=-1, keepdim=True).values) / temperature  # ≤ 0, the maximum exactly 0
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]  # (N, 1)
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        drop = before >= top_p
        drop[..., 0] = False  # the most likely token is always kept
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


CANDIDATES = 256  # logits sorted per row before the full path is needed (``sample_tokens``)


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    candidates: int | None = None,
) -> torch.Tensor:
    """One token per row of logits (N, V) → (N,), drawn from ``target_probs(logits, …)``.

    Only the ``candidates`` largest logits of a row are sorted: top-k keeps the first k of
    them (k ≤ candidates), top-p the shortest prefix whose mass under the row's (top-k
    restricted) softmax reaches p, the token crossing p kept; that mass is exact because the
    normaliser sums the whole row. A row whose candidates hold less than p, or a top-k beyond
    the candidates, is drawn through ``target_probs`` (the fallback): the same distribution.
    Draws are exponential races (``race``): no cumulative sum over the vocabulary."""
    assert temperature > 0, "greedy decoding does not build a distribution"
    candidates = CANDIDATES if candidates is None else candidates
    n, v = logits.shape
    top_k_on = 0 < top_k < v
    x = logits.float()
    x = (x - x.max(dim=-1, keepdim=True).values) / temperature  # ≤ 0, the maximum exactly 0
    if not top_k_on and top_p >= 1.0:  # nothing to truncate: the race over the whole row
        return race(x, generator)
    if candidates >= v or (top_k_on and top_k > candidates):
        return race(target_probs(logits, temperature, top_k, top_p).log(), generator)
    top, idx = torch.topk(x, top_k if top_k_on else candidates, dim=-1)  # (N, C) descending
    # the kept set's normaliser; terms below e^-80 cannot move a sum ≥ 1 in float32, and
    # clamping them keeps exp off its slow subnormal path (a tenfold cost at low temperature)
    norm = torch.logsumexp((top if top_k_on else x).clamp(min=-80.0), dim=-1, keepdim=True)
    logp = top - norm  # (N, C) the candidates' log-probabilities under the softmax
    p = logp.exp()
    before = p.cumsum(-1) - p  # mass strictly before each candidate
    keep = before < top_p
    keep[:, 0] = True  # the most likely token is always kept
    covered = (p.sum(-1) >= top_p) | top_k_on  # the nucleus lies among the candidates
    if bool(covered.all()):
        return idx.gather(-1, race(logp.masked_fill(~keep, float("-inf")), generator)[:, None])[
            :, 0
        ]
    out = torch.empty(n, dtype=torch.long)
    for row in range(n):  # rare: a flat distribution; row by row, in order, one generator
        if covered[row]:
            kept = logp[row : row + 1].masked_fill(~keep[row : row + 1], float("-inf"))
            out[row] = idx[row, race(kept, generator)[0]]
        else:
            full = target_probs(logits[row : row + 1], temperature, top_k, top_p)
            out[row] = race(full.log(), generator)[0]
    return out


def race(scores: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of unnormalised log-probabilities (N, C) → (N,): the exponential race
    argmax(scores − log E), E ~ Exp(1) i.i.d., which picks i with probability softmax(scores)_i
    (the Gumbel-max trick); −inf never wins."""
    u = torch.rand(scores.shape, generator=generator)  # [0, 1): cheaper than exponential_
    e = (-torch.log1p(-u)).clamp_(min=torch.finfo(torch.float32).tiny)  # Exp(1)
    return (scores - e.log()).argmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row: probs (N, V) → (N,)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
