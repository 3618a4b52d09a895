"""The HTTP APIs against a running server: official openai client, SGLang shapes, metrics,
admin, and every kind of bad input."""

import asyncio
import itertools
import json

import httpx
import openai
import pytest

from adaflash.config import EngineConfig, SamplingParams
from adaflash.engine.engine import Engine
from adaflash.models.target import load_target
from adaflash.tokenizer import Tokenizer
from tests.server import ADMIN_TOKEN


@pytest.fixture(scope="module")
def reference(server):
    """The target's own greedy continuation of a chat (plain decoding, in-process)."""
    target = load_target(server.target, "float32")
    tok = Tokenizer.from_folder(server.target)
    engine = Engine(
        target,
        None,
        EngineConfig(policy="ar"),
        detokenize=tok.decode,
        eos_token_ids=tok.eos_token_ids,
    )

    def greedy(messages, n):
        (rec,) = engine.generate([tok.chat(messages)], SamplingParams(max_new_tokens=n))
        return rec.output_text, len(rec.output_ids)

    return greedy


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def test_models_and_openapi(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-target"]
    schema = httpx.get(server.url + "/openapi.json").json()
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/generate",
        "/metrics",
        "/admin/train",
    } <= set(schema["paths"])


def test_chat_non_streaming_equals_target_greedy(client, reference):
    msgs = [{"role": "user", "content": "Hello there!"}]
    out = client.chat.completions.create(
        model="tiny-target", messages=msgs, max_tokens=20, temperature=0
    )
    want, n = reference(msgs, 20)
    assert out.choices[0].message.content == want
    assert out.usage.completion_tokens == n and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + n
    assert out.choices[0].finish_reason in ("stop", "length")


def test_chat_streaming_with_the_official_client(client, reference):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    stream = client.chat.completions.create(
        model="tiny-target",
        messages=msgs,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    want, n = reference(msgs, 24)
    assert text == want
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == n
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_sixteen_concurrent_requests_complete_correctly(server, reference):
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")
    prompts = [[{"role": "user", "content": f"Question number {i}?"}] for i in range(16)]

    async def one(msgs, stream):
        if not stream:
            r = await aclient.chat.completions.create(
                model="tiny-target", messages=msgs, max_tokens=16, temperature=0
            )
            return r.choices[0].message.content
        parts = []
        async for c in await aclient.chat.completions.create(
            model="tiny-target", messages=msgs, max_tokens=16, temperature=0, stream=True
        ):
            if c.choices and c.choices[0].delta.content:
                parts.append(c.choices[0].delta.content)
        return "".join(parts)

    async def main():
        return await asyncio.gather(*(one(m, i % 2 == 0) for i, m in enumerate(prompts)))

    outs = asyncio.run(main())
    for msgs, got in zip(prompts, outs, strict=True):
        assert got == reference(msgs, 16)[0]


def test_completions_both_ways(client):
    out = client.completions.create(
        model="tiny-target", prompt="Once upon", max_tokens=10, temperature=0
    )
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny-target", prompt="Once upon", max_tokens=10, temperature=0, stream=True
        )
    )
    assert out.choices[0].text == streamed and out.usage.completion_tokens == 10


def test_sglang_generate_shapes(server):
    body = {
        "text": "hello",
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    }
    r = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    m = r["meta_info"]
    assert m["completion_tokens"] == 12 == len(r["output_ids"]) and m["prompt_tokens"] == 5
    assert m["finish_reason"]["type"] == "length"
    assert m["spec_verify_ct"] >= 1 and m["spec_accept_length"] >= 1.0
    assert 1.0 <= m["spec_verify_len"] <= 16 and 0.0 <= m["spec_accept_rate"] <= 1.0
    # SGLang streams cumulative text and ends with [DONE]
    with httpx.stream(
        "POST", server.url + "/generate", json={**body, "stream": True}, timeout=60
    ) as s:
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert chunks[-1]["text"] == r["text"]
    assert all(b["text"].startswith(a["text"]) for a, b in itertools.pairwise(chunks))
    assert chunks[-1]["meta_info"]["completion_tokens"] == 12
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["is_generation"] and info["speculative_num_draft_tokens"] == 16
    assert httpx.post(server.url + "/flush_cache").status_code == 200
    assert httpx.get(server.url + "/health").text.strip() == "OK"


