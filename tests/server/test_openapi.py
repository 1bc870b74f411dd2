"""The published OpenAPI documents say exactly what the server and the router accept and answer.

- Both documents are valid OpenAPI 3.1, list the envelope for every error and never FastAPI's
  422 (in process, no model needed beyond the tiny one).
- schemathesis, as a user runs it (`schemathesis run URL/openapi.json --checks all`), against a
  real `pdserve serve` and a real `pdserve serve --mode disagg` (router, prefill and decode
  workers) on the tiny random model, an API key required: zero failures. Schema-valid bodies
  are kept within the model's limits and generate a few seeded tokens
  (`schemathesis_hooks`); the examples are seeded too, so a failure reproduces.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest
from openapi_spec_validator import validate

from pdserve.bench.processes import metric_values
from pdserve.router.app import build_app
from pdserve.router.config import RouterConfig
from pdserve.server.app import create_app
from pdserve.server.settings import ServerSettings
from tests.router.real_workers import Disagg, assert_no_blocks_held
from tests.server.conftest import start_server, tiny_engine

API_KEY = "conformance-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 1024
# Per operation and phase, as in the command; a run takes about half a minute.
MAX_EXAMPLES = 40
REPO_ROOT = Path(__file__).resolve().parents[2]
ERROR_STATUSES = {"400", "401", "404", "409", "413", "429", "500", "502", "503"}


@pytest.fixture(scope="module")
def documents(tiny_model_dir) -> dict[str, dict]:
    """The server's with an API key, the router's without."""
    server = create_app(
        tiny_engine(tiny_model_dir),
        ServerSettings(served_model_names=("tiny",), api_key=API_KEY),
    )
    router = build_app(RouterConfig(prefill_urls=(), decode_urls=("http://127.0.0.1:1",)))
    return {"server": server.openapi(), "router": router.openapi()}


@pytest.mark.parametrize("app", ["server", "router"])
def test_document_is_valid_openapi_31_with_real_answers(documents, app):
    document = documents[app]
    validate(document)  # raises on any violation of OpenAPI 3.1
    assert document["openapi"].startswith("3.1")
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    for path, item in document["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            if path == "/health":
                continue  # its 503 is the health report
            for status in ERROR_STATUSES & set(responses):
                schema = responses[status]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (path, status)
            if "requestBody" in operation:
                assert {"400", "413"} <= set(responses), (method, path)
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    for endpoint in ("/v1/completions", "/v1/chat/completions"):
        answer = document["paths"][endpoint]["post"]["responses"]["200"]["content"]
        assert set(answer) == {"application/json", "text/event-stream"}


def test_only_a_server_with_a_key_documents_401(documents):
    server, router = documents["server"], documents["router"]
    assert server["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"}
    }
    assert "401" in server["paths"]["/v1/completions"]["post"]["responses"]
    assert "401" not in server["paths"]["/tokenize"]["post"]["responses"]  # not behind the key
    assert "securitySchemes" not in router["components"]
    assert "401" not in router["paths"]["/workers"]["get"]["responses"]


def test_request_rules_are_in_the_document(documents):
    schemas = documents["server"]["components"]["schemas"]
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert {"type": "string", "minLength": 1} in prompt
    chat = schemas["ChatCompletionRequest"]
    assert chat["if"]["required"] == ["top_logprobs"]
    assert chat["then"]["properties"]["logprobs"] == {"const": True}
    assert schemas["ChatMessage"]["then"]["required"] == ["content"]
    assert len(schemas["TokenizeRequest"]["oneOf"]) == 2
    assert "kv_transfer_params" not in schemas["CompletionRequest"]["properties"]


def run_schemathesis(url: str, workdir: Path, kept_workers: Sequence[str] = ()) -> str:
    """`schemathesis run` against `url` (never draining or switching `kept_workers`); its
    whole output, asserted free of failures."""
    env = {
        **os.environ,
        "PDSERVE_TEST_KEPT_WORKERS": ",".join(kept_workers),
        "SCHEMATHESIS_HOOKS": "tests.server.schemathesis_hooks",
        "PYTHONPATH": str(REPO_ROOT),
        # A chat template adds ~40 tokens; each prompt byte is at most one token.
        "PDSERVE_TEST_MAX_PROMPT_BYTES": str(MAX_MODEL_LEN - 128),
    }
    command = [
        str(Path(sys.executable).with_name("schemathesis")),
        "run",
        f"{url}/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--generation-deterministic",  # the same examples every run, no example database
        "--workers",
        "1",
        "--no-color",
        "--request-timeout",
        "60",
        # A worker's KV-event subscription streams until the subscriber leaves, so every valid
        # call would wait out the timeout; tests/router/test_kv_events.py covers it.
        "--exclude-path",
        "/kv/events",
        "-H",
        f"Authorization: {AUTH['Authorization']}",
    ]
    result = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=600
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # Warnings (an operation that kept answering 404 to generated ids) are not findings.
    assert "Failures:" not in output and " passed" in output, output
    print(output[-2500:])  # shown with -s or -rA: what was tested
    return output


@pytest.mark.slow
def test_schemathesis_finds_nothing_on_the_server(tmp_path, tiny_model_dir):
    server = start_server(
        tmp_path,
        "--model",
        str(tiny_model_dir),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        api_key=API_KEY,
    )
    try:
        run_schemathesis(server.url, tmp_path)
        metrics = server.metrics()
    finally:
        server.stop()
    # Valid bodies really generated, and nothing was left behind.
    assert sum(v for k, v in metrics.items() if k.startswith("pdserve:request_success")) >= 20
    assert metrics["pdserve:num_requests_running"] == 0
    assert metrics["pdserve:kv_cache_free_blocks"] == metrics["pdserve:kv_cache_total_blocks"]


@pytest.mark.slow
def test_schemathesis_finds_nothing_on_the_disaggregated_router(tmp_path, tiny_model_dir):
    router = Disagg(
        tmp_path,
        "disagg",
        "--model",
        str(tiny_model_dir),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--api-key",
        API_KEY,
        # POST /workers health-checks the generated URLs at once; an unresolvable host waits.
        "--health-check-timeout",
        "1",
    )
    try:
        router.wait_healthy()
        listing = httpx.get(f"{router.url}/workers", headers=AUTH, trust_env=False).json()
        # The run registers workers and drains them; the launcher's are kept out of its drains
        # and role switches (a drained worker the launcher started is stopped).
        urls = [w["url"] for w in listing["workers"]]
        run_schemathesis(router.url, tmp_path, [w["id"] for w in listing["workers"]])
        assert_no_blocks_held(urls)
        successes = [metric_values(url)["pdserve:request_success_total"] for url in urls]
    finally:
        router.process.stop()
    assert min(successes) >= 20, successes  # both legs of many requests ran
