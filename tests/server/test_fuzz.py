"""Arbitrary bytes and JSON as request bodies: a clean 4xx, never a 5xx.

Bodies drawn from the published schema, valid and invalid, are schemathesis's job
(`test_openapi.py`); these are the ones no schema describes.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize")
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
