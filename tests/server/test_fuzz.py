"""Hypothesis-generated request bodies from the server's own OpenAPI schema: zero 5xx.

Each body field is drawn either from its schema (values near the declared bounds, enum
members, nested objects) or from arbitrary JSON, so both valid and subtly invalid requests
reach the handlers. Valid ones really generate (on the tiny model).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

ENDPOINTS = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
}
JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
ANY_JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)

# Where the schema alone allows values the server must refuse (an empty prompt, a
# context-sized max_tokens), valid bodies draw from these instead.
_TEXT = st.text(min_size=1, max_size=30)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": _TEXT}
)
VALID_OVERRIDES = {
    "model": st.sampled_from(["tiny", "tiny-alias"]),
    "prompt": _TEXT | st.lists(st.integers(0, 49151), min_size=1, max_size=20),
    "messages": st.lists(_MESSAGE, min_size=1, max_size=3),
    "stop": st.none() | _TEXT | st.lists(_TEXT, max_size=3),
    "max_tokens": st.integers(1, 16),
    "max_completion_tokens": st.integers(1, 16),
}


class SchemaStrategies:
    """JSON-schema fragments (as FastAPI/pydantic emit them) to hypothesis strategies.

    `valid=True` stays inside declared types and bounds; `valid=False` also goes to and just
    past the bounds."""

    def __init__(self, schema: dict) -> None:
        self._components = schema["components"]["schemas"]

    def body(
        self, name: str, overrides: dict[str, st.SearchStrategy], broken: bool
    ) -> st.SearchStrategy:
        """Bodies of component `name`: required fields always, optional ones a third of the
        time, all drawn inside the schema; with `broken`, one or two fields (perhaps
        required ones) are then replaced by out-of-bounds values or arbitrary JSON."""
        properties = self._components[name]["properties"]
        required = set(self._components[name].get("required", ()))
        valid = {k: overrides.get(k, self.value(v, valid=True)) for k, v in properties.items()}
        wrong = {k: self.value(v, valid=False) | ANY_JSON for k, v in properties.items()}

        @st.composite
        def build(draw):
            keys = [k for k in properties if k in required or draw(st.integers(0, 2)) == 0]
            body = {key: draw(valid[key]) for key in keys}
            if broken:
                for key in draw(
                    st.lists(st.sampled_from(sorted(properties)), min_size=1, max_size=2)
                ):
                    body[key] = draw(wrong[key])
            return body

        return build()

    def value(self, schema: dict, valid: bool, depth: int = 0) -> st.SearchStrategy:
        if depth > 4:
            return JSON_SCALARS
        if "$ref" in schema:
            return self._object(self._components[schema["$ref"].rsplit("/", 1)[1]], valid, depth)
        if "anyOf" in schema:
            return st.one_of([self.value(s, valid, depth + 1) for s in schema["anyOf"]])
        if "const" in schema or "enum" in schema:
            options = st.sampled_from(schema.get("enum", [schema.get("const")]))
            return options if valid else options | st.text(max_size=8)
        kind = schema.get("type")
        if kind in ("integer", "number"):
            return self._number(schema, valid, integer=kind == "integer")
        if kind == "string":
            return st.text(max_size=40)
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        if kind == "array":
            return st.lists(
                self.value(schema.get("items", {}), valid, depth + 1),
                min_size=schema.get("minItems", 0) if valid else 0,
                max_size=3,
            )
        if kind == "object":
            return self._object(schema, valid, depth)
        return ANY_JSON

    def _object(self, schema: dict, valid: bool, depth: int) -> st.SearchStrategy:
        properties = schema.get("properties")
        if not properties:
            return st.dictionaries(st.text(max_size=8), JSON_SCALARS, max_size=3)
        fields = {k: self.value(v, valid, depth + 1) for k, v in properties.items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )

    @staticmethod
    def _number(schema: dict, valid: bool, integer: bool) -> st.SearchStrategy:
        # Unbounded integers here are token ids and counts: small non-negative values.
        low = schema.get("minimum", schema.get("exclusiveMinimum", 0))
        high = schema.get("maximum", schema.get("exclusiveMaximum", 50))
        if "exclusiveMinimum" in schema:
            low += 1 if integer else 1e-3
        # Small values generate quickly (a huge max_tokens is valid but slow, a huge
        # min_tokens exceeds max_tokens); the bounds and just past them count as broken.
        near_low = min(high, low + 8)
        if integer:
            low, high, near_low = int(low), int(high), int(near_low)
        inside = st.integers(low, near_low) if integer else st.floats(low, near_low)
        if valid:
            return inside
        edges = st.sampled_from([low - 1, low, high, high + 1])
        return inside | (edges if integer else edges.map(float))


@pytest.fixture(scope="module")
def schema_strategies(tiny_server) -> SchemaStrategies:
    return SchemaStrategies(httpx.get(f"{tiny_server.url}/openapi.json").json())


def check_response(response: httpx.Response, body: dict) -> None:
    context = f"body={json.dumps(body)[:500]} -> {response.status_code} {response.text[:500]}"
    assert response.status_code < 500, context
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}, context
    elif body.get("stream") is True:
        assert response.text.rstrip().endswith("data: [DONE]"), context
        assert '"internal_error"' not in response.text, context
    else:
        assert response.json()["usage"]["completion_tokens"] >= 1, context


def short(bodies: st.SearchStrategy) -> st.SearchStrategy:
    """Without a limit, chat generates to the end of the context: keep examples quick."""
    return bodies.map(lambda body: {"max_tokens": 8, **body})


def fuzz(server, strategy, endpoint: str, max_examples: int) -> list[int]:
    """POST every generated body; check each answer; return the status codes."""
    statuses = []
    with httpx.Client(base_url=server.url, timeout=60) as client:

        @settings(
            max_examples=max_examples,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(body=strategy)
        def run(body):
            response = client.post(endpoint, json=body)
            statuses.append(response.status_code)
            check_response(response, body)

        run()
    return statuses


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_fuzzed_valid_bodies_generate(tiny_server, schema_strategies, endpoint):
    strategy = short(schema_strategies.body(ENDPOINTS[endpoint], VALID_OVERRIDES, broken=False))
    statuses = fuzz(tiny_server, strategy, endpoint, max_examples=60)
    # Schema-valid bodies can still be refused (echo, top_logprobs without logprobs,
    # min_tokens > max_tokens, a chat template past the context), but many generate.
    assert statuses.count(200) >= len(statuses) // 4, statuses


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_fuzzed_broken_bodies_are_refused_cleanly(tiny_server, schema_strategies, endpoint):
    strategy = short(schema_strategies.body(ENDPOINTS[endpoint], VALID_OVERRIDES, broken=True))
    statuses = fuzz(tiny_server, strategy, endpoint, max_examples=100)
    # A replaced field may land inside its schema again; still, many must be refused.
    assert statuses.count(400) >= len(statuses) // 5, statuses
    metrics = tiny_server.metrics()
    assert metrics["pdserve:num_requests_running"] == 0
    assert metrics["pdserve:kv_cache_free_blocks"] == metrics["pdserve:kv_cache_total_blocks"]


@given(raw=st.binary(max_size=200) | ANY_JSON.map(lambda v: json.dumps(v).encode()))
@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_fuzzed_raw_bytes_never_5xx(tiny_server, raw):
    for endpoint in ENDPOINTS:
        response = httpx.post(
            f"{tiny_server.url}{endpoint}",
            content=raw,
            headers={"Content-Type": "application/json"},
        )
        assert response.status_code < 500, (raw, response.text)
