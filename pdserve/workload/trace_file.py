"""Trace files: pdserve's JSONL and the Azure LLM inference CSV, and windows cut from them.

JSONL, one request a line: `{"timestamp": seconds, "prompt": text, "output_len": n}` or
`{"timestamp": seconds, "prompt_len": n, "output_len": n}`.
Azure CSV (CRLF): `TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps like
`2023-11-16 18:15:46.6805900`. Either may be gzipped (`.jsonl.gz`, `.csv.gz`). The default,
the Azure conversation trace, ships inside the package (`workload/data/`, its README says
where it comes from and its licence).
"""

from __future__ import annotations

import calendar
import csv
import gzip
import json
import math
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import numpy as np

from pdserve.workload.errors import BenchError

AZURE_COLUMNS = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
AZURE_TRACE_NAME = "azure_llm_inference_2023_conv.csv"


@dataclass(frozen=True)
class TraceEntry:
    """One traced request: arrival time (seconds from the trace start) and its lengths.

    Exactly one of `prompt` (literal text) and `prompt_len` (tokens to synthesize) is set.
    """

    timestamp: float
    output_len: int
    prompt: str | None = None
    prompt_len: int | None = None


def default_trace_path() -> Path:
    """The Azure conversation trace shipped inside the package (gzipped)."""
    return Path(__file__).resolve().parent / "data" / f"{AZURE_TRACE_NAME}.gz"


def load_trace(path: str | Path) -> list[TraceEntry]:
    """Read a `.jsonl` or Azure `.csv` trace, sorted by timestamp, rebased to start at 0."""
    path = Path(path)
    if not path.is_file():
        raise BenchError(
            f"--trace {path}: no such file (a .jsonl or Azure .csv trace, gzipped or not; "
            f"without --trace the Azure conversation trace shipped with pdserve is replayed)"
        )
    is_csv = path.name.lower().removesuffix(".gz").endswith(".csv")
    entries = _read_azure_csv(path) if is_csv else _read_jsonl(path)
    if not entries:
        raise BenchError(f"--trace {path}: no requests in the file")
    entries.sort(key=lambda e: e.timestamp)
    start = entries[0].timestamp
    return [replace(e, timestamp=e.timestamp - start) for e in entries]


def write_trace_jsonl(entries: list[TraceEntry], path: str | Path) -> None:
    """Write entries as pdserve trace JSONL (the format `load_trace` reads back)."""
    with open(path, "w", encoding="utf-8") as f:
        for e in entries:
            row: dict = {"timestamp": round(e.timestamp, 6)}
            if e.prompt is not None:
                row["prompt"] = e.prompt
            else:
                row["prompt_len"] = e.prompt_len
            row["output_len"] = e.output_len
            f.write(json.dumps(row) + "\n")


