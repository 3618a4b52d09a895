"""The SGLang backend's own logic, against a stand-in SGLang client (no CUDA here).

What is checked: streaming from SGLang's cumulative chunks, stop strings and disconnects aborting
the SGLang request, trajectories and τ statistics from ``meta_info``, errors ending the stream,
draft-only hot swaps (flush retried, failed updates rolled back, layout changes refused) and the
policies it refuses. What is not: a real ``sglang.Engine`` (``EmbeddedSGLang``), which needs a GPU.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from adaflash.config import DrafterConfig, SamplingParams, TargetConfig
from adaflash.engine.records import MemorySink, RequestRecord
from adaflash.models.drafter import DFlashDrafter
from app.backends.sglang_engine import (
    SGLangBackend,
    draft_tensors,
    finish_type,
    sglang_sampling,
    spec_totals,
)

TARGET = TargetConfig("qwen3", 128, 64, 96, 8, 4, 2, 16)


def drafter(seed: int = 0, layers: int = 2) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(DrafterConfig.for_target(TARGET, num_layers=layers, mask_token_id=127))


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


class FakeSGLang:
    """SGLang's streaming contract: the first token from prefill, then verify rounds of
    ``per_round`` tokens; cumulative ``output_ids``; ``spec_verify_ct`` counts verify rounds."""

    def __init__(self, output: list[int], per_round: int = 3, delay: float = 0.0) -> None:
        self.output, self.per_round, self.delay = output, per_round, delay
        self.aborted: list[str] = []
        self.updates: list[list[str]] = []
        self.update_values: list[torch.Tensor] = []
        self.fail_updates = 0
        self.update_delay = 0.0
        self.flush_answers: list[bool] = []
        self.fail_generate = False
        self.finish: dict[str, Any] | None = {"type": "length"}  # None: end without a reason
        self.closed = False
        self.sampling: list[dict[str, Any]] = []

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str
    ) -> AsyncIterator[dict[str, Any]]:
        self.sampling.append(sampling_params)
        if self.fail_generate:
            raise RuntimeError("scheduler died")
        out = self.output[: sampling_params["max_new_tokens"]]
        ends = [1, *range(1 + self.per_round, len(out), self.per_round), len(out)]
        for ct, end in enumerate(ends):
            await asyncio.sleep(self.delay)
            yield {
                "output_ids": out[:end],
                "meta_info": {
                    "spec_verify_ct": ct,
                    "finish_reason": self.finish if end == len(out) else None,
                },
            }

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    async def update_draft(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.updates.append([k for k, _ in named])
        self.update_values.append(dict(named)["fc.weight"].clone())
        await asyncio.sleep(self.update_delay)
        if self.fail_updates:
            self.fail_updates -= 1
            raise RuntimeError("CUDA out of memory")

    async def flush_cache(self) -> bool:
        return self.flush_answers.pop(0) if self.flush_answers else True

    def shutdown(self) -> None:
        self.closed = True


OUTPUT = list(range(10, 23))  # 13 tokens: 1 from prefill + 4 verify rounds of 3


def make_backend(fake: FakeSGLang, sink: MemorySink | None = None, **kw: Any) -> SGLangBackend:
    d = drafter()
    return SGLangBackend(
        lambda: fake,
        target_cfg=TARGET,
        drafter_cfg=d.cfg,
        initial_weights=draft_tensors(d),
        version="v0000",
        decode=decode,
        sink=sink,
        eos_token_ids=(2,),
        flush_retries=5,
        **kw,
    )


@pytest.fixture
def backend_and_fake():
    fake = FakeSGLang(list(OUTPUT))
    sink = MemorySink()
    b = make_backend(fake, sink)
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


def wait_for(cond: Any) -> None:
    for _ in range(100):
        if cond():
            return
        time.sleep(0.02)


def test_stream_reassembles_sglang_chunks_and_records_the_trajectory(backend_and_fake):
    b, fake, sink = backend_and_fake
    deltas = asyncio.run(collect(b, SamplingParams(max_new_tokens=13)))
    assert [t for d in deltas for t in d.token_ids] == OUTPUT
    assert "".join(d.text for d in deltas) == decode(OUTPUT)
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert all(not d.finished for d in deltas[:-1])
    assert {k for d in deltas for k in d.kinds} == {"unknown"}
    rec = deltas[-1].record
    assert isinstance(rec, RequestRecord) and sink.records == [rec]
    assert rec.output_ids == tuple(OUTPUT) and rec.domain == "math"
    # prefill (1 token, nothing verified) + 4 DFLASH rounds (15 drafts verified, 2 accepted each)
    assert (rec.rounds, rec.accepted, rec.verified) == (5, 8, 4 * 15)
    assert b.counters.accept_len == pytest.approx(13 / 5)
    assert b.stats.output_tokens == 13 and not b.running
    assert fake.sampling[0]["stop_token_ids"] == [2]  # EOS of the target/tokenizer goes along


def test_stop_string_ends_the_stream_like_the_embedded_engine(backend_and_fake):
    b, fake, sink = backend_and_fake
    fake.delay = 0.05
    stop = decode([15, 16])  # both arrive in the second verify round (tokens 14, 15, 16)
    deltas = asyncio.run(collect(b, SamplingParams(max_new_tokens=13, stop=(stop,))))
    assert deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas) == decode([10, 11, 12, 13, 14])
    rec = deltas[-1].record
    assert rec is not None and rec.output_ids == tuple(range(10, 17))  # up to the stop's end
    assert rec.output_text == decode([10, 11, 12, 13, 14]) and sink.records == [rec]
    wait_for(lambda: fake.aborted)
    assert fake.aborted == ["r1"]  # SGLang is told to stop


def test_eos_ends_the_output_without_being_part_of_it(backend_and_fake):
    b, fake, _ = backend_and_fake
    fake.output = [10, 11, 12, 13, 2, 14]
    deltas = asyncio.run(collect(b, SamplingParams(max_new_tokens=6)))
    assert [t for d in deltas for t in d.token_ids] == [10, 11, 12, 13]
    assert deltas[-1].finish_reason == "stop"
    ignored = asyncio.run(collect(b, SamplingParams(max_new_tokens=6, ignore_eos=True)))
    assert [t for d in ignored for t in d.token_ids] == [10, 11, 12, 13, 2, 14]
    assert "stop_token_ids" not in fake.sampling[-1]


def test_a_disconnected_caller_aborts_its_request(backend_and_fake):
    b, fake, sink = backend_and_fake
    fake.delay = 0.05
    deltas = asyncio.run(collect(b, SamplingParams(max_new_tokens=13), stop_after=1))
    assert len(deltas) == 1 and not deltas[0].finished
    wait_for(lambda: fake.aborted)
    assert fake.aborted == ["r1"] and not b.running
    # recorded like the embedded engine records an abort (the buffer keeps no trajectory of it)
    assert [r.finish_reason for r in sink.records] == ["abort"]


def test_shutdown_ends_open_streams_with_abort():
    fake = FakeSGLang(list(OUTPUT), delay=0.3)
    b = make_backend(fake)
    b.start()

    async def run() -> list:
        deltas = []
        async for d in b.stream([5, 6, 7], SamplingParams(max_new_tokens=13)):
            deltas.append(d)
            if len(deltas) == 1:
                threading.Thread(target=b.stop, kwargs={"drain_timeout_s": 0}).start()
        return deltas

    deltas = asyncio.run(asyncio.wait_for(run(), 10))
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
    # the client is closed before the loop's thread is joined: wait for both
    wait_for(lambda: fake.closed and not b.alive)
    assert fake.closed and not b.alive


def test_sglang_ending_a_stream_early_or_aborting_is_reported(backend_and_fake):
    b, fake, _ = backend_and_fake
    fake.finish = None  # the stream just stops, short of max tokens
    deltas = asyncio.run(collect(b, SamplingParams(max_new_tokens=20)))
    assert deltas[-1].finish_reason == "abort"
    fake.finish = {"type": "abort", "message": "input is longer than the context"}
    deltas = asyncio.run(collect(b, SamplingParams(max_new_tokens=13)))
    assert deltas[-1].finish_reason == "error" and "longer than" in (deltas[-1].error or "")


def test_a_failing_sglang_request_ends_the_stream_with_an_error(backend_and_fake):
    b, fake, sink = backend_and_fake
    fake.fail_generate = True
    deltas = asyncio.run(collect(b, SamplingParams(max_new_tokens=13)))
    assert deltas[-1].finish_reason == "error" and "scheduler died" in (deltas[-1].error or "")
    assert [r.finish_reason for r in sink.records] == ["error"] and b.step_errors == 1


def test_invalid_requests_are_refused_before_reaching_sglang(backend_and_fake):
    b, fake, _ = backend_and_fake

    async def one(prompt: list[int], n: int) -> None:
        async for _ in b.stream(prompt, SamplingParams(max_new_tokens=n)):
            pass

    with pytest.raises(ValueError, match="context window"):
        asyncio.run(one([1, 2, 3], TARGET.max_position_embeddings))
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(one([], 4))
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        asyncio.run(one([1, 128], 4))
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


def test_a_swap_that_times_out_is_cancelled_restored_and_refused():
    fake = FakeSGLang(list(OUTPUT))
    b = make_backend(fake, swap_timeout_s=0.3)
    b.start()
    try:
        fake.update_delay = 1.0  # the first update hangs; the restore then hangs as well
        with pytest.raises(ValueError, match="no answer from SGLang within"):
            b.swap_drafter(drafter(seed=3), "v0003")
        assert b.version == "v0000" and len(fake.updates) == 2  # update, then restore attempt
        fake.update_delay = 0.0
        b.swap_drafter(drafter(seed=4), "v0004")  # the backend is still usable
        assert b.version == "v0004"
    finally:
        b.stop()


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
        boom, target_cfg=TARGET, drafter_cfg=d.cfg, initial_weights=[], version="v0000"
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
    # prefill token + 2 verify rounds of 15 drafts: 3 rounds, 10 tokens, 7 accepted drafts
    assert spec_totals({"spec_verify_ct": 2}, 10, 16) == (3, 30, 7)
    assert spec_totals({}, 5, 16) == (5, 0, 0)  # no speculation reported: one token per round
    assert finish_type({"finish_reason": {"type": "length"}}) == ("length", None)
    assert finish_type({"finish_reason": None}) == (None, None)


def test_the_service_serves_through_the_sglang_backend(tmp_path, monkeypatch):
    """The whole app on ``--backend sglang`` with the stand-in client: OpenAI and SGLang APIs,
    admin refusals, metrics, trajectories in the buffer and a hot swap from the registry."""
    from fastapi.testclient import TestClient

    import app.backends.sglang_checks
    import app.backends.sglang_engine
    from adaflash.models.drafter import load_drafter
    from app.api.server import create_app
    from app.service import ServeConfig, Service
    from db.buffer import count_unconsumed
    from tests.tiny import build_serving_folders

    target_dir, drafter_dir = build_serving_folders(tmp_path)
    fake = FakeSGLang(list(range(40, 52)), per_round=4)
    made: list[dict[str, Any]] = []

    def embedded(**kwargs: Any) -> FakeSGLang:
        made.append(kwargs)
        return fake

    monkeypatch.setattr(app.backends.sglang_checks, "require_sglang", lambda: None)
    monkeypatch.setattr(app.backends.sglang_engine, "EmbeddedSGLang", embedded)
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
    assert isinstance(service.backend, SGLangBackend)
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
        # prefill + 3 verify rounds (4, 4, 3 tokens): 4 rounds in AdaFlash's accounting, τ = 3
        assert meta["spec_verify_ct"] == 4 and meta["spec_accept_length"] == pytest.approx(3.0)
        h = {"Authorization": "Bearer sglang-admin-token"}
        r = api.post("/admin/config", headers=h, json={"policy": "head"})
        assert r.status_code == 400 and "--backend adaflash" in r.json()["error"]["message"]
        assert "adaflash_rounds_total 8.0" in api.get("/metrics").text
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
        assert service.backend.version == new.id and len(fake.updates) == 1
        assert torch.allclose(fake.update_values[0], retrained.fc.weight.bfloat16().float())
        assert api.get("/admin/versions", headers=h).json()["serving"] == new.id
    finally:
        service.stop()
    assert count_unconsumed(service.db) == 2  # both answers are trajectories for the trainer
    assert fake.closed
