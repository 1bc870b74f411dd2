"""A record of every engine step: what was batched and how long it took.

One JSON line per step, `{"batch": [[new_tokens, context_tokens, is_sampling], ...],
"step_s": seconds}` — the format `pdserve simulate calibrate --steps` fits the cost model to,
so a simulator can be calibrated on the steps of real served traffic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.core.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepRecord:
    """One step: per scheduled sequence (new tokens, tokens already in its KV cache, whether
    it samples), and the step's wall time from scheduling to outputs."""

    batch: tuple[tuple[int, int, bool], ...]
    step_s: float

    def to_json(self) -> str:
        return json.dumps({"batch": [list(seq) for seq in self.batch], "step_s": self.step_s})


def step_batch(output: SchedulerOutput) -> tuple[tuple[int, int, bool], ...]:
    """A `StepRecord.batch`; call before the scheduler applies the step (context = tokens
    computed before it)."""
    return tuple(
        (s.num_new_tokens, s.request.num_computed_tokens, s.is_sampling) for s in output.scheduled
    )


class StepLog:
    """Appends `StepRecord`s to a JSONL file (line-buffered: a killed worker keeps its log)."""

    def __init__(self, path: str | Path) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (closed by close())

    def __call__(self, record: StepRecord) -> None:
        self._file.write(record.to_json() + "\n")

    def close(self) -> None:
        self._file.close()
