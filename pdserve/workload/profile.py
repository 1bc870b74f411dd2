"""`profile`: what a cost model needs to know about a server, measured from outside.

Two sweeps, each point repeated: the time to first token of single requests across prompt
lengths at no load (prefill time against tokens), and the inter-token latency of N streams
decoding together at a few context lengths (decode step time against batch and context).
Each point is one phase: its requests are sent together once the previous phase is done
(`Workload.phases`), so nothing else runs on the server. `profile_points` turns a run's
records into the points with their spread; `pdserve simulate calibrate --bench` fits them.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from pdserve.workload.base import BenchRequest, Workload, check_positive, make_request
from pdserve.workload.errors import BenchError
from pdserve.workload.prompts import PromptSynthesizer
from pdserve.workload.records import RequestRecord

TTFT = "ttft"
ITL = "itl"
# Decoding streams start together and prefill first; each stream generates this many tokens
# per this many prompt tokens of the whole phase beyond its `output_len`, so that the steady
# window (every stream decoding) keeps `output_len` tokens under any chunk budget >= it.
_PREFILL_TOKENS_PER_EXTRA_TOKEN = 256


@dataclass(frozen=True)
class ProfileWorkload(Workload):
    """TTFT at `prompt_lens` (capped by the context), ITL at `num_streams` × `contexts`
    (while streams × (context + output) <= `max_batch_tokens`), each `num_prompts` times."""

    num_prompts: int = 3
    # Every half octave: where a step turns from memory- to compute-bound tells the two apart.
    prompt_lens: tuple[int, ...] = (
        128,
        181,
        256,
        362,
        512,
        724,
        1024,
        1448,
        2048,
        2896,
        4096,
        5793,
        8192,
        11585,
        16384,
    )
    num_streams: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    contexts: tuple[int, ...] = (128, 1024, 4096)
    output_len: int = 32
    max_batch_tokens: int = 32768
    name = "profile"

    def __post_init__(self) -> None:
        check_positive("--num-prompts (profile: repeats per point)", self.num_prompts)
        check_positive("--output-len (profile: tokens per decoding stream)", self.output_len)
        for option, values in (
            ("--input-len (profile: prompt lengths)", self.prompt_lens),
            ("profile stream counts", self.num_streams),
            ("profile contexts", self.contexts),
        ):
            if not values:
                raise BenchError(f"{option}: give at least one")
            for value in values:
                check_positive(option, value)

    def points(self, max_model_len: int | None) -> list[tuple[str, int, int, int]]:
        """(kind, streams, prompt tokens, output tokens) of every point, in run order."""
        limit = max_model_len or max(self.prompt_lens) + 1
        points = [(TTFT, 1, min(p, limit - 1), 1) for p in self.prompt_lens if p < limit]
        for context in self.contexts:
            for streams in self.num_streams:
                extra = streams * context // _PREFILL_TOKENS_PER_EXTRA_TOKEN
                output = self.output_len + 1 + extra
                fits = context + output <= limit
                if fits and streams * (context + output) <= self.max_batch_tokens:
                    points.append((ITL, streams, context, output))
        if not points:
            raise BenchError(f"profile: no point fits a context of {max_model_len} tokens")
        return points

    def build(
        self, synth: PromptSynthesizer, rng: np.random.Generator, max_model_len: int | None
    ) -> list[BenchRequest]:
        requests = []
        for repeat in range(self.num_prompts):
            for kind, streams, prompt_len, output_len in self.points(max_model_len):
                label = f"profile:{kind}:{streams}:{prompt_len}:{repeat}"
                requests += [
                    make_request(synth, rng, prompt_len, output_len, max_model_len, label)
                    for _ in range(streams)
                ]
        return requests

    def phases(self, requests: list[BenchRequest]) -> list[list[int]]:
        """One phase per point and repeat: the runs of requests `build` labelled alike."""
        phases: list[list[int]] = []
        for i, request in enumerate(requests):
            if i and request.kind == requests[i - 1].kind:
                phases[-1].append(i)
            else:
                phases.append([i])
        return phases


def profile_points(records: list[RequestRecord]) -> list[dict]:
    """The points of a profile run: per point its median over the repeats, each repeat's
    value, their spread ((max − min) / median), and for ITL the mean context of the steps
    measured and every single token gap (seconds). Points whose requests failed are left out.
    """
    runs: dict[tuple[str, int, int], list[list[RequestRecord]]] = defaultdict(list)
    for label, group in _phases(records).items():
        _, kind, streams, prompt_len, _ = label.split(":")
        if all(r.success for r in group):
            runs[(kind, int(streams), int(prompt_len))].append(group)
    points = []
    for (kind, streams, prompt_len), groups in runs.items():
        point = {"kind": kind, "num_streams": streams, "prompt_len": prompt_len}
        if kind == TTFT:
            values = [group[0].ttft for group in groups]
        else:
            windows = [_steady_gaps(group) for group in groups]
            windows = [w for w in windows if w[0]]
            if not windows:
                continue
            values = [statistics.median(gaps) for gaps, _ in windows]
            point["context"] = statistics.fmean(c for _, contexts in windows for c in contexts)
            point["observations"] = [g for gaps, _ in windows for g in gaps]
        median = statistics.median(values)
        point.update(seconds=median, repeats=values, spread=(max(values) - min(values)) / median)
        points.append(point)
    return points


def _phases(records: list[RequestRecord]) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for record in records:
        if record.kind.startswith("profile:"):
            groups[record.kind].append(record)
    if not groups:
        raise BenchError("not a profile run: no request of the profile workload in it")
    return groups


def _steady_gaps(group: list[RequestRecord]) -> tuple[list[float], list[int]]:
    """Token gaps while every stream of the phase was decoding (after the last first token,
    before the first last token), and the context of the step behind each (prompt plus the
    tokens before the one the step produced)."""
    start = max(r.token_times[0] for r in group)
    end = min(r.token_times[-1] for r in group)
    gaps, contexts = [], []
    for record in group:
        times = record.token_times
        for j in range(1, len(times)):
            if times[j - 1] >= start and times[j] <= end:
                gaps.append(times[j] - times[j - 1])
                contexts.append(record.prompt_len + j - 1)
    return gaps, contexts
