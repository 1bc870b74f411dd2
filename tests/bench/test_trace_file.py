"""Trace files: Azure CSV (CRLF) and JSONL, windows, time scaling, length caps."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from pdserve.workload import (
    TraceEntry,
    TraceWindow,
    default_trace_path,
    load_trace,
    write_trace_jsonl,
)
from pdserve.workload.errors import BenchError

AZURE_ROWS = [
    ("2023-11-16 18:15:46.6805900", 374, 44),
    ("2023-11-16 18:15:50.9951690", 396, 109),
    ("2023-11-16 18:15:51.2224670", 8790, 55),
    ("2023-11-16 18:15:51.3910170", 91, 16),
    ("2023-11-16 18:16:01.0000000", 0, 0),
]


@pytest.fixture
def azure_csv(tmp_path):
    path = tmp_path / "azure.csv"
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [f"{t},{c},{g}" for t, c, g in AZURE_ROWS]
    path.write_bytes(("\r\n".join(lines) + "\r\n").encode())
    return path


def test_azure_csv_loads_with_crlf_and_seven_digit_fractions(azure_csv):
    entries = load_trace(azure_csv)
    assert [e.timestamp for e in entries] == pytest.approx(
        [0.0, 4.314579, 4.541877, 4.710427, 14.31941]
    )
    assert [e.prompt_len for e in entries] == [374, 396, 8790, 91, 1]  # zero clipped to 1
    assert [e.output_len for e in entries] == [44, 109, 55, 16, 1]
    assert all(e.prompt is None for e in entries)


def test_window_start_count_scale_and_caps(azure_csv):
    entries = load_trace(azure_csv)
    window = TraceWindow(
        start_s=4.0, num_prompts=3, time_scale=2.0, max_input_len=4096, max_output_len=50
    )
    picked = window.select(entries, np.random.default_rng(0))
    assert [e.prompt_len for e in picked] == [396, 4096, 91]
    assert [e.output_len for e in picked] == [50, 50, 16]
    # Rebased to the window's first request, then stretched 2x.
    assert [e.timestamp for e in picked] == pytest.approx([0.0, 0.454596, 0.791696])


def test_window_by_duration(azure_csv):
    picked = TraceWindow(start_s=4.0, duration_s=1.0).select(
        load_trace(azure_csv), np.random.default_rng(0)
    )
    assert len(picked) == 3


def test_random_window_is_reproducible_and_fits():
    entries = [TraceEntry(float(t), 1, prompt_len=1) for t in range(100)]
    window = TraceWindow(start_s=None, num_prompts=10)
    a = window.select(entries, np.random.default_rng(3))
    assert a == window.select(entries, np.random.default_rng(3))
    assert len(a) == 10
    starts = {window.select(entries, np.random.default_rng(s))[0].prompt_len for s in range(5)}
    assert starts == {1}


def test_jsonl_round_trip_and_literal_prompts(tmp_path):
    entries = [
        TraceEntry(0.0, 3, prompt_len=12),
        TraceEntry(0.25, 4, prompt="Write a haiku."),
    ]
    path = tmp_path / "t.jsonl"
    write_trace_jsonl(entries, path)
    assert load_trace(path) == entries


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"timestamp": "x", "prompt_len": 3, "output_len": 2}', "'timestamp' must be a number"),
        ('{"timestamp": 1, "prompt_len": 3}', "'output_len' must be an integer"),
        ('{"timestamp": 1, "output_len": 2}', "needs a non-empty 'prompt'"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "prompt_len": 3, "output_len": 2}\n' + line + "\n")
    with pytest.raises(BenchError, match=rf"bad\.jsonl:2: .*{message}"):
        load_trace(path)


def test_bad_csv_is_rejected_clearly(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(BenchError, match="expected columns TIMESTAMP,ContextTokens"):
        load_trace(path)
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n")
    with pytest.raises(BenchError, match=r"x\.csv:2: bad TIMESTAMP"):
        load_trace(path)
    with pytest.raises(BenchError, match="no such file"):
        load_trace(tmp_path / "missing.jsonl")


def test_empty_window_is_an_error(azure_csv):
    with pytest.raises(BenchError, match="window holds no requests"):
        TraceWindow(start_s=1000.0).select(load_trace(azure_csv), np.random.default_rng(0))


def test_the_default_trace_ships_inside_the_package():
    import pdserve

    path = default_trace_path()
    assert path.is_relative_to(Path(pdserve.__file__).parent) and path.name.endswith(".csv.gz")
    assert (path.parent / "README.md").read_text().count("CC-BY-4.0") == 1  # provenance
    entries = load_trace(path)
    assert len(entries) == 19_366
    assert entries[-1].timestamp == pytest.approx(3502, abs=2)
    assert max(e.prompt_len for e in entries) == 14_050
    # The very rows of the trace it was compressed from, where that is beside the checkout.
    shared = Path(pdserve.__file__).parents[2] / "shared" / "traces" / path.name[: -len(".gz")]
    if shared.is_file():
        assert gzip.decompress(path.read_bytes()) == shared.read_bytes()


def test_a_missing_trace_is_a_clear_error(tmp_path):
    missing = tmp_path / "nowhere.csv"
    with pytest.raises(BenchError, match="no such file") as error:
        load_trace(missing)
    assert str(missing) in str(error.value) and "shipped with pdserve" in str(error.value)


def test_gzipped_traces_load_like_plain_ones(tmp_path, azure_csv):
    zipped = tmp_path / "azure.csv.gz"
    zipped.write_bytes(gzip.compress(azure_csv.read_bytes()))
    assert load_trace(zipped) == load_trace(azure_csv)
