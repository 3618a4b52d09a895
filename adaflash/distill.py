"""On-policy distillation of the drafter and the length head from trajectories (SPEC §3–4).

The target runs once per trajectory (``teacher_cache.teach``): drafter context features at every
position, the teacher's top-K next-token log-probs at every response position. Then up to N
anchors p are drawn among response positions; each gives a block [x_p, MASK×(k−1)] at positions
p … p+k−1 that attends to context strictly before p and bidirectionally to itself (one attention
mask for all blocks of the sequence). Slot i is taught by the target's distribution at position
p+i−1 (which predicts the token at p+i), through ``losses.opd_loss_topk`` on the drafter's draft
vocabulary. The length head learns a* = (accepted+1)/k, where "accepted" is computed as if the
whole block had been verified against the recorded tokens, from DETACHED drafter states.

The same machinery replays a drafter against recorded tokens with no generation
(``simulate_acceptance``): the promotion gate's evaluation and the learning curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from adaflash.losses import (
    ALPHA,
    DELTA,
    TopKTeacher,
    opd_loss_topk,
    osd_loss_topk,
    slot_weights,
    weighted_slot_mean,
)
from adaflash.metrics import SpecCounters
from adaflash.models.drafter import DFlashDrafter
from adaflash.models.layers import BlockMask, Mask
from adaflash.models.length_head import acceptance_label, head_loss
from adaflash.models.target import TargetModel
from adaflash.teacher_cache import CachedSequence, teach
from adaflash.workloads import Trajectory


def sample_anchors(
    prompt_len: int, seq_len: int, n: int | None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Up to n anchor positions p ∈ [prompt_len, seq_len − 2] (each has ≥ 1 slot to predict),
    sorted. n=None takes every response position."""
    candidates = torch.arange(prompt_len, seq_len - 1)
    if n is not None and candidates.numel() > n:
        pick = torch.randperm(candidates.numel(), generator=generator)[:n]
        candidates = candidates[pick.sort().values]
    return candidates


def block_attention_mask(anchors: torch.Tensor, block_size: int, ctx_len: int) -> BlockMask:
    """Block b sees context positions < p_b and its own k slots ((Nb·k, ctx_len + Nb·k) when
    made dense; kept structured so flash-attn can run it as a varlen batch on a GPU)."""
    return BlockMask(anchors, block_size, ctx_len)


def block_states(
    drafter: DFlashDrafter, target: TargetModel, seq: CachedSequence, anchors: torch.Tensor
) -> torch.Tensor:
    """Drafter final states for every anchor's block → (Nb, k, H). Gradient flows into the
    drafter; the target's embedding stays frozen. The cached sequence lives on the CPU; what
    the drafter needs moves to its device."""
    return block_states_batch(drafter, target, [seq], [anchors])[0]


