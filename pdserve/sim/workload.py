"""What the simulator serves: request lengths and arrival times, from pdserve.workload's workloads.

The benchmark builds requests as text of exact token lengths; the simulator needs only the
lengths, so it runs the same workload definitions with a synthesizer that writes no text, and
the same seeded arrival processes. (Lengths drawn after text synthesis, such as the mixed
workload's long documents, therefore differ from a benchmark run with the same seed; to replay
one measured run exactly, use `specs_from_bench_result`.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.sim.errors import SimConfigError
from pdserve.workload import PrefixRepetitionWorkload, Workload
from pdserve.workload.errors import BenchError
from pdserve.workload.run import CONTENT_STREAM, WorkloadPlan, seeded_rng


@dataclass(frozen=True)
class SimRequestSpec:
    """One request as the simulator sees it.

    Requests with the same `prefix_group` share their first `prefix_len` prompt tokens (a
    system prompt), so the real prefix cache can serve them.
    """

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    prefix_group: int | None = None
    prefix_len: int = 0
    kind: str = "default"

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise SimConfigError(
                f"request {self.request_id}: prompt and output lengths must "
                f"be >= 1, got {self.prompt_len} and {self.output_len}"
            )
        if not 0 <= self.prefix_len <= self.prompt_len:
            raise SimConfigError(f"request {self.request_id}: prefix_len must be within the prompt")


class LengthOnlySynthesizer:
    """Stands in for the benchmark's PromptSynthesizer: lengths are given, text is empty."""

    @property
    def tokenizer(self):
        raise SimConfigError(
            "this trace holds literal prompt text; the simulator needs "
            "prompt_len per request (pdserve bench convert-trace writes it)"
        )

    def num_tokens(self, text: str) -> int:
        return 0

    def text(self, num_tokens: int, rng: np.random.Generator, lead: str = "") -> str:
        return ""


def plan_requests(
    workload: Workload,
    *,
    seed: int,
    request_rate: float | None,
    burstiness: float = 1.0,
    max_model_len: int | None = None,
) -> list[SimRequestSpec]:
    """The workload's requests and arrivals for `seed`, as the benchmark would send them."""
    try:
        requests = workload.build(
            LengthOnlySynthesizer(), seeded_rng(seed, CONTENT_STREAM), max_model_len
        )
        plan = WorkloadPlan(workload, tuple(requests), seed, max_model_len)
        times = plan.arrivals(request_rate, burstiness)
    except BenchError as exc:
        raise SimConfigError(str(exc)) from None
    prefix_len = workload.prefix_len if isinstance(workload, PrefixRepetitionWorkload) else 0
    return [
        _spec(i, float(t), r.prompt_len, r.output_len, r.kind, prefix_len)
        for i, (r, t) in enumerate(zip(requests, times, strict=True))
    ]


def specs_from_bench_result(path: str | Path) -> tuple[list[SimRequestSpec], dict]:
    """Replay a `pdserve bench --save-result` run: its requests at their scheduled arrival
    times. Also returns the run's config (max_concurrency, seed, workload, ...)."""
    try:
        data = json.loads(Path(path).read_text())
        if "sweep" in data:
            raise SimConfigError(f"{path} holds a rate sweep; replay one run's file")
        run = data["pdserve"]
        records = run["records"]
        config = run.get("config", {})
        prefix_len = int(config.get("workload", {}).get("prefix_len") or 0)
        specs = [
            _spec(
                r["index"],
                r["arrival_time"],
                r["prompt_len"],
                r["output_len"],
                r.get("kind", "default"),
                prefix_len,
            )
            for r in records
        ]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise SimConfigError(
            f"--workload-from: {path} is not a pdserve bench result ({exc})"
        ) from None
    return specs, config


def _spec(
    index: int, arrival: float, prompt_len: int, output_len: int, kind: str, prefix_len: int
) -> SimRequestSpec:
    # prefix-repetition labels each request "prefix-<i>" with the shared prefix it uses.
    group = None
    if kind.startswith("prefix-") and kind.removeprefix("prefix-").isdigit():
        group = int(kind.removeprefix("prefix-"))
    shared = min(prefix_len, prompt_len - 1) if group is not None else 0
    return SimRequestSpec(
        str(index), arrival, int(prompt_len), int(output_len), group, shared, kind
    )
