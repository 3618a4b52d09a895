"""Property-based fuzzing of the HTTP APIs against their own OpenAPI document (schemathesis):
a running `adaflash serve` on a tiny model gets schema-valid and schema-invalid requests for
every operation; none may get a 5xx, every status and content type must be documented, and
invalid input must be refused. Bounded in examples per operation and in generation length."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.server import ADMIN_TOKEN, start_server, stop_server

CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.negative_data_rejection,
]
EXAMPLES = 20  # per operation and mode


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    # --max-new-tokens keeps every generated request short; larger ones are refused (400)
    server = start_server(tmp_path_factory.mktemp("fuzz"), "--max-new-tokens", "24")
    yield schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    stop_server(server)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_api_conforms_to_its_openapi_document(api_schema, mode):
    operations = [r.ok() for r in api_schema.get_all_operations()]
    assert len(operations) >= 12  # OpenAI, SGLang, admin and ops routes
    for op in operations:
        if mode is GenerationMode.NEGATIVE and not (len(op.body) or len(op.query)):
            continue  # nothing to make invalid (GET /v1/models, /health …)

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def check(case):  # type: ignore[no-untyped-def]
            case.call_and_validate(
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, checks=CHECKS, timeout=60
            )

        check()
