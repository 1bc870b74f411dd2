"""`pdserve bench demo`: the head-to-head fitted to the machine it runs on.

A load chosen on one CPU says nothing on another: several times over capacity, every mode
misses every SLO and the comparison is a tie at zero. So the demo first measures this machine
through one server (one engine, one thread; a few seconds: a long prompt's prefill at two
lengths, the decode step of one stream alone and of `PROBE_BATCH` at once), then sizes
everything from those numbers, for every mode on the same cores (`layout.py`: one engine per
core, colocated and chunked as replicas, disagg as P prefill + D decode workers):

- documents long enough that one prefill takes `DOC_SHARE` of a run (a stall no scheduler
  hides), `DOC_FRACTION` of the requests (more than the share the attainment target lets
  miss: a mode that fails every document fails the target), and chats that stream for
  `CHAT_SHARE` of a run;
- SLOs in this machine's units, as DistServe's SLO scale does: TTFT within `TTFT_SCALE` × a
  document's unloaded prefill (the second of a burst may wait for the first where one
  prefill engine takes both), TPOT within `TPOT_SCALE` × the decode step at batch
  `PROBE_BATCH`, and no stream frozen longer than `STALL_SCALE` decode steps (`max_itl`);
- each mode's token budget so that one slice stalls the streams at most a third of that: the
  last slice of a document (it attends to all the document before it), and a chat's slice
  on a decode worker (one engine, like the probe's);
- disagg's split of the cores as the workload's share of engine time in prefill (one prefill
  and one decode worker on two cores);
- the rate at `LOAD` × the capacity those costs imply for one engine per core (near capacity
  for at least one mode, hopelessly over it for none), and as many requests as fit a run of
  the time the demo's budget leaves per run;
- then each mode's highest rate meeting the SLOs by a short search around that rate, and
  the two rates that decide it run again at `NUM_SEEDS` seeds in all: an interval per mode,
  and a winner only where the intervals separate.

The same logic on a fast or a slow CPU: only the measured numbers differ.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np

from pdserve.bench.client import make_http_client, send_request
from pdserve.bench.compare import CompareSpec
from pdserve.bench.launcher import LaunchConfig, launch_server
from pdserve.bench.layout import disagg_split
from pdserve.bench.runner import probe_server, warm_up
from pdserve.bench.search import RateSearch
from pdserve.workload import LengthRange, MixedWorkload
from pdserve.workload.base import BenchRequest, make_request
from pdserve.workload.endpoint import EndpointConfig
from pdserve.workload.errors import BenchError
from pdserve.workload.interference import InterferenceConfig
from pdserve.workload.prompts import PromptSynthesizer
from pdserve.workload.records import RequestRecord
from pdserve.workload.run import WARMUP_OUTPUT_LEN, WARMUP_PROMPT_LEN, BenchSpec, seeded_rng
from pdserve.workload.tokenizer import TokenizerLike

# The probe: prompts of two lengths (prefill time is linear plus attention's square), and
# short streams decoding alone and `PROBE_BATCH` at once.
PROBE_PROMPT_LENS = (768, 3072)
PROBE_OUTPUT_LEN = 32
PROBE_BATCH = 8
PROBE_STREAM = 4  # the probe's random stream of the seed (benchmark.py uses 0-3)

# The sizing (module doc).
DOC_SHARE = 1 / 15
DOC_FRACTION = 0.2
CHAT_SHARE = 1 / 5
DOC_LEN_RANGE = (768, 6000)
CHAT_OUTPUT_RANGE = (32, 256)
CHAT_INPUT = LengthRange(32, 256)
DOC_OUTPUT = LengthRange(32, 64)
TTFT_SCALE = 3.0
TPOT_SCALE = 3.0
STALL_SCALE = 10.0
LOAD = 0.7
MIN_PROMPTS, MAX_PROMPTS = 12, 40
# Of the time per mode (after its start), the runs take about this many run lengths (each
# with its drain): the run at the sized rate, a search of up to three more, and the two
# deciding rates again at each further seed, every one as long as the first; runs decided
# early stop early (a missed rate's usually do).
NUM_SEEDS = 3
RUNS_PER_MODE = 4 + 2 * (NUM_SEEDS - 1)
SEARCH = RateSearch(step=1.5, max_runs=3)
NUM_WARMUPS = 2


@dataclass(frozen=True)
class MachineProfile:
    """What the probe measured through one server (seconds)."""

    mode: str
    start_s: float
    prefill_lens: tuple[int, ...]
    prefill_s: tuple[float, ...]
    decode_step_s: float
    batch_step_s: float

    def prefill_time(self, num_tokens: float) -> float:
        """Seconds to prefill a prompt alone: a·n + b·n² through the two measured points
        (b ≥ 0: attention's square; a straight line when the points show none)."""
        (n1, n2), (t1, t2) = self.prefill_lens, self.prefill_s
        b = max(0.0, (t2 / n2 - t1 / n1) / (n2 - n1))
        a = t2 / n2 - b * n2
        return a * num_tokens + b * num_tokens**2

    def tokens_in(self, seconds: float) -> int:
        """The prompt length whose prefill takes `seconds` (the inverse of prefill_time)."""
        low, high = 1.0, 1e6
        for _ in range(60):
            middle = math.sqrt(low * high)
            low, high = (middle, high) if self.prefill_time(middle) < seconds else (low, middle)
        return int(low)

    def slice_time(self, num_tokens: int, slice_tokens: int) -> float:
        """Seconds for a prompt's last `slice_tokens` (they attend to all before them)."""
        return self.prefill_time(num_tokens) - self.prefill_time(num_tokens - slice_tokens)

    @property
    def prefill_tps(self) -> float:
        return self.prefill_lens[-1] / self.prefill_s[-1]


@dataclass(frozen=True)
class DemoPlan:
    """What the demo chose for this machine, and the numbers it chose them from."""

    profile: MachineProfile
    run_s: float
    workload: MixedWorkload
    request_rate: float
    slos: dict[str, float]
    long_prompt_tokens: int
    chunk_budget: int
    decode_worker_budget: int
    capacity: float
    search: RateSearch
    num_cores: int = 1
    prefill_share: float = 0.5
    num_seeds: int = NUM_SEEDS

    @property
    def disagg_split(self) -> tuple[int, int]:
        return disagg_split(self.num_cores, self.prefill_share)

    def mode_args(self) -> dict[str, tuple[str, ...]]:
        """Each mode's settings for this CPU."""
        return {
            "chunked": ("--max-num-batched-tokens", str(self.chunk_budget)),
            "disagg": (
                "--local-prefill-threshold",
                str(CHAT_INPUT.high * 2),
                "--decode-worker-args",
                f"--max-num-batched-tokens {self.decode_worker_budget}",
            ),
        }

    def explain(self) -> list[str]:
        p, w = self.profile, self.workload
        doc_s = p.prefill_time(w.long_input_len.high)
        return [
            f"measured ({p.mode} server, started in {p.start_s:.0f} s): prefill "
            + ", ".join(
                f"{n} tokens {t * 1000:.0f} ms"
                for n, t in zip(p.prefill_lens, p.prefill_s, strict=True)
            )
            + f" ({p.prefill_tps:.0f} tok/s); decode step {p.decode_step_s * 1000:.1f} ms alone, "
            f"{p.batch_step_s * 1000:.1f} ms at batch {PROBE_BATCH}",
            f"runs of about {self.run_s:.0f} s (time budget); documents "
            f"{w.long_input_len} tokens, a {doc_s:.1f} s prefill alone ({DOC_SHARE:.0%} of a "
            f"run); chats {w.chat_input_len} tokens in, {w.chat_output_len} out "
            f"(~{CHAT_SHARE:.0%} of a run streaming at batch {PROBE_BATCH})",
            f"SLOs in this machine's units: TTFT {self.slos['ttft']:.0f} ms "
            f"({TTFT_SCALE:g} × a document's prefill), TPOT {self.slos['tpot']:.0f} ms "
            f"({TPOT_SCALE:g} × the batch-{PROBE_BATCH} step), longest gap "
            f"{self.slos['max_itl']:.0f} ms ({STALL_SCALE:g} steps)",
            f"every mode on {self.num_cores} cores, one engine per core: colocated and chunked "
            f"as {self.num_cores} replicas, disagg as {self.disagg_split[0]} prefill + "
            f"{self.disagg_split[1]} decode (prefill is {self.prefill_share:.0%} of the "
            "workload's engine time)",
            f"token budgets: chunked {self.chunk_budget} (a document's last slice "
            f"{p.slice_time(w.long_input_len.high, self.chunk_budget) * 1000:.0f} ms), disagg's "
            f"decode worker {self.decode_worker_budget} (a slice stalls streams at most a third "
            "of the longest-gap SLO)",
            f"load: these costs make {self.num_cores} engines' capacity ~{self.capacity:.2f} "
            f"req/s; offered {self.request_rate:.3g} req/s ({LOAD:.0%} of it), "
            f"{w.num_prompts} requests ({w.num_long} documents); then each mode's highest rate "
            f"meeting the SLOs for {self.search.attainment:.0%} of requests, searched from "
            f"there, its deciding rates run again at {self.num_seeds} seeds in all",
        ]

    def to_dict(self) -> dict:
        return {
            "profile": asdict(self.profile),
            "run_s": self.run_s,
            "workload": self.workload.describe(),
            "request_rate": self.request_rate,
            "slos_ms": self.slos,
            "long_prompt_tokens": self.long_prompt_tokens,
            "mode_args": {m: list(a) for m, a in self.mode_args().items()},
            "capacity_estimate": self.capacity,
            "search": asdict(self.search),
            "num_cores": self.num_cores,
            "prefill_share": self.prefill_share,
            "disagg_split": list(self.disagg_split),
            "num_seeds": self.num_seeds,
            # How `slos_ms` follows from the probe, for a simulated device's own profile:
            # TTFT in the longest document's prefills, TPOT and the longest gap in steps of a
            # batch of short streams.
            "slo_rule": {
                "ttft_prefills": TTFT_SCALE,
                "tpot_steps": TPOT_SCALE,
                "max_itl_steps": STALL_SCALE,
                "batch": PROBE_BATCH,
                "batch_context": CHAT_INPUT.high,
            },
        }


def size_demo(
    profile: MachineProfile, budget_s: float, num_modes: int, num_cores: int = 1
) -> DemoPlan:
    """The demo's workload, load, SLOs and settings for the measured machine, every mode on
    `num_cores` cores (module doc)."""
    per_mode = budget_s / num_modes - profile.start_s
    run_s = per_mode / RUNS_PER_MODE
    if run_s <= 0:
        raise BenchError(
            f"--time-budget {budget_s:g} s leaves no time to run {num_modes} modes here "
            f"(a server takes {profile.start_s:.0f} s to start)"
        )
    doc_len = _clamp(profile.tokens_in(DOC_SHARE * run_s), *DOC_LEN_RANGE)
    docs = LengthRange(round(doc_len * 0.85), doc_len)
    step = profile.batch_step_s
    chat_out = _clamp(round(CHAT_SHARE * run_s / step), *CHAT_OUTPUT_RANGE)
    chats = LengthRange(max(1, chat_out // 2), chat_out)
    max_itl = STALL_SCALE * step
    slos = {  # whole milliseconds
        "ttft": float(round(TTFT_SCALE * profile.prefill_time(docs.high) * 1000.0)),
        "tpot": float(round(TPOT_SCALE * step * 1000.0)),
        "max_itl": float(round(max_itl * 1000.0)),
    }
    # One engine's seconds per request: its prefill, and its share of batched decode steps.
    per_token = step / PROBE_BATCH
    chat_prefill = profile.prefill_time(_mean(CHAT_INPUT))
    doc_prefill = profile.prefill_time(_mean(docs))
    chat_cost = chat_prefill + _mean(chats) * per_token
    doc_cost = doc_prefill + _mean(DOC_OUTPUT) * per_token
    # Guess the document share from a run at capacity, then count requests for the run.
    num_prompts = MIN_PROMPTS
    for _ in range(3):
        share = _num_docs(num_prompts) / num_prompts
        mean_cost = share * doc_cost + (1 - share) * chat_cost
        capacity = num_cores / mean_cost
        # The mixed workload's rate is the chats'; the documents come on top.
        rate = LOAD * capacity * (1 - share)
        num_prompts = _clamp(round(rate * run_s / (1 - share)), MIN_PROMPTS, MAX_PROMPTS)
    workload = MixedWorkload(
        num_prompts=num_prompts,
        long_fraction=_num_docs(num_prompts) / num_prompts,
        burst_size=2,
        chat_input_len=CHAT_INPUT,
        chat_output_len=chats,
        long_input_len=docs,
        long_output_len=DOC_OUTPUT,
    )
    return DemoPlan(
        profile=profile,
        run_s=run_s,
        workload=workload,
        request_rate=float(f"{rate:.3g}"),
        slos=slos,
        long_prompt_tokens=min(1024, max(2 * CHAT_INPUT.high, docs.low // 2)),
        chunk_budget=_budget(lambda n: profile.slice_time(docs.high, n), max_itl / 3, 64, 512),
        # A decode worker is one engine, as the probe's server was.
        decode_worker_budget=_budget(profile.prefill_time, max_itl / 3, 32, CHAT_INPUT.high),
        capacity=capacity,
        # The search and its repeats have the mode's time left after its first run (and
        # that run's drain).
        search=replace(SEARCH, budget_s=max(1.0, per_mode - 1.25 * run_s)),
        num_cores=num_cores,
        prefill_share=(share * doc_prefill + (1 - share) * chat_prefill) / mean_cost,
    )


def demo_spec(
    plan: DemoPlan, launch: LaunchConfig, modes: tuple[str, ...], seed: int, show_progress: bool
) -> CompareSpec:
    """The comparison the plan describes, on `launch`'s servers (its mode args win)."""
    mode_args = {m: a for m, a in plan.mode_args().items() if m in modes}
    launch = replace(launch, mode_args={**mode_args, **launch.mode_args})
    bench = BenchSpec(
        endpoint=EndpointConfig(),
        workload=plan.workload,
        seed=seed,
        request_rates=(plan.request_rate,),
        num_warmups=NUM_WARMUPS,
        slos=plan.slos,
        interference=InterferenceConfig(long_prompt_tokens=plan.long_prompt_tokens),
        show_progress=show_progress,
    )
    return CompareSpec(
        bench=bench,
        launch=launch,
        modes=modes,
        search=plan.search,
        num_cores=plan.num_cores,
        disagg_split=plan.disagg_split,
        num_seeds=plan.num_seeds,
    )


def measure_machine(
    launch: LaunchConfig, mode: str, tokenizer: TokenizerLike, seed: int = 0
) -> MachineProfile:
    """Start one `mode` server and time, alone on it, prompts of PROBE_PROMPT_LENS tokens
    (to their first token), one short stream, then PROBE_BATCH short streams at once."""
    started = time.monotonic()
    with launch_server(launch, mode) as server:
        start_s = time.monotonic() - started
        return asyncio.run(_probe(server.base_url, mode, start_s, tokenizer, seed))


async def _probe(
    base_url: str, mode: str, start_s: float, tokenizer: TokenizerLike, seed: int
) -> MachineProfile:
    endpoint = EndpointConfig(base_url)
    synth = PromptSynthesizer(tokenizer)
    rng = seeded_rng(seed, PROBE_STREAM)
    async with make_http_client(endpoint) as http:
        server = await probe_server(http, endpoint)

        def request(prompt_len: int, output_len: int) -> BenchRequest:
            return make_request(synth, rng, prompt_len, output_len, server.max_model_len, "probe")

        warmups = [request(WARMUP_PROMPT_LEN, WARMUP_OUTPUT_LEN) for _ in range(NUM_WARMUPS)]
        await warm_up(http, endpoint, server.model, warmups)
        prompts = [request(n, 2) for n in PROBE_PROMPT_LENS]
        prefills = await warm_up(http, endpoint, server.model, prompts)
        [alone] = await warm_up(
            http, endpoint, server.model, [request(WARMUP_PROMPT_LEN, PROBE_OUTPUT_LEN)]
        )
        batch = [request(WARMUP_PROMPT_LEN, PROBE_OUTPUT_LEN) for _ in range(PROBE_BATCH)]
        records = [
            RequestRecord(i, "probe", r.prompt_len, r.output_len, 0.0) for i, r in enumerate(batch)
        ]
        t0 = time.perf_counter()
        await asyncio.gather(
            *(
                send_request(http, endpoint, server.model, r, rec, t0)
                for r, rec in zip(batch, records, strict=True)
            )
        )
    if not all(r.success for r in records):
        raise BenchError(f"the machine probe's batch failed: {[r.error for r in records]}")
    return MachineProfile(
        mode=mode,
        start_s=start_s,
        prefill_lens=tuple(r.prompt_len for r in prompts),
        prefill_s=tuple(r.ttft for r in prefills),
        decode_step_s=float(np.median(alone.itls)),
        batch_step_s=_batch_step(records),
    )


def _batch_step(records: list[RequestRecord]) -> float:
    """The median gap while every stream of the batch decodes (all gaps, if never)."""
    start = max(r.token_times[0] for r in records)
    end = min(r.token_times[-1] for r in records)
    during = [
        b - a
        for r in records
        for a, b in itertools.pairwise(r.token_times)
        if a >= start and b <= end
    ]
    return float(
        np.median(during if len(during) >= PROBE_BATCH else [g for r in records for g in r.itls])
    )


def _budget(seconds_for: Callable[[int], float], limit_s: float, low: int, high: int) -> int:
    """The largest power of two in [low, high] whose slice takes at most `limit_s` (low when
    none does)."""
    budget = low
    while budget * 2 <= high and seconds_for(budget * 2) <= limit_s:
        budget *= 2
    return budget


def _num_docs(num_prompts: int) -> int:
    return max(2, round(DOC_FRACTION * num_prompts))


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, int(value)))


def _mean(lengths: LengthRange) -> float:
    return (lengths.low + lengths.high) / 2