@dataclass(frozen=True)
class TraceWindow:
    """Which part of a trace to replay and how.

    `start_s` is an offset into the trace, or None to pick a start at random (from the seed)
    such that the window fits. The window ends after `num_prompts` requests or `duration_s`
    seconds, whichever comes first. Timestamps are then rebased to 0 and multiplied by
    `time_scale` (2.0 replays at half speed). Lengths above the caps are clipped to them.
    """

    start_s: float | None = 0.0
    num_prompts: int | None = None
    duration_s: float | None = None
    time_scale: float = 1.0
    max_input_len: int | None = None
    max_output_len: int | None = None

    def __post_init__(self) -> None:
        if self.start_s is not None and not self.start_s >= 0:
            raise BenchError(f"--trace-window-start must be >= 0, got {self.start_s}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise BenchError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise BenchError(f"--trace-duration must be > 0, got {self.duration_s}")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise BenchError(f"--trace-time-scale must be a positive number, got {self.time_scale}")
        for option, cap in (
            ("--trace-max-input-len", self.max_input_len),
            ("--trace-max-output-len", self.max_output_len),
        ):
            if cap is not None and cap < 1:
                raise BenchError(f"{option} must be >= 1, got {cap}")

    def select(self, entries: list[TraceEntry], rng: np.random.Generator) -> list[TraceEntry]:
        """Cut this window from entries sorted by timestamp."""
        times = np.array([e.timestamp for e in entries])
        first = self._first_index(times, rng)
        end = len(entries)
        if self.duration_s is not None:
            end = int(np.searchsorted(times, times[first] + self.duration_s, side="left"))
        if self.num_prompts is not None:
            end = min(end, first + self.num_prompts)
        window = entries[first:end]
        if not window:
            raise BenchError("the trace window holds no requests; move or widen it")
        start = window[0].timestamp
        return [self._shape(e, start) for e in window]

    def _first_index(self, times: np.ndarray, rng: np.random.Generator) -> int:
        if self.start_s is not None:
            return int(np.searchsorted(times, times[0] + self.start_s, side="left"))
        if self.duration_s is not None:
            last_start = times[-1] - self.duration_s
            return int(np.searchsorted(times, rng.uniform(0.0, max(last_start, 0.0))))
        span = len(times) - (self.num_prompts or len(times))
        return int(rng.integers(0, max(span, 0) + 1))

    def _shape(self, entry: TraceEntry, start: float) -> TraceEntry:
        prompt_len = entry.prompt_len
        if prompt_len is not None and self.max_input_len is not None:
            prompt_len = min(prompt_len, self.max_input_len)
        output_len = entry.output_len
        if self.max_output_len is not None:
            output_len = min(output_len, self.max_output_len)
        timestamp = (entry.timestamp - start) * self.time_scale
        return replace(entry, timestamp=timestamp, prompt_len=prompt_len, output_len=output_len)


def _open_text(path: Path, newline: str | None = None):
    """`path` for reading as UTF-8 text, through gzip when its name ends in .gz."""
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline=newline)
    return open(path, encoding="utf-8", newline=newline)


def _read_jsonl(path: Path) -> list[TraceEntry]:
    entries = []
    with _open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                entries.append(_parse_jsonl_row(line, f"{path}:{line_no}"))
    return entries


def _parse_jsonl_row(line: str, where: str) -> TraceEntry:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BenchError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise BenchError(f"{where}: expected a JSON object")
    timestamp = _number(row, "timestamp", where)
    output_len = _count(row, "output_len", where)
    if isinstance(row.get("prompt"), str) and row["prompt"]:
        return TraceEntry(timestamp, output_len, prompt=row["prompt"])
    if "prompt_len" in row:
        return TraceEntry(timestamp, output_len, prompt_len=_count(row, "prompt_len", where))
    raise BenchError(f"{where}: needs a non-empty 'prompt' string or a 'prompt_len'")


def _number(row: dict, key: str, where: str) -> float:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BenchError(f"{where}: '{key}' must be a number, got {value!r}")
    return float(value)


def _count(row: dict, key: str, where: str) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BenchError(f"{where}: '{key}' must be an integer >= 1, got {value!r}")
    return value


def _read_azure_csv(path: Path) -> list[TraceEntry]:
    entries = []
    with _open_text(path, newline="") as f:
        reader = csv.reader(f)
        header = [c.strip() for c in next(reader, [])]
        if header != AZURE_COLUMNS:
            raise BenchError(f"{path}: expected columns {','.join(AZURE_COLUMNS)}, got {header}")
        for line_no, row in enumerate(reader, start=2):
            if row:
                entries.append(_parse_azure_row(row, f"{path}:{line_no}"))
    return entries


def _parse_azure_row(row: list[str], where: str) -> TraceEntry:
    if len(row) != 3:
        raise BenchError(f"{where}: expected 3 columns, got {len(row)}")
    stamp, context, generated = (c.strip() for c in row)
    try:
        prompt_len, output_len = int(context), int(generated)
    except ValueError:
        raise BenchError(f"{where}: token counts must be integers, got {row[1:]}") from None
    # Zero-length rows exist in public traces; a request needs at least one token each way.
    return TraceEntry(_azure_seconds(stamp, where), max(output_len, 1), None, max(prompt_len, 1))


def _azure_seconds(stamp: str, where: str) -> float:
    # 7 fractional digits, more than strptime's %f takes: parse the two parts separately.
    whole, _, fraction = stamp.partition(".")
    try:
        moment = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
        return calendar.timegm(moment.timetuple()) + float("0." + (fraction or "0"))
    except ValueError:
        raise BenchError(f"{where}: bad TIMESTAMP {stamp!r}") from None
