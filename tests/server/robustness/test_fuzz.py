"""Property-based fuzzing of the server's own OpenAPI schema with schemathesis.

A real server (real engine, small limits so that generated requests stay cheap) answers every
generated request, valid or not: never a 5xx, and responses match the schema the server publishes.
The default run is bounded (`FUZZ_EXAMPLES`, 6 per operation);
`pytest -m slow tests/server/robustness/test_fuzz.py` runs 60 per operation.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (dev extra)")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance  # noqa: E402

from tests.conftest import RunningServer  # noqa: E402

FUZZ_SETTINGS = {"max_model_len": 64, "max_n": 2, "request_timeout": 10, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def fuzz_server(make_server) -> Iterator[RunningServer]:  # noqa: ANN001
    with make_server(**FUZZ_SETTINGS) as srv:
        yield srv


def _fuzz(srv: RunningServer, examples: int) -> list[str]:
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    fuzzed = []
    for result in schema.get_all_operations():
        op = result.ok()
        fuzzed.append(op.label)

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case) -> None:  # noqa: ANN001
            if isinstance(case.body, dict) and "model" in case.body:
                # A random model name is always a 404: name the served model so the request goes deeper.
                case.body["model"] = srv.client.model_name
            case.call_and_validate(base_url=srv.url, checks=[not_a_server_error, response_schema_conformance])

        run()
        assert srv.client.alive, f"the engine died while fuzzing {op.label}"
    return fuzzed


def test_fuzz_openapi_no_5xx(fuzz_server: RunningServer) -> None:
    fuzzed = _fuzz(fuzz_server, int(os.environ.get("FUZZ_EXAMPLES", "6")))
    for route in ("POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize", "GET /v1/models"):
        assert route in fuzzed, fuzzed
    assert fuzz_server.idle()


@pytest.mark.slow
def test_fuzz_openapi_no_5xx_long(fuzz_server: RunningServer) -> None:
    _fuzz(fuzz_server, 60)
    assert fuzz_server.idle()
