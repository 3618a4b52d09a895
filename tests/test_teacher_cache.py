"""The teacher, computed once: what the cache keeps equals a direct target pass; the cache on
disk resumes, refuses a mismatched target, and reads back what was written."""

import pytest
import torch

from adaflash.models.target import PackedBatch, load_target
from adaflash.teacher_cache import TeacherCache, build_cache, cache_key, teach, teach_hf
from adaflash.workloads import Trajectory
from tests.tiny import build_checkpoint

LAYERS = (1, 3)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = build_checkpoint(tmp_path_factory.mktemp("t"), "llama", seed=2, layers=5)
    target = load_target(folder)
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(7):
        seq = torch.randint(3, 90, (int(torch.randint(12, 30, (1,), generator=g)),), generator=g)
        plen = 3 + i
        trajs.append(
            Trajectory(
                f"t{i}",
                "chat" if i % 2 else "code",
                seq[:plen].tolist(),
                seq[plen:].tolist(),
                "",
                "length",
            )
        )
    return folder, target, trajs


def test_teach_equals_a_direct_pass_per_sequence(setup):
    _, target, trajs = setup
    seqs = teach(target, trajs, LAYERS, top_k=5, max_tokens=40)  # several packs
    assert [s.id for s in seqs] == [t.id for t in trajs]
    for t, s in zip(trajs, seqs, strict=True):
        tokens = t.prompt_ids + t.response_ids
        cache = target.new_cache()
        out = target(
            PackedBatch(torch.tensor(tokens), (cache.allocate(),), (len(tokens),)),
            cache,
            capture_layers=LAYERS,
        )
        assert torch.allclose(s.features, out.features, atol=1e-5)
        logp = torch.log_softmax(out.logits[len(t.prompt_ids) : len(tokens) - 1], -1)
        top = logp.topk(5, -1)
        assert torch.equal(s.top_ids, top.indices)
        assert torch.allclose(s.top_logp, top.values, atol=1e-5)
        tail = (1 - top.values.exp().sum(-1)) / (logp.shape[-1] - 5)
        assert torch.allclose(s.tail_logp, tail.log(), atol=1e-4)
        # the teacher rows of the response, in draft coordinates without a draft vocabulary
        rows = torch.tensor([len(t.prompt_ids), len(tokens) - 2])
        tt = s.teacher(rows, None)
        assert torch.equal(tt.top1, logp[[0, -1]].argmax(-1))


def test_the_hugging_face_teacher_equals_the_engines(setup):
    """``teach_hf`` (right-padded batches through transformers, what the GPU recipe runs) keeps
    what ``teach`` keeps, in the trajectories' order; the last layer (normed by HF) is refused."""
    from transformers import AutoModelForCausalLM

    folder, target, trajs = setup
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = teach(target, trajs, LAYERS, top_k=5)
    got = teach_hf(model, trajs, LAYERS, top_k=5, max_tokens=70)  # several padded batches
    assert [s.id for s in got] == [t.id for t in trajs]
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a.tokens, b.tokens) and a.prompt_len == b.prompt_len
        assert torch.allclose(a.features, b.features, atol=1e-4)
        assert torch.equal(a.top_ids, b.top_ids)
        assert torch.allclose(a.top_logp, b.top_logp, atol=1e-4)
        assert torch.allclose(a.tail_logp, b.tail_logp, atol=1e-4)
    with pytest.raises(ValueError, match="normed"):
        teach_hf(model, trajs, (1, 4), top_k=5)


def test_cache_on_disk_resumes_and_reads_back(setup, tmp_path):
    folder, target, trajs = setup
    key = cache_key(folder, LAYERS, 4)
    first = build_cache(tmp_path / "c", target, key, trajs[:3], shard_size=2)
    assert len(first) == 3 and len(first.manifest["shards"]) == 2
    calls = []
    full = build_cache(
        tmp_path / "c", target, key, trajs, shard_size=2, progress=lambda d, n: calls.append(n)
    )
    assert len(full) == 7 and calls and calls[-1] == 4  # only the 4 new ones were taught
    assert full.ids == [t.id for t in trajs] and full.domains == [t.domain for t in trajs]
    again = TeacherCache(tmp_path / "c")
    mem = teach(target, trajs, LAYERS, top_k=4)
    for i in range(7):
        a, b = again[i], mem[i]
        assert torch.equal(a.tokens, b.tokens) and a.prompt_len == b.prompt_len
        assert torch.allclose(a.features, b.features, atol=1e-6)
        assert torch.equal(a.top_ids, b.top_ids) and torch.allclose(a.top_logp, b.top_logp)
    with pytest.raises(ValueError, match="another folder"):
        build_cache(tmp_path / "c", target, cache_key(folder, (2,), 4), trajs)
