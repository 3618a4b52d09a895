"""The service layer in process (FastAPI's TestClient over a real Service on a tiny model):
defaults a user gets, limits, --drafter none, per-request failures, the OpenAPI document."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from fastapi.testclient import TestClient

from adaflash.models.drafter import load_drafter
from app.api.server import create_app
from app.service import ServeConfig, Service
from tests.tiny import build_serving_folders

TOKEN = "service-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def make_service(root, **kw) -> Service:
    target, drafter = root / "tiny-target", root / "tiny-drafter"
    if not target.is_dir():
        build_serving_folders(root)
    defaults = {
        "target": str(target),
        "drafter": str(drafter),
        "database_url": f"sqlite:///{root / 'buffer.db'}",
        "weights_dir": str(root / "weights"),
        "trainer": False,
        "compile": False,
        "admin_token": TOKEN,
        "dtype": "float32",
    }
    return Service(ServeConfig(**{**defaults, **kw}))


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    service = make_service(tmp_path_factory.mktemp("svc"))
    with TestClient(create_app(service, ui=False)) as client:
        yield service, client


def test_sampling_defaults_come_from_generation_config(tmp_path):
    service = make_service(tmp_path)
    assert service.defaults.temperature == 1.0 and "OpenAI" in service.defaults.source
    gen = service.target_dir / "generation_config.json"
    gen.write_text(json.dumps({"temperature": 0.2, "top_p": 0.9, "eos_token_id": 2}))
    service = make_service(tmp_path, default_top_p=0.5)
    assert (service.defaults.temperature, service.defaults.top_p) == (0.2, 0.5)
    assert "generation_config.json (temperature)" in service.defaults.source
    params = service.sampling(temperature=None, top_p=None, top_k=None, max_new_tokens=4)
    assert (params.temperature, params.top_p) == (0.2, 0.5)
    explicit = service.sampling(temperature=0.0, top_p=1.0, top_k=None, max_new_tokens=4)
    assert (explicit.temperature, explicit.top_p) == (0.0, 1.0)
    with TestClient(create_app(service, ui=False)) as client:
        info = client.get("/get_model_info").json()
        assert info["default_sampling"] == {
            "temperature": 0.2,
            "top_p": 0.5,
            "top_k": 0,
            "source": service.defaults.source,
        }


def test_pull_writes_the_model_cards_sampling_without_overriding(tmp_path):
    from adaflash.pull import write_sampling_defaults

    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": 2}))
    write_sampling_defaults(tmp_path, {"temperature": 0.2, "top_p": 0.9})
    assert json.loads(gen.read_text()) == {
        "eos_token_id": 2,
        "temperature": 0.2,
        "top_p": 0.9,
        "do_sample": True,
    }
    gen.write_text(json.dumps({"temperature": 0.7}))
    write_sampling_defaults(tmp_path, {"temperature": 0.2, "top_p": 0.9})
    assert json.loads(gen.read_text())["temperature"] == 0.7  # never overridden


def test_max_tokens_default_to_the_context_window_and_the_flag_lowers_it(api, tmp_path):
    service, client = api
    window = service.backend.max_context
    assert service.max_new_tokens == window
    # (SGLang benchmark clients send 2048 and were refused by a fixed ceiling of 1024)
    body = {"text": "hi", "sampling_params": {"max_new_tokens": window - 10, "temperature": 0}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    low = make_service(tmp_path, max_new_tokens=16)
    with pytest.raises(ValueError, match="above this server's limit 16"):
        low.sampling(temperature=0, top_p=None, top_k=None, max_new_tokens=17)
    assert (
        low.sampling(temperature=0, top_p=None, top_k=None, max_new_tokens=None).max_new_tokens
        == 16
    )


def test_meta_info_reports_draft_and_verify_time(api):
    service, client = api
    service.configure(policy="fixed")  # drafts every round (cost may choose not to draft)
    try:
        meta = client.post(
            "/generate",
            json={"text": "hello", "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
        ).json()["meta_info"]
    finally:
        service.configure(policy="cost")
    assert meta["spec_draft_time_ms"] > 0 and meta["spec_verify_time_ms"] > 0


def test_a_tiny_top_p_is_answered_and_others_are_not_hurt(api):
    _, client = api
    r = client.post("/v1/completions", json={"prompt": "0", "max_tokens": 1, "top_p": 5e-324})
    assert r.status_code == 200, r.text
    ok = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/generate", {"input_ids": [False]}, "input_ids"),
        ("/v1/completions", {"prompt": "x", "echo": 0}, "echo"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
        ("/generate", {"text": "x", "sampling_params": {"stop": ["a"] * 17}}, "stop"),
        (
            "/generate",
            {"text": "x", "sampling_params": {"stop_token_ids": [10**9]}},
            "stop_token_ids",
        ),
        ("/generate", {"text": "x", "sampling_params": {"sampling_seed": 2**63}}, "seed"),
        ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed"),
        ("/v1/completions", {"prompt": "x", "top_k": 2**40}, "top_k"),
    ],
)
def test_schema_invalid_bodies_are_refused_with_400(api, path, body, needle):
    _, client = api
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_stop_token_ids_outside_the_vocabulary_are_refused(api):
    service, client = api
    bad = service.vocab_size + 3
    r = client.post("/generate", json={"text": "x", "sampling_params": {"stop_token_ids": [bad]}})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]


def test_openapi_document_matches_the_answers(api):
    _, client = api
    doc = client.get("/openapi.json").json()
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (method, path)
    gen = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "400" in gen and "text/event-stream" in gen["200"]["content"]
    for path in ("/health", "/metrics", "/flush_cache"):
        op = doc["paths"][path]["get"]
        assert list(op["responses"]["200"]["content"]) == ["text/plain"], path
        assert client.get(path).headers["content-type"].startswith("text/plain")


def test_one_access_log_line_per_request(api, caplog):
    _, client = api
    with caplog.at_level(logging.INFO, logger="adaflash.access"):
        client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        )
        client.get("/v1/models")
    lines = [r.getMessage() for r in caplog.records if r.name == "adaflash.access"]
    assert len(lines) == 2
    assert lines[0].startswith("POST /v1/chat/completions 200 ")
    assert "prompt=" in lines[0] and "completion=5" in lines[0] and "tau=" in lines[0]
    assert lines[1].startswith("GET /v1/models 200 ")


def test_drafter_none_wins_over_the_registrys_active_version(tmp_path):
    """A registry with an active version, then `serve --drafter none`: nothing is swapped in,
    and speculative policies and promotions are refused."""
    first = make_service(tmp_path)
    retrained = load_drafter(first.registry.active().path)
    with torch.no_grad():
        retrained.fc.weight.add_(0.01)
    v = first.registry.publish(
        retrained, parent="v0000", loss="opd", samples=1, data=(1, 1), metrics={}
    )
    first.registry.activate(v.id)
    first.db.dispose()
    service = make_service(tmp_path, drafter="none")
    service.watcher.poll_s = 0.1
    with TestClient(create_app(service, ui=False)) as client:
        time.sleep(0.5)  # several watcher polls would have happened
        assert service.backend.version == "none" and not service.backend.speculative
        r = client.post("/admin/config", headers=ADMIN, json={"policy": "fixed"})
        assert r.status_code == 400 and "needs a drafter" in r.json()["error"]["message"]
        r = client.post("/admin/promote", headers=ADMIN, json={"version": v.id})
        assert r.status_code == 409 and "--drafter none" in r.json()["error"]["message"]
        out = client.post(
            "/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 4}}
        )
        assert out.json()["meta_info"]["spec_verify_len"] == 1.0


def test_an_explicit_drafter_folder_wins_over_stored_state(tmp_path):
    first = make_service(tmp_path)
    shipped = first.registry.active()
    retrained = load_drafter(shipped.path)
    with torch.no_grad():
        retrained.fc.weight.add_(0.01)
    v = first.registry.publish(
        retrained, parent="v0000", loss="opd", samples=1, data=(1, 1), metrics={}
    )
    first.registry.activate(v.id)
    first.db.dispose()
    again = make_service(tmp_path)  # --drafter given explicitly (the shipped folder)
    assert again.backend.version == shipped.id
    # the default drafter (not given on the command line) follows the registry instead
    again.registry.activate(v.id)
    version, _, _ = again._initial_drafter(str(tmp_path / "tiny-drafter"), explicit=False)
    assert version == v.id


def test_cost_model_moves_with_real_steps_and_is_exported(api):
    service, client = api
    before = service.backend.cost_snapshot()
    client.post("/generate", json={"text": "hello there", "sampling_params": {"max_new_tokens": 8}})
    after = service.backend.cost_snapshot()
    assert after["target_steps_seen"] > before["target_steps_seen"]
    text = client.get("/metrics").text
    assert 'adaflash_cost_estimate{term="target_per_token_ms"}' in text
    assert 'adaflash_policy_check_total{term="drafting_tokens_expected"}' in text
    assert 'adaflash_policy_check_total{term="probes"}' in text


def test_dashboard_sums_its_probes_as_the_rounds_they_stand_for():
    from adaflash.metrics import SpecCounters, probe_buckets
    from app.service import Dashboard

    probes = probe_buckets([(100.0, 4, 3), (109.0, 15, 1), (130.0, 2, 0)], 16, 10)
    d = Dashboard(60, 140.0, [], [], SpecCounters(16), {}, [], probes)
    assert d.probed.rounds == 3 and d.probed.accepted == 4
    assert d.probed.accept_len == (3 + 4) / 3
    assert Dashboard(60, 140.0, [], [], SpecCounters(16), {}, []).probed.rounds == 0


def test_dashboard_carries_each_served_versions_gate(tmp_path):
    service = make_service(tmp_path)
    with TestClient(create_app(service, ui=False)) as client:

        def generate() -> None:
            body = {"text": "hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
            assert client.post("/generate", json=body).status_code == 200

        generate()
        base = service.active_version()
        assert base is not None
        cand = service.registry.publish(
            service.registry.load(base.id),
            parent=base.id,
            loss="fkl",
            samples=1,
            data=(None, None),
            metrics={},
        )
        service.registry.update_metrics(
            cand.id, gate={"candidate_accept_len": 1.5, "active_accept_len": 1.2}
        )
        service.promote(cand.id)
        generate()
        deadline = time.time() + 10
        while time.time() < deadline:  # rounds reach the buffer from a writer thread
            d = service.dashboard(600)
            if cand.id in [name for _, name in d.versions]:
                break
            time.sleep(0.1)
    assert [name for _, name in d.versions] == [base.id, cand.id]
    assert d.gates == {cand.id: (1.2, 1.5)}  # the shipped version has no gate
