"""On-policy distillation of the drafter and the length head from trajectories (SPEC §3–4).

For one trajectory (prompt + the response serving produced), the target is re-run once to get,
at every position, the drafter context features and the teacher's next-token logits. Then up to
N anchors p are drawn among response positions; each gives a block [x_p, MASK×(k−1)] at
positions p … p+k−1 that attends to context strictly before p and bidirectionally to itself (one
attention mask for all blocks of the sequence). Slot i is taught by the target's distribution at
position p+i−1 (which predicts the token at p+i). The length head learns a* = (accepted+1)/k,
where "accepted" is computed as if the whole block had been verified against the recorded
tokens, from DETACHED drafter states.

The same machinery replays a drafter against recorded tokens with no generation
(``simulate_acceptance``): the promotion gate's evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaflash.losses import ALPHA, DELTA, opd_loss, osd_loss, weighted_slot_mean
from adaflash.metrics import SpecCounters
from adaflash.models.drafter import DFlashDrafter
from adaflash.models.layers import BlockMask
from adaflash.models.length_head import acceptance_label, head_loss
from adaflash.models.target import PackedBatch, TargetModel


@dataclass
class Teacher:
    """What the target says about one sequence (no gradient)."""

    tokens: torch.Tensor  # (S,) prompt + response
    prompt_len: int
    features: torch.Tensor  # (S, K·H) drafter context features
    logits: torch.Tensor  # (S, V) row t predicts token t+1


@torch.no_grad()
def run_teacher(
    target: TargetModel, tokens: list[int], prompt_len: int, layer_ids: tuple[int, ...]
) -> Teacher:
    cache = target.new_cache(initial_capacity=len(tokens))
    slot = cache.allocate()
    ids = torch.tensor(tokens)
    out = target(PackedBatch(ids, (slot,), (len(tokens),)), cache, capture_layers=layer_ids)
    assert out.features is not None and out.logits is not None
    # clones leave inference mode: these tensors take part in the drafter's autograd graph
    return Teacher(ids, prompt_len, out.features.float().clone(), out.logits.clone())


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
    drafter: DFlashDrafter, target: TargetModel, teacher: Teacher, anchors: torch.Tensor
) -> torch.Tensor:
    """Drafter final states for every anchor's block → (Nb, k, H). Gradient flows into the
    drafter; the target's embedding stays frozen."""
    k, s = drafter.cfg.block_size, teacher.tokens.numel()
    nb = anchors.numel()
    block_ids = torch.full((nb, k), drafter.cfg.mask_token_id)
    block_ids[:, 0] = teacher.tokens[anchors]
    positions = (anchors[:, None] + torch.arange(k)).reshape(1, nb * k)  # (1, Nb·k)
    with torch.no_grad():
        block = target.embed_tokens(block_ids.reshape(1, nb * k)).to(drafter.dtype)  # (1, Nb·k, H)
    ctx = drafter.context_kv(teacher.features, torch.arange(s))  # per layer (kv, S, d)
    mask = block_attention_mask(anchors, k, s)
    states = drafter(block, positions, [ctx], [mask])  # (1, Nb·k, H)
    return states.view(nb, k, -1)


def slot_targets(
    teacher: Teacher, anchors: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For slots 1 … k−1 of each block: teacher row index (p+i−1), recorded token (x_{p+i}) and
    validity (p+i inside the sequence). Each (Nb, k−1)."""
    s = teacher.tokens.numel()
    pos = anchors[:, None] + torch.arange(1, block_size)[None, :]  # (Nb, k−1) predicted positions
    valid = pos < s
    pos_c = pos.clamp(max=s - 1)
    return pos_c - 1, teacher.tokens[pos_c], valid


def accepted_drafts(
    drafts: torch.Tensor, recorded: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Leading run of drafts equal to the recorded tokens, per block (Nb,)."""
    ok = (drafts == recorded) & valid  # (Nb, k−1)
    return ok.long().cumprod(dim=1).sum(dim=1)


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
    teacher: Teacher,
    anchors: torch.Tensor,
    loss: str = "opd",
    alpha: float = ALPHA,
    delta: float = DELTA,
) -> DistillOutput:
    """Losses of one sequence's blocks."""
    k = drafter.cfg.block_size
    states = block_states(drafter, target, teacher, anchors)  # (Nb, k, H)
    rows, recorded, valid = slot_targets(teacher, anchors, k)  # (Nb, k−1) each
    q_logits = target.lm_head(states[:, 1:].to(target.lm_head.weight.dtype))  # (Nb, k−1, V)
    p_logits = teacher.logits[rows]  # (Nb, k−1, V)
    q, p = q_logits.flatten(0, 1), p_logits.flatten(0, 1)  # (Nb·(k−1), V)
    per_slot = (opd_loss(q, p, alpha, delta) if loss == "opd" else osd_loss(q, p)).view(rows.shape)
    draft_loss = weighted_slot_mean(per_slot, valid, k)
    accepted = accepted_drafts(q_logits.detach().argmax(-1), recorded, valid)
    a_hat = drafter.length_head(states)  # detaches its input
    h_loss = head_loss(a_hat.float(), acceptance_label(accepted, k))
    return DistillOutput(draft_loss + h_loss, draft_loss, h_loss, accepted, a_hat.detach())


@torch.no_grad()
def simulate_acceptance(
    drafter: DFlashDrafter,
    target: TargetModel,
    sequences: list[tuple[list[int], int]],
    anchors_per_seq: int | None = 64,
    seed: int = 0,
) -> SpecCounters:
    """Replay the drafter against recorded target tokens (no generation): the counters a
    ``fixed`` policy would see if every anchor's whole block were verified. ``sequences`` are
    (prompt + response tokens, prompt length)."""
    k = drafter.cfg.block_size
    counters = SpecCounters(k)
    g = torch.Generator().manual_seed(seed)
    for tokens, prompt_len in sequences:
        if len(tokens) - prompt_len < 2:
            continue
        teacher = run_teacher(target, tokens, prompt_len, drafter.cfg.target_layer_ids)
        anchors = sample_anchors(prompt_len, len(tokens), anchors_per_seq, g)
        states = block_states(drafter, target, teacher, anchors)
        _, recorded, valid = slot_targets(teacher, anchors, k)
        flat = states[:, 1:].reshape(-1, states.shape[-1]).to(target.lm_head.weight.dtype)
        drafts = target.lm_head(flat).argmax(-1).view(recorded.shape)
        accepted = accepted_drafts(drafts, recorded, valid)
        for acc, n_valid in zip(accepted.tolist(), valid.sum(1).tolist(), strict=True):
            counters.add_round(verify_len=n_valid + 1, accepted=acc, drafted=k - 1)
    return counters
