import pytest
import torch

from adaflash.config import DrafterConfig
from adaflash.models.drafter import DFlashDrafter
from adaflash.models.target import load_target
from tests.tiny import VOCAB, build_checkpoint, hf_model


def _tiny(kind: str, tmp_path_factory):
    folder = build_checkpoint(tmp_path_factory.mktemp(kind), kind, seed=11, layers=6)
    return folder, load_target(folder, "float32"), hf_model(folder)


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    """(folder, our target, HF reference model) for one tiny checkpoint per family."""
    return _tiny(request.param, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return _tiny("llama", tmp_path_factory)


def random_drafter(target, seed: int = 0, block_size: int = 16) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(
        target.cfg, num_layers=2, mask_token_id=VOCAB - 1, block_size=block_size
    )
    return DFlashDrafter(cfg)