def metric(server, name):
    text = httpx.get(server.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_metrics_counters_move(server):
    before = metric(server, "adaflash_rounds_total")
    httpx.post(
        server.url + "/generate",
        json={
            "text": "abc",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        },
        timeout=60,
    )
    assert metric(server, "adaflash_rounds_total") > before
    assert metric(server, "adaflash_records_dropped_total") == 0
    assert metric(server, "adaflash_active_version") == 1.0
    for name in (
        "adaflash_accepted_draft_tokens_total",
        "adaflash_queue_depth",
        "adaflash_output_tokens_total",
        "adaflash_requests_total",
    ):
        metric(server, name)


BAD = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "   "}]}, 400, "empty"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokenz": 3}, 400, "max_tokenz"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400, "limit"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 9}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, 404, "gpt-9"),
]


@pytest.mark.parametrize(("body", "status", "needle"), BAD)
def test_bad_requests_get_clear_4xx(server, body, status, needle):
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_malformed_bodies(server):
    url = server.url + "/v1/chat/completions"
    h = {"content-type": "application/json"}
    assert httpx.post(url, content=b"{not json", headers=h).status_code == 400
    r = httpx.post(
        url, content=b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', headers=h
    )
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"x" * 1_200_000, headers=h)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/generate", json={"text": "a", "input_ids": [1]})
    assert r.status_code == 400 and "exactly one" in r.json()["error"]["message"]
    long_prompt = {"input_ids": [5] * 500, "sampling_params": {"max_new_tokens": 100}}
    r = httpx.post(server.url + "/generate", json=long_prompt)
    assert r.status_code == 400 and "context window" in r.json()["error"]["message"]


def test_client_disconnect_frees_the_slot(server):
    body = {
        "text": "go",
        "stream": True,
        "sampling_params": {"max_new_tokens": 250, "ignore_eos": True},
    }
    finished = metric(server, "adaflash_requests_total")
    tokens = metric(server, "adaflash_output_tokens_total")
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    for _ in range(100):
        if metric(server, "adaflash_running_requests") == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert metric(server, "adaflash_running_requests") == 0
    assert metric(server, "adaflash_requests_total") == finished + 1
    # aborted, not run to the end: far fewer than the 250 tokens asked for
    assert 0 < metric(server, "adaflash_output_tokens_total") - tokens < 200


def test_admin_requires_the_bearer_token(server):
    assert httpx.post(server.url + "/admin/train").status_code == 401
    bad = {"Authorization": "Bearer nope"}
    assert httpx.get(server.url + "/admin/versions", headers=bad).status_code == 401
    h = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    v = httpx.get(server.url + "/admin/versions", headers=h).json()
    assert v["serving"] == v["active"] == "v0000"
    run = httpx.post(server.url + "/admin/train", headers=h).json()
    assert run["run_id"] >= 1 and run["trainer_running"] is False
    runs = httpx.get(server.url + "/admin/runs", headers=h).json()["runs"]
    assert runs[0]["status"] == "requested" and runs[0]["trigger"] == "admin"
    r = httpx.post(server.url + "/admin/promote", headers=h, json={"version": "v9999"})
    assert r.status_code == 409 and "v9999" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/admin/config", headers=h, json={"policy": "fixed", "gamma": 1.5})
    assert r.json() == {"policy": "fixed", "gamma": 1.5}
    httpx.post(
        server.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}
    )
    assert 'policy="fixed"' in httpx.get(server.url + "/metrics").text
    assert httpx.post(server.url + "/admin/config", headers=h, json={"gamma": 0}).status_code == 400
    httpx.post(server.url + "/admin/config", headers=h, json={"policy": "head", "gamma": 1.0})


def test_clean_shutdown_flushes_the_buffer(tmp_path):
    import sqlite3

    from tests.server import start_server, stop_server

    s = start_server(tmp_path, admin=False)
    r = httpx.post(s.url + "/admin/train")
    assert r.status_code == 403 and "disabled" in r.json()["error"]["message"]
    for i in range(3):
        httpx.post(
            s.url + "/generate",
            json={"text": f"q{i}", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}},
            timeout=60,
        )
    assert stop_server(s) == 0
    con = sqlite3.connect(s.data / "adaflash.db")
    assert con.execute("select count(*) from trajectories").fetchone()[0] == 3
    assert con.execute("select count(*) from round_stats").fetchone()[0] >= 3
    assert "AdaFlash stopped." in s.log.read_text()