def block_states_batch(
    drafter: DFlashDrafter,
    target: TargetModel,
    seqs: Sequence[CachedSequence],
    anchors: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """``block_states`` of several sequences in one drafter pass → [(Nb_i, k, H)]. Each item is
    padded to the most blocks by repeating its last anchor; blocks never see each other, so a pad
    block changes nothing and is dropped from the result."""
    if not anchors or min(a.numel() for a in anchors) == 0:
        raise ValueError("every sequence needs at least one anchor")
    k, dev = drafter.cfg.block_size, drafter.fc.weight.device
    nb_max = max(a.numel() for a in anchors)
    padded = torch.stack([torch.cat([a, a[-1:].expand(nb_max - a.numel())]) for a in anchors])
    block_ids = torch.full((len(seqs), nb_max, k), drafter.cfg.mask_token_id)  # (B, Nb, k)
    block_ids[:, :, 0] = torch.stack([s.tokens[p] for s, p in zip(seqs, padded, strict=True)])
    positions = (padded[:, :, None] + torch.arange(k)).reshape(len(seqs), nb_max * k).to(dev)
    with torch.no_grad():
        emb = target.embed_tokens(block_ids.reshape(len(seqs), nb_max * k).to(target.device))
        block = emb.to(dev, drafter.dtype)  # (B, Nb·k, H)
    ctx = [
        drafter.context_kv(s.features.to(dev), torch.arange(s.tokens.numel(), device=dev))
        for s in seqs
    ]  # [item][layer] (kv, S_i, d)
    masks: list[Mask] = [
        block_attention_mask(p.to(dev), k, s.tokens.numel())
        for s, p in zip(seqs, padded, strict=True)
    ]
    states = drafter(block, positions, ctx, masks).view(len(seqs), nb_max, k, -1)
    return [states[i, : a.numel()] for i, a in enumerate(anchors)]


def slot_targets(
    seq: CachedSequence, anchors: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For slots 1 … k−1 of each block: teacher row (p+i−1), recorded token (x_{p+i}) and
    validity (p+i inside the sequence). Each (Nb, k−1)."""
    s = seq.tokens.numel()
    pos = anchors[:, None] + torch.arange(1, block_size)[None, :]  # (Nb, k−1) predicted positions
    valid = pos < s
    pos_c = pos.clamp(max=s - 1)
    return pos_c - 1, seq.tokens[pos_c], valid


def accepted_drafts(
    drafts: torch.Tensor, recorded: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Leading run of drafts equal to the recorded tokens, per block (Nb,)."""
    ok = (drafts == recorded) & valid  # (Nb, k−1)
    return ok.long().cumprod(dim=1).sum(dim=1)


def train_slots(block_size: int, supervised: int | None) -> torch.Tensor:
    """(k−1,) bool: the draft slots the loss teaches. ``supervised`` None teaches all; n teaches
    slots 1 … n (the rest still draft, they are just never reached often enough to pay)."""
    n = block_size - 1 if supervised is None else min(supervised, block_size - 1)
    return torch.arange(1, block_size) <= n


@dataclass
class DistillOutput:
    loss: torch.Tensor  # drafter loss + head loss (head loss reaches only the head)
    draft_loss: torch.Tensor  # reaches only the drafter body
    head_loss: torch.Tensor  # reaches only the length head
    accepted: torch.Tensor  # (Nb,) accepted drafts per block, full block verified
    a_hat: torch.Tensor  # (Nb,)


def distill_sequence(
    drafter: DFlashDrafter,
    target: TargetModel,
    seq: CachedSequence,
    anchors: torch.Tensor,
    loss: str = "opd",
    alpha: float = ALPHA,
    delta: float = DELTA,
    lookup: torch.Tensor | None = None,
    supervised_slots: int | None = None,
    slot_decay: float | None = None,
) -> DistillOutput:
    """Losses of one sequence's blocks. ``lookup`` maps target ids to the drafter's draft
    vocabulary (``draft_vocab.lookup_table``; None without one)."""
    return distill_batch(
        drafter, target, [seq], [anchors], loss, alpha, delta, lookup, supervised_slots, slot_decay
    )[0]


def distill_batch(
    drafter: DFlashDrafter,
    target: TargetModel,
    seqs: Sequence[CachedSequence],
    anchors: Sequence[torch.Tensor],
    loss: str = "opd",
    alpha: float = ALPHA,
    delta: float = DELTA,
    lookup: torch.Tensor | None = None,
    supervised_slots: int | None = None,
    slot_decay: float | None = None,
) -> list[DistillOutput]:
    """``distill_sequence`` of each sequence, computed together: one drafter pass, one draft
    head and one loss over every block of the batch (a GPU runs a few large kernels instead of
    many small ones per sequence); the losses stay per sequence."""
    k = drafter.cfg.block_size
    states = block_states_batch(drafter, target, seqs, anchors)  # [(Nb_i, k, H)]
    dev = states[0].device
    targets = [slot_targets(s, a, k) for s, a in zip(seqs, anchors, strict=True)]
    flat = torch.cat([st[:, 1:].reshape(-1, st.shape[-1]) for st in states])  # (ΣNb·(k−1), H)
    q = drafter.draft_logits(flat, target.lm_head.weight.to(dev))  # (ΣNb·(k−1), V_d)
    teacher = TopKTeacher.cat(
        [s.teacher(rows.flatten(), lookup) for s, (rows, _, _) in zip(seqs, targets, strict=True)]
    ).to(dev)
    per_row = (
        opd_loss_topk(q, teacher, alpha, delta) if loss == "opd" else osd_loss_topk(q, teacher)
    )
    drafts = drafter.to_target_ids(q.detach().argmax(-1))
    weights = slot_weights(k, dev, decay=slot_decay)
    taught_slots = train_slots(k, supervised_slots).to(dev)[None, :]
    blocks = [a.numel() for a in anchors]
    rows_each = [n * (k - 1) for n in blocks]
    a_hats = drafter.length_head(torch.cat(states)).split(blocks)  # detaches its input
    outs = []
    for (rows, recorded, valid), ell, d, a_hat in zip(
        targets, per_row.split(rows_each), drafts.split(rows_each), a_hats, strict=True
    ):
        recorded, valid = recorded.to(dev), valid.to(dev)
        draft_loss = weighted_slot_mean(ell.view(rows.shape), valid & taught_slots, k, weights)
        accepted = accepted_drafts(d.view(rows.shape), recorded, valid)
        h_loss = head_loss(a_hat.float(), acceptance_label(accepted, k))
        outs.append(
            DistillOutput(draft_loss + h_loss, draft_loss, h_loss, accepted, a_hat.detach())
        )
    return outs


@torch.no_grad()
def replay(
    drafter: DFlashDrafter,
    target: TargetModel,
    seqs: Sequence[CachedSequence],
    anchors_per_seq: int | None = 64,
    seed: int = 0,
) -> SpecCounters:
    """Replay the drafter against recorded target tokens (no generation): the counters a
    ``fixed`` policy would see if every anchor's whole block were verified."""
    k = drafter.cfg.block_size
    counters = SpecCounters(k)
    g = torch.Generator().manual_seed(seed)
    for seq in seqs:
        if seq.tokens.numel() - seq.prompt_len < 2:
            continue
        anchors = sample_anchors(seq.prompt_len, seq.tokens.numel(), anchors_per_seq, g)
        states = block_states(drafter, target, seq, anchors)
        _, recorded, valid = slot_targets(seq, anchors, k)
        flat = states[:, 1:].reshape(-1, states.shape[-1]).contiguous()
        weight = target.lm_head.weight.to(states.device)
        drafts = drafter.argmax_drafts(flat, weight).view(recorded.shape).cpu()
        accepted = accepted_drafts(drafts, recorded, valid)
        for acc, n_valid in zip(accepted.tolist(), valid.sum(1).tolist(), strict=True):
            counters.add_round(verify_len=n_valid + 1, accepted=acc, drafted=k - 1)
    return counters


CURVE_ANCHORS = 32  # anchors per held-out sequence in a learning-curve point


def curve_taus(
    drafter: DFlashDrafter, target: TargetModel, sets: dict[str, Sequence[CachedSequence]]
) -> dict[str, Any]:
    """One learning-curve point's measures: ``replay`` per held-out set (``CURVE_ANCHORS``
    anchors, seed 0) → ``tau_<set>`` and ``slots_<set>`` (per-slot acceptance)."""
    point: dict[str, Any] = {}
    for name, seqs in sets.items():
        c = replay(drafter, target, seqs, anchors_per_seq=CURVE_ANCHORS, seed=0)
        point[f"tau_{name}"] = round(c.accept_len, 4)
        point[f"slots_{name}"] = [None if a is None else round(a, 4) for a in c.slot_acceptance]
    return point


def simulate_acceptance(
    drafter: DFlashDrafter,
    target: TargetModel,
    sequences: list[tuple[list[int], int]],
    anchors_per_seq: int | None = 64,
    seed: int = 0,
) -> SpecCounters:
    """``replay`` on raw (prompt + response tokens, prompt length) pairs: the target runs once
    over them for the context features (no teacher distribution is needed)."""
    trajs = [
        Trajectory(str(i), "", tokens[:plen], tokens[plen:], "", "")
        for i, (tokens, plen) in enumerate(sequences)
    ]
    seqs = teach(target, trajs, drafter.cfg.target_layer_ids, top_k=0)
    return replay(drafter, target, seqs, anchors_per_seq, seed)
