"""The engine drafts through the compiled drafter pass (models/draft_graph.py) and its output
stays the target's."""

import pytest
import torch

from adaflash.config import EngineConfig, SamplingParams
from adaflash.engine.engine import Engine
from adaflash.models import gemv as gemv_kernel
from adaflash.models.draft_graph import DraftGraph, in_panels
from adaflash.models.target import load_target
from tests.engine.conftest import random_drafter
from tests.engine.test_exactness import PROMPTS

pytestmark = pytest.mark.skipif(not gemv_kernel.panels(), reason="no panels kernel for this CPU")


def test_an_engine_drafts_through_the_graph_and_its_output_stays_the_targets(tiny_llama):
    """bf16 (the graph serves bf16 panels): the drafting engine's tokens are those of plain
    decoding with the same target, and its drafter passes ran compiled."""
    target = load_target(tiny_llama[0], "bfloat16")
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = Engine(target, None, EngineConfig(policy="ar")).generate(PROMPTS, params)
    engine = Engine(target, random_drafter(target, block_size=4), EngineConfig(policy="fixed"))
    assert engine.drafting is not None and in_panels(engine.drafting.drafter)
    g = DraftGraph()
    g.request(engine.drafting.drafter, background=False)
    engine.drafting.graph = g
    with torch.compiler.set_stance("fail_on_recompile"):  # the graphs built ahead serve
        got = engine.generate(PROMPTS, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in plain]
    assert g.calls >= len(PROMPTS) and g.failed is None
