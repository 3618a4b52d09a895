"""The draft vocabulary: built by frequency, stored beside the weights, used when drafting."""

import copy
import json

import pytest
import torch

from adaflash.config import DrafterConfig, EngineConfig, SamplingParams
from adaflash.engine.engine import Engine
from adaflash.models import draft_vocab as dv
from adaflash.models.drafter import DFlashDrafter, load_drafter, save_drafter
from adaflash.models.target import load_target
from tests.tiny import VOCAB, build_checkpoint


def test_ranked_by_frequency_ties_by_id_forced_ids_kept():
    counts = dv.count_tokens([[5, 5, 5, 7, 7, 9], [7, 3]], vocab_size=12)
    assert counts[5] == 3 and counts[7] == 3 and counts[9] == 1
    ids = dv.build_draft_vocab(counts, 3)
    assert ids.tolist() == [5, 7, 3]  # 5 and 7 tie on 3: id order; 3 and 9 tie on 1
    ids = dv.build_draft_vocab(counts, 3, always=[11])
    assert ids.tolist() == [11, 5, 7]
    assert dv.coverage(ids, counts) == pytest.approx(6 / 8)
    table = dv.lookup_table(ids, 12)
    assert table[11] == 0 and table[7] == 2 and table[9] == -1
    with pytest.raises(ValueError, match="size"):
        dv.build_draft_vocab(counts, 13)


def test_saved_with_the_drafter_and_refused_when_broken(tmp_path):
    cfg = DrafterConfig(48, 96, 1, 4, 2, 12, VOCAB, 6, (1, 3), VOCAB - 1, block_size=4)
    drafter = DFlashDrafter(cfg)
    drafter.set_draft_vocab(torch.tensor([4, 9, 2, 7]), {"train_coverage": 0.5})
    folder = save_drafter(drafter, tmp_path / "d")
    again = load_drafter(folder)
    assert again.draft_vocab is not None and again.draft_vocab.tolist() == [4, 9, 2, 7]
    assert again.draft_vocab_info["train_coverage"] == 0.5
    assert again.draft_vocab_size == 4
    # an old folder without the file drafts from the whole vocabulary
    (folder / dv.FILE).unlink()
    assert load_drafter(folder).draft_vocab is None
    # a broken file is refused with its reason
    (folder / dv.FILE).write_text(json.dumps({"size": 2, "ids": [3, VOCAB + 5]}))
    with pytest.raises(ValueError, match="must lie in"):
        load_drafter(folder)
    (folder / dv.FILE).write_text(json.dumps({"size": 2, "ids": [3, 3]}))
    with pytest.raises(ValueError, match="distinct"):
        load_drafter(folder)
    # saving a drafter without one over that folder removes the stale file
    save_drafter(DFlashDrafter(cfg), folder)
    assert not (folder / dv.FILE).exists()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(build_checkpoint(tmp_path_factory.mktemp("t"), "llama", seed=3, layers=4))


def test_draft_logits_score_only_the_vocabulary_rows(target):
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, mask_token_id=VOCAB - 1)
    drafter = DFlashDrafter(cfg)
    states = torch.randn(5, cfg.hidden_size)
    full = target.lm_head(states)  # (5, V)
    ids = torch.tensor([40, 3, 17, 88, 60, 5])
    drafter.set_draft_vocab(ids)
    sub = drafter.draft_logits(states, target.lm_head.weight)  # (5, 6)
    assert torch.allclose(sub, full[:, ids], atol=1e-5)
    best = drafter.to_target_ids(sub.argmax(-1))
    assert set(best.tolist()) <= set(ids.tolist())
    assert torch.equal(best, ids[full[:, ids].argmax(-1)])


def test_engine_with_a_draft_vocabulary_stays_exact(target):
    """Drafts come from the subset, the target decides: greedy output equals plain decoding."""
    torch.manual_seed(1)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=2, mask_token_id=VOCAB - 1, block_size=6)
    drafter = DFlashDrafter(cfg)
    prompts = [[5, 6, 7], [30, 31], [40, 41, 42, 43]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = Engine(target, None, EngineConfig(policy="ar")).generate(prompts, params)
    counts = dv.count_tokens([list(r.output_ids) for r in plain], target.cfg.vocab_size)
    drafter.set_draft_vocab(dv.build_draft_vocab(counts, 16))
    engine = Engine(target, drafter, EngineConfig(policy="fixed"))
    spec = engine.generate(prompts, params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert engine.counters.drafted > 0


def test_the_draft_head_is_built_at_install_and_shared_by_versions_of_one_vocabulary(target):
    """Not in the first drafting step (a stall of 0.1 s at SmolLM2's size), and one per
    vocabulary rather than one per hot-swapped version; copies leave it behind."""
    torch.manual_seed(2)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, mask_token_id=VOCAB - 1, block_size=4)
    ids = torch.tensor([40, 3, 17, 88, 60, 5, 6, 7])
    drafter = DFlashDrafter(cfg)
    drafter.set_draft_vocab(ids)
    engine = Engine(target, drafter, EngineConfig(policy="fixed"))
    served = engine.drafter
    assert served is not None and served._head is not None  # built before any step
    assert drafter._head is None  # the caller's object is not the one serving
    assert torch.equal(served.draft_head(target.lm_head.weight), target.lm_head.weight[ids])
    assert copy.deepcopy(served)._head is None
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    plain = Engine(target, None, EngineConfig(policy="ar")).generate([[5, 6, 7]], params)

    def swapped(vocab: torch.Tensor, version: str) -> DFlashDrafter:
        new = DFlashDrafter(cfg)
        new.set_draft_vocab(vocab)
        engine.swap_drafter(new, version)
        out = engine.generate([[5, 6, 7]], params)  # the swap applies at the next step
        assert [r.output_ids for r in out] == [r.output_ids for r in plain]
        assert engine.version == version and engine.drafter is not None
        return engine.drafter

    again = swapped(ids.clone(), "v1")  # same rows of the same weight: the same head
    assert again._head is served._head
    other = swapped(torch.tensor([9, 8, 7, 6]), "v2")  # other rows: its own
    assert other._head is not None and other._head is not served._head
    assert torch.equal(other.draft_head(target.lm_head.weight), target.lm_head.weight[[9, 8, 7, 6]])
