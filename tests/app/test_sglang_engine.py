"""The SGLang backend's own logic, against a stand-in SGLang client (no CUDA here).

What is checked: streaming from SGLang's cumulative chunks, stop strings and disconnects aborting
the SGLang request, trajectories and τ statistics from ``meta_info``, errors ending the stream,
draft-only hot swaps (flush retried, failed updates rolled back, layout changes refused) and the
policies it refuses. What is not: a real ``sglang.Engine`` (``EmbeddedSGLang``), which needs a GPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from adaflash.config import DrafterConfig, SamplingParams, TargetConfig
from adaflash.engine.records import MemorySink, RequestRecord
from adaflash.models.drafter import DFlashDrafter
from app.sglang_engine import SGLangBackend, draft_tensors, sglang_sampling, spec_totals

TARGET = TargetConfig("qwen3", 128, 64, 96, 8, 4, 2, 16)


def drafter(seed: int = 0, layers: int = 2) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(DrafterConfig.for_target(TARGET, num_layers=layers, mask_token_id=127))


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


class FakeSGLang:
    """Streams ``output`` in rounds of ``per_round`` tokens, cumulative like SGLang does."""

    def __init__(self, output: list[int], per_round: int = 3, delay: float = 0.0) -> None:
        self.output, self.per_round, self.delay = output, per_round, delay
        self.aborted: list[str] = []
        self.updates: list[list[str]] = []
        self.update_values: list[torch.Tensor] = []
        self.fail_updates = 0
        self.flush_answers: list[bool] = []
        self.fail_generate = False
        self.closed = False
        self.sampling: list[dict[str, Any]] = []

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str
    ) -> AsyncIterator[dict[str, Any]]:
        self.sampling.append(sampling_params)
        if self.fail_generate:
            raise RuntimeError("scheduler died")
        out = self.output[: sampling_params["max_new_tokens"]]
        for rounds, i in enumerate(range(0, len(out), self.per_round), start=1):
            await asyncio.sleep(self.delay)
            done = i + self.per_round >= len(out)
            yield {
                "output_ids": out[: i + self.per_round],
                "meta_info": {
                    "spec_verify_ct": rounds,
                    "finish_reason": {"type": "length"} if done else None,
                },
            }

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    async def update_draft(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.updates.append([k for k, _ in named])
        self.update_values.append(dict(named)["fc.weight"].clone())
        if self.fail_updates:
            self.fail_updates -= 1
            raise RuntimeError("CUDA out of memory")

    async def flush_cache(self) -> bool:
        return self.flush_answers.pop(0) if self.flush_answers else True

    def shutdown(self) -> None:
        self.closed = True


@pytest.fixture
def backend_and_fake():
    fake = FakeSGLang(list(range(1, 13)))
    d = drafter()
    sink = MemorySink()
    b = SGLangBackend(
        lambda: fake,
        target_cfg=TARGET,
        drafter_cfg=d.cfg,
        initial_weights=draft_tensors(d),
        version="v0000",
        decode=decode,
        sink=sink,
        flush_retries=5,
    )
    b.start()
    yield b, fake, sink
    b.stop(drain_timeout_s=1)
    assert fake.closed


async def collect(b: SGLangBackend, params: SamplingParams, stop_after: int | None = None):
    deltas = []
    async for d in b.stream([5, 6, 7], params, domain="math", request_id="r1"):
        deltas.append(d)
        if stop_after is not None and len(deltas) >= stop_after:
            break
    return deltas


def test_stream_reassembles_sglang_chunks_and_records_the_trajectory(backend_and_fake):
    b, _, sink = backend_and_fake
    deltas = asyncio.run(collect(b, SamplingParams(max_new_tokens=12)))
    assert [t for d in deltas for t in d.token_ids] == list(range(1, 13))
    assert "".join(d.text for d in deltas) == decode(list(range(1, 13)))
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert all(not d.finished for d in deltas[:-1])
    assert {k for d in deltas for k in d.kinds} == {"unknown"}
    rec = deltas[-1].record
    assert isinstance(rec, RequestRecord) and sink.records == [rec]
    assert rec.output_ids == tuple(range(1, 13)) and rec.domain == "math"
    # 4 rounds of 3 tokens: τ = 3, i.e. 2 accepted drafts per round; DFLASH verifies 15 per round
    assert (rec.rounds, rec.accepted, rec.verified) == (4, 8, 4 * 15)
    assert b.counters.accept_len == pytest.approx(3.0)
    assert b.stats.output_tokens == 12 and not b.running


def test_stop_string_ends_the_stream_and_aborts_the_sglang_request(backend_and_fake):
    b, fake, _ = backend_and_fake
    fake.delay = 0.05
    stop = decode([5, 6])  # tokens 5, 6 arrive in the second chunk
    deltas = asyncio.run(collect(b, SamplingParams(max_new_tokens=12, stop=(stop,))))
    assert deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas) == decode([1, 2, 3, 4])
    for _ in range(50):
        if fake.aborted:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert fake.aborted == ["r1"]


def test_a_disconnected_caller_aborts_its_request(backend_and_fake):
    b, fake, sink = backend_and_fake
    fake.delay = 0.05
    deltas = asyncio.run(collect(b, SamplingParams(max_new_tokens=12), stop_after=1))
    assert len(deltas) == 1 and not deltas[0].finished
    for _ in range(50):
        if fake.aborted:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert fake.aborted == ["r1"] and sink.records == [] and not b.running


def test_a_failing_sglang_request_ends_the_stream_with_an_error(backend_and_fake):
    b, fake, sink = backend_and_fake
    fake.fail_generate = True
    deltas = asyncio.run(collect(b, SamplingParams(max_new_tokens=12)))
    assert deltas[-1].finish_reason == "error" and "scheduler died" in (deltas[-1].error or "")
    assert sink.records == [] and b.step_errors == 1


def test_invalid_requests_are_refused_before_reaching_sglang(backend_and_fake):
    b, fake, _ = backend_and_fake

    async def one(prompt: list[int], n: int) -> None:
        async for _ in b.stream(prompt, SamplingParams(max_new_tokens=n)):
            pass

    with pytest.raises(ValueError, match="context window"):
        asyncio.run(one([1, 2, 3], TARGET.max_position_embeddings))
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(one([], 4))
    assert fake.sampling == []


def test_hot_swap_replaces_the_draft_weights_only(backend_and_fake):
    b, fake, _ = backend_and_fake
    fake.flush_answers = [False, False, True]  # "cache not flushed" twice, then done
    new = drafter(seed=1)
    b.swap_drafter(new, "v0001")
    assert b.version == "v0001" and b.stats.swaps == 1
    assert fake.updates[-1] and not any(k.startswith("length_head.") for k in fake.updates[-1])
    assert torch.equal(fake.update_values[-1], new.state_dict()["fc.weight"])
    assert fake.flush_answers == []


def test_a_failed_swap_restores_the_active_weights_and_is_refused(backend_and_fake):
    b, fake, _ = backend_and_fake
    old = dict(b._weights)["fc.weight"]
    fake.fail_updates = 1
    with pytest.raises(ValueError, match="CUDA out of memory"):
        b.swap_drafter(drafter(seed=2), "v0002")
    assert b.version == "v0000" and b.stats.swaps == 0
    assert len(fake.updates) == 2 and torch.equal(fake.update_values[-1], old)  # put back


def test_layout_changes_and_other_policies_are_refused(backend_and_fake):
    b, fake, _ = backend_and_fake
    with pytest.raises(ValueError, match="restart"):
        b.swap_drafter(drafter(layers=3), "v0003")
    assert fake.updates == []
    with pytest.raises(ValueError, match="--backend adaflash"):
        b.set_policy("head")
    with pytest.raises(ValueError, match="--backend adaflash"):
        b.set_policy(gamma=0.5)
    b.set_policy("fixed")


def test_start_up_failure_reaches_the_caller():
    def boom() -> FakeSGLang:
        raise RuntimeError("no GPU memory for the KV cache")

    d = drafter()
    b = SGLangBackend(
        boom,
        target_cfg=TARGET,
        drafter_cfg=d.cfg,
        initial_weights=draft_tensors(d),
        version="v0000",
    )
    with pytest.raises(RuntimeError, match="KV cache"):
        b.start()
    assert not b.alive


def test_sampling_and_statistics_translation():
    sp = sglang_sampling(
        SamplingParams(temperature=0.7, top_k=0, max_new_tokens=9, stop_token_ids=(2,), seed=3)
    )
    assert sp == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 9,
        "ignore_eos": False,
        "stop_token_ids": [2],
        "sampling_seed": 3,
    }
    assert spec_totals({"spec_verify_ct": 2}, 10, 16) == (2, 30, 8)
    assert spec_totals({}, 5, 16) == (5, 0, 0)  # no speculation reported: one token per round


def test_the_service_serves_through_the_sglang_backend(tmp_path, monkeypatch):
    """The whole app on ``--backend sglang`` with the stand-in client: OpenAI and SGLang APIs,
    admin refusals, metrics, trajectories in the buffer and a hot swap from the registry."""
    from fastapi.testclient import TestClient

    import app.sglang_backend
    import app.sglang_engine
    from adaflash.models.drafter import load_drafter
    from app.api import create_app
    from app.service import ServeConfig, Service
    from db.buffer import count_unconsumed
    from tests.tiny import build_serving_folders

    target_dir, drafter_dir = build_serving_folders(tmp_path)
    fake = FakeSGLang(list(range(40, 52)), per_round=4)
    made: list[dict[str, Any]] = []

    def embedded(**kwargs: Any) -> FakeSGLang:
        made.append(kwargs)
        return fake

    monkeypatch.setattr(app.sglang_backend, "require_sglang", lambda: None)
    monkeypatch.setattr(app.sglang_engine, "EmbeddedSGLang", embedded)
    cfg = ServeConfig(
        backend="sglang",
        target=str(target_dir),
        drafter=str(drafter_dir),
        database_url=f"sqlite:///{tmp_path / 'buffer.db'}",
        weights_dir=str(tmp_path / "weights"),
        trainer=False,
        admin_token="sglang-admin-token",
        dtype="float32",
    )
    service = Service(cfg)
    assert isinstance(service.engine, SGLangBackend) and service.runner is service.engine
    service.start()
    try:
        (args,) = made
        assert args["speculative_algorithm"] == "DFLASH"
        assert args["speculative_draft_model_path"] == str(service.registry.get("v0000").path)
        api = TestClient(create_app(service, ui=False))
        chat = api.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12},
        ).json()
        assert chat["choices"][0]["message"]["content"] == service.tokenizer.decode(
            list(range(40, 52))
        )
        assert chat["usage"]["completion_tokens"] == 12
        gen = api.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 12}})
        meta = gen.json()["meta_info"]
        assert meta["spec_verify_ct"] == 3 and meta["spec_accept_length"] == pytest.approx(4.0)
        h = {"Authorization": "Bearer sglang-admin-token"}
        r = api.post("/admin/config", headers=h, json={"policy": "head"})
        assert r.status_code == 400 and "--backend adaflash" in r.json()["error"]["message"]
        assert "adaflash_rounds_total 6.0" in api.get("/metrics").text
        # a new version published by a trainer is swapped into SGLang's draft model
        retrained = load_drafter(drafter_dir)
        with torch.no_grad():
            retrained.fc.weight.add_(0.01)
        new = service.registry.publish(
            retrained,
            parent="v0000",
            loss="opd",
            samples=2,
            data=(None, None),
            metrics={},
        )
        service.registry.activate(new.id)
        assert service.watcher.check() == new.id
        assert service.engine.version == new.id and len(fake.updates) == 1
        assert torch.allclose(fake.update_values[0], retrained.fc.weight.bfloat16().float())
        assert api.get("/admin/versions", headers=h).json()["serving"] == new.id
    finally:
        service.stop()
    assert count_unconsumed(service.db) == 2  # both answers are trajectories for the trainer
    assert fake.closed
