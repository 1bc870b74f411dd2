"""Check published claims about prefill/decode disaggregation; writes docs/claims.md.

    python benchmarks/claims.py [--output docs/claims.md] [--num-prompts N]

Each claim gets a closed-form physics check (the cost model at 100% of every peak: a lower
bound no implementation beats) and a simulation of its scenario (the cost model at the
H100's shipped calibration, docs/calibrations.md, with the band its residuals imply on the
key figures), then a verdict on whether it can hold as stated.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import median

from pdserve.core.config import Mode
from pdserve.sim.config import PoolConfig, SimConfig, scheduler_config_for
from pdserve.sim.cost_model import CostModel, SeqWork
from pdserve.sim.efficiency import Efficiency, default_calibration
from pdserve.sim.hardware import HARDWARE, get_hardware
from pdserve.sim.model_spec import MODELS, ModelSpec
from pdserve.sim.network import get_network
from pdserve.sim.points import load_source
from pdserve.sim.report import scaled
from pdserve.sim.simulator import SimResult, simulate
from pdserve.sim.workload import SimRequestSpec, plan_requests
from pdserve.workload import TraceWindow, WorkloadOptions, make_workload

# Llama-3-70B's own context is 8,192 tokens; the long-prompt claims need Llama-3.1-70B,
# which has the same shapes (so the same FLOPs, bytes and KV size) and a 128k context.
LLAMA_70B = MODELS["Llama-3-70B"]
LLAMA_70B_LONG = MODELS["Llama-3.1-70B"]
H100 = get_hardware("H100-SXM")
IDEAL = Efficiency(
    linear_compute=1,
    attention_compute=1,
    memory=1,
    network=1,
    step_overhead_s=0,
    per_seq_overhead_s=0,
)
# Every simulated figure: the H100's default (shipped) calibration, with the band of the
# kind of figure it is (docs/calibrations.md): "engine" for a lone request or one node's
# batch (what the engine tables it was fitted to measure), "served" for a fleet under a
# trace's load (the held-out check against a served stack, NIM).
CALIBRATION = default_calibration("H100-SXM")
CALIBRATED = CALIBRATION.efficiency
BANDS = CALIBRATION.metadata["bands"]
# The verdicts, and what each means.
HOLDS, HOLDS_IF, FAILS = "holds", "holds only if", "does not hold"


@dataclass
class ClaimReport:
    number: int
    claim: str
    physics: list[str] = field(default_factory=list)
    simulation: list[str] = field(default_factory=list)
    verdict: str = ""
    # HOLDS, HOLDS_IF or FAILS; and the kind of band its simulated figures carry (BANDS's
    # keys, or "physics": no simulated figure decides it).
    status: str = ""
    figure: str = "engine"


# ---- helpers ---------------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"


def _config(
    mode: Mode,
    *,
    model: ModelSpec = LLAMA_70B,
    workers: int = 1,
    tp: int = 8,
    prefill: int = 1,
    budget: int = 2048,
    max_num_seqs: int = 256,
    network: str = "ib-8x400",
    **kwargs,
) -> SimConfig:
    if mode is Mode.COLOCATED:
        budget = model.max_position_embeddings
    sched = scheduler_config_for(mode, budget, max_num_seqs, model.max_position_embeddings)
    prefill_pool = PoolConfig(prefill, tp, sched) if mode is Mode.DISAGG else None
    return SimConfig(
        model,
        H100,
        mode,
        PoolConfig(workers, tp, sched),
        prefill_pool,
        network=get_network(network),
        efficiency=CALIBRATED,
        **kwargs,
    )


def _prefill_bound(
    model: ModelSpec, hardware_name: str, tokens: int, dtype: str, tp: int = 8
) -> float:
    """Seconds of pure math for a whole-prompt prefill at 100% of peak (no memory or
    communication time; attention in bf16): a bound nothing beats."""
    cost = CostModel(model, HARDWARE[hardware_name], tp, dtype=dtype, efficiency=IDEAL)
    work = cost.step_work([SeqWork(tokens, 0, True)])
    dense = work.linear[0] + work.lm_head[0]
    attention = sum(flops for flops, _ in work.attention)
    return dense / cost.peak_linear_flops + attention / cost.peak_attention_flops


def _all_reduce_s(model: ModelSpec, tokens: int, tp: int = 8) -> float:
    """TP8 all-reduce time of a prefill at NVLink's measured bandwidth and latency (no stack
    overhead), if not overlapped."""
    cost = CostModel(model, H100, tp, efficiency=IDEAL)
    return cost.step_cost([SeqWork(tokens, 0, True)]).communication_s


def _banded(config: SimConfig, specs: list[SimRequestSpec], figure, kind: str = "engine") -> str:
    """`figure(result)` (seconds) at both ends of the `kind` band, "lo–hi"."""
    band = BANDS[kind]
    low, high = (figure(simulate(scaled(config, f), specs)) for f in (1 - band, 1 + band))
    return f"{_ms(low)}–{_ms(high)}"


def _calibrated(kind: str = "engine") -> str:
    return f"calibrated ({CALIBRATION.name}, {kind} band ±{BANDS[kind]:.0%})"


def band_text(kind: str) -> str:
    """The calibration and band a claim's figures carry."""
    if kind == "physics":
        return "physics (no calibration needed)"
    return f"`{CALIBRATION.name}`, {kind} band ±{BANDS[kind]:.0%}"


def _trace(num_prompts: int, rate: float | None, seed: int = 0) -> list[SimRequestSpec]:
    """Azure conversation trace lengths (the first `num_prompts` requests)."""
    options = WorkloadOptions(
        num_prompts=num_prompts, trace_window=TraceWindow(num_prompts=num_prompts)
    )
    workload = make_workload("trace", options, None)
    return plan_requests(workload, seed=seed, request_rate=rate, max_model_len=8192)


def _stream_gaps(result: SimResult, kind: str) -> list[float]:
    return [g for r in result.records if r.kind == kind for g in r.itls]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


def _p99(result: SimResult, metric: str) -> float:
    done = [r for r in result.records if r.success]
    if metric == "ttft":
        return _percentile([r.ttft for r in done], 99)
    return _percentile([g for r in done for g in r.itls], 99)


# ---- the claims ------------------------------------------------------------------------
def claim_1() -> ClaimReport:
    report = ClaimReport(
        1,
        "A 28k-token prompt on Llama-3-70B is prefilled in 310 ms on a "
        "prefill node, and its KV cache crosses a 400 Gb/s RoCE fabric to "
        "a decode node in 14 ms.",
    )
    tokens = 28_000
    bounds = {
        (hw, dt): _prefill_bound(LLAMA_70B_LONG, hw, tokens, dt)
        for hw in ("H100-SXM", "H200", "B200")
        for dt in ("bf16", "fp8")
    }
    kv_bytes = LLAMA_70B.kv_bytes_per_token("bf16") * tokens
    one_nic = kv_bytes / get_network("roce-400").bandwidth
    eight_nics = kv_bytes / get_network("ib-8x400").node_bandwidth
    needed = kv_bytes / 0.014
    report.physics = [
        "Llama-3-70B's context is 8,192 tokens; a 28k prompt needs Llama-3.1-70B (same "
        "shapes, 128k context). Prefill of 28k tokens: "
        f"{2 * LLAMA_70B.linear_params_per_layer * LLAMA_70B.num_layers * tokens:.2e} "
        f"FLOPs in the linear layers + {4 * 80 * 8192 * tokens * (tokens + 1) / 2:.2e} in "
        "causal attention.",
        "Fastest possible prefill on one 8-GPU node (TP8, FLOPs at 100% of peak, attention "
        "in bf16): "
        + ", ".join(f"{hw} {dt} {_ms(t)}" for (hw, dt), t in bounds.items())
        + f". TP8 adds two all-reduces per layer: {_ms(_all_reduce_s(LLAMA_70B, tokens))} "
        "more on H100 NVLink unless overlapped with compute.",
        f"KV cache: 28,000 × 327,680 B = {kv_bytes / 1e9:.2f} GB (bf16). At 400 Gb/s "
        f"(50 GB/s) that is {_ms(one_nic)}; even eight 400 Gb/s NICs per node take "
        f"{_ms(eight_nics)}; FP8 KV halves these. 14 ms needs {needed / 1e9:,.0f} GB/s "
        f"= {needed * 8 / 1e12:.1f} Tb/s, {needed / 50e9:.0f}× a 400 Gb/s link.",
    ]
    config = _config(Mode.DISAGG, model=LLAMA_70B_LONG, network="roce-400")
    specs = [SimRequestSpec("long", 0.0, tokens, 16)]
    record = simulate(config, specs).records[0]
    band = _banded(config, specs, lambda r: r.records[0].server_extra["prefill_ms"] / 1000)
    report.simulation = [
        f"`disagg 1×TP8 : 1×TP8` on H100, one 400 Gb/s RoCE NIC per node, {_calibrated()}: "
        f"prefill leg {record.server_extra['prefill_ms']:,.0f} ms (band {band}), KV "
        f"transfer {record.server_extra['kv_transfer_ms']:,.0f} ms, TTFT {_ms(record.ttft)}."
    ]
    fp8_h100 = bounds[("H100-SXM", "fp8")]
    report.status = FAILS
    report.verdict = (
        f"Cannot hold as stated. On an 8×H100 node even FP8 at 100% of peak needs "
        f"{_ms(fp8_h100)} to prefill 28k tokens; 310 ms is only reachable on B200-class "
        f"nodes with FP8 (bound {_ms(bounds[('B200', 'fp8')])}, so ~"
        f"{bounds[('B200', 'fp8')] / 0.310:.0%} of peak). The 14 ms transfer is off by "
        f"{one_nic / 0.014:.0f}× for one 400 Gb/s link; it would need ~5 Tb/s, or a prompt "
        f"~{0.014 * 50e9 / 327_680:,.0f} tokens long."
    )
    return report


def claim_2() -> ClaimReport:
    report = ClaimReport(
        2,
        "A 32k-token prompt froze an 8×H100 server's other streams for "
        "2.4 s under colocated serving; 1,024-token chunks fixed it.",
    )
    tokens = 32_000
    bound = _prefill_bound(LLAMA_70B_LONG, "H100-SXM", tokens, "bf16")
    calibrated = CostModel(LLAMA_70B_LONG, H100, 8, efficiency=CALIBRATED).prefill_time(tokens)
    chunk_bound = CostModel(LLAMA_70B_LONG, H100, 8, efficiency=IDEAL).step_time(
        [SeqWork(1024, tokens - 1024, False)]
    )
    report.physics = [
        f"Prefill of 32k tokens of Llama-3.x-70B on 8×H100 (TP8, bf16): at least "
        f"{_ms(bound)} of math at 100% of peak (plus "
        f"{_ms(_all_reduce_s(LLAMA_70B, tokens))} of all-reduce unless overlapped), "
        f"{_ms(calibrated)} at the H100 calibration ({CALIBRATION.name}). A 2.4 s stall "
        f"means ~{bound / 2.4:.0%} of peak FLOP/s — plausible for an untuned stack.",
        f"In colocated serving every running stream waits for that whole step. With "
        f"1,024-token chunks the longest step is the last chunk (1,024 new tokens attending "
        f"to ~31k): at least {_ms(chunk_bound)} plus the decodes sharing it.",
    ]
    streams = [SimRequestSpec(f"s{i}", 0.0, 512, 3000, kind="stream") for i in range(32)]
    specs = [*streams, SimRequestSpec("long", 2.0, tokens, 16, kind="long")]
    lines, gaps = [], {}
    for mode, label in ((Mode.COLOCATED, "colocated"), (Mode.CHUNKED, "chunked, 1,024")):
        config = _config(mode, model=LLAMA_70B_LONG, budget=1024)
        result = simulate(config, specs)
        stream_gaps = _stream_gaps(result, "stream")
        gaps[mode] = max(stream_gaps)
        long = next(r for r in result.records if r.kind == "long")
        band = _banded(config, specs, lambda r: max(_stream_gaps(r, "stream")))
        lines.append(
            f"{label}: worst gap in the 32 other streams {_ms(gaps[mode])} (band {band}; "
            f"median {_ms(median(stream_gaps))}); the 32k prompt's TTFT {_ms(long.ttft)}."
        )
    report.simulation = [
        "1×TP8 H100 engine, 32 streams decoding (512-token prompts), a 32k "
        f"prompt arriving at 2 s; {_calibrated()}.",
        *lines,
    ]
    report.status = HOLDS_IF
    report.verdict = (
        f"Holds only if the stack runs at ~{bound / 2.4:.0%} of peak FLOP/s (the simulated "
        f"calibrated engine is faster). The freeze is physics: the streams stall for the "
        "whole prefill "
        f"(simulated {_ms(gaps[Mode.COLOCATED])}; 2.4 s implies a slower stack than the "
        f"simulated one). 1,024-token chunks cap the stall at one chunk step (simulated "
        f"worst gap {_ms(gaps[Mode.CHUNKED])}), at the price of a later first token for "
        "the long prompt."
    )
    return report


def claim_3(num_prompts: int) -> ClaimReport:
    report = ClaimReport(
        3,
        "For Llama-3-70B with 500 concurrent sessions: colocated P99 ITL "
        "up to 380 ms, chunked prefill (budget 2,048) 48 ms, disaggregated "
        "14 ms with sub-200 ms P99 TTFT.",
    )
    specs = _trace(num_prompts, math.inf)
    context = median(s.prompt_len for s in specs) + median(s.output_len for s in specs) / 2
    ideal = CostModel(LLAMA_70B, H100, 8, efficiency=IDEAL)
    decode = SeqWork(1, int(context), True)
    decode_500 = ideal.step_time([decode] * 500)
    decode_250 = ideal.step_time([decode] * 250)
    chunk = ideal.step_time([SeqWork(2048, 0, False)] + [decode] * 250)
    mean_prompt = sum(s.prompt_len for s in specs) / len(specs)
    mean_output = sum(s.output_len for s in specs) / len(specs)
    # Closed loop without think time: each session sends its next request when one ends.
    rate = 500 / (mean_output * 0.014)
    prefill_node = (
        8 * H100.peak_bf16_flops * CALIBRATED.linear_share("bf16") / (2 * LLAMA_70B.num_params)
    )
    report.physics = [
        f"The claim names neither hardware nor traffic; take H100s and the Azure conversation "
        f"trace (mean prompt {mean_prompt:,.0f}, mean output {mean_output:,.0f} tokens). A "
        f"decode step over 500 sequences of ~{context:,.0f} tokens (GEMMs at peak FLOP/s, "
        f"{500 * context * 327_680 / 1e9:,.0f} GB of KV at peak bandwidth, all-reduces at "
        f"NVLink's measured speed) takes at least {_ms(decode_500)} on one 8×H100 node, "
        f"{_ms(decode_250)} with the sessions split over two. A 2,048-token chunk beside 250 "
        f"decodes: at least {_ms(chunk)} per step.",
        f"At 14 ms per token, 500 sessions finish a {mean_output:,.0f}-token answer every "
        f"{mean_output * 0.014:.1f} s each: {rate:,.0f} new prompts/s, "
        f"{rate * mean_prompt / 1e3:,.0f}k prompt tokens/s. One 8×H100 node prefills about "
        f"{prefill_node / 1e3:,.0f}k tokens/s at the calibration's "
        f"{CALIBRATED.linear_share('bf16'):.0%} of peak, so sub-200 ms TTFT needs "
        f"~{math.ceil(rate * mean_prompt / prefill_node)} prefill nodes (fewer with think time "
        "between a session's requests).",
    ]
    layouts = [
        ("colocated 4×TP8", _config(Mode.COLOCATED, workers=4)),
        ("chunked 4×TP8, 2,048", _config(Mode.CHUNKED, workers=4)),
        ("disagg 2×TP8 : 2×TP8", _config(Mode.DISAGG, prefill=2, workers=2)),
    ]
    results = {}
    for label, config in layouts:
        config = replace(config, max_concurrency=500)
        config = replace(
            config,
            pool=replace(
                config.pool,
                scheduler_config=replace(config.pool.scheduler_config, max_num_seqs=512),
            ),
        )
        results[label] = simulate(config, specs)
    report.simulation = [
        f"{num_prompts:,} trace requests, 500 always in flight (closed loop, no think time), "
        f"32 H100s in each layout, {_calibrated('served')}, ib-8x400 between nodes:",
        *(
            f"{label} ({results[label].config.num_devices} GPUs): P99 ITL "
            f"{_ms(_p99(results[label], 'itl'))}, P99 TTFT {_ms(_p99(results[label], 'ttft'))}"
            for label, _ in layouts
        ),
    ]
    colocated, chunked, disagg = (results[label] for label, _ in layouts)
    report.status, report.figure = HOLDS_IF, "served"
    report.verdict = (
        f"The ordering holds: colocated P99 ITL {_ms(_p99(colocated, 'itl'))} > chunked "
        f"{_ms(_p99(chunked, 'itl'))} > disaggregated {_ms(_p99(disagg, 'itl'))}. The exact "
        f"figures depend on hardware and traffic the claim leaves out; disaggregated P99 TTFT "
        f"under 200 ms at 500 sessions is "
        f"{'reproduced' if _p99(disagg, 'ttft') < 0.2 else 'not reproduced'} here "
        f"({_ms(_p99(disagg, 'ttft'))}): without think time the sessions' prompt rate "
        "overwhelms any prefill pool of comparable size; the claim can hold only with long "
        "think times or many prefill nodes per decode node."
    )
    return report


def claim_4(num_prompts: int) -> ClaimReport:
    report = ClaimReport(
        4, "Disaggregating 64 H100s (16 prefill, 48 decode) cut p99 TTFT from 840 ms to 290 ms."
    )
    baseline = _config(Mode.CHUNKED, workers=8)
    disagg = _config(Mode.DISAGG, prefill=2, workers=6)
    rate, base = _rate_for_ttft(baseline, num_prompts, target_s=0.840)
    split = simulate(disagg, _trace(num_prompts, rate))
    ttft_base, ttft_split = _p99(base, "ttft"), _p99(split, "ttft")
    prefill_busy = _utilization(split, "prefill")
    half_base = simulate(baseline, _trace(num_prompts, rate / 2))
    half_split = simulate(disagg, _trace(num_prompts, rate / 2))
    report.physics = [
        "Not a physical limit: p99 TTFT is queueing. Disaggregation removes decode work from "
        "the prefill GPUs, but gives prefill only 16 of the 64 GPUs. It cuts TTFT only if the "
        "16 GPUs keep up with every prompt and the 64 colocated GPUs were losing TTFT to "
        "decode interference rather than to prefill capacity.",
    ]
    report.simulation = [
        f"Llama-3-70B, Azure trace ({num_prompts:,} requests), {_calibrated('served')}. The "
        f"rate at which `chunked 8×TP8, 2,048` has p99 TTFT ≈ 840 ms: {rate:.1f} req/s "
        f"(p99 TTFT {_ms(ttft_base)}).",
        f"`disagg 2×TP8 : 6×TP8` at the same rate: p99 TTFT {_ms(ttft_split)}, P99 ITL "
        f"{_ms(_p99(split, 'itl'))} (chunked: {_ms(_p99(base, 'itl'))}); the prefill pool is "
        f"{prefill_busy:.0%} busy.",
        f"At half that rate ({rate / 2:.1f} req/s): chunked p99 TTFT "
        f"{_ms(_p99(half_base, 'ttft'))}, disagg {_ms(_p99(half_split, 'ttft'))}.",
    ]
    half_ttfts = _p99(half_base, "ttft"), _p99(half_split, "ttft")
    better = ttft_split < ttft_base
    report.status, report.figure = (HOLDS_IF if better else FAILS), "served"
    report.verdict = (
        f"{'Direction reproduced' if better else 'Not reproduced'} on this traffic: the "
        f"16:48 split moves p99 TTFT from {_ms(ttft_base)} to {_ms(ttft_split)} at the "
        f"matched load, and from {_ms(half_ttfts[0])} to {_ms(half_ttfts[1])} at half of it. "
        "A quarter of the GPUs must absorb every prompt, so prompts queue there; the claim "
        "can hold only where the colocated TTFT is dominated by decode interference and the "
        "prompt-token rate leaves the 16 prefill GPUs spare capacity."
    )
    return report


def claim_5(num_prompts: int) -> ClaimReport:
    report = ClaimReport(5, "Moving a prompt's KV cache over 400 Gb/s InfiniBand takes about 8 ms.")
    link = get_network("ib-400")
    in_8ms = {
        name: (0.008 - link.latency_s) * link.bandwidth / MODELS[name].kv_bytes_per_token()
        for name in ("Llama-3-70B", "Llama-3.1-8B", "Qwen2.5-7B", "Mistral-7B")
    }
    specs = _trace(num_prompts, None)
    typical_prompt = median(s.prompt_len for s in specs)
    report.physics = [
        "8 ms at 400 Gb/s (50 GB/s) moves 400 MB: the KV of "
        + ", ".join(f"{tokens:,.0f} tokens of {name}" for name, tokens in in_8ms.items())
        + " (bf16).",
        f"The Azure trace's median prompt ({typical_prompt:,.0f} tokens) on Llama-3-70B: "
        f"{_ms(typical_prompt * 327_680 / link.bandwidth)}; its p99 prompt "
        f"({_percentile([s.prompt_len for s in specs], 99):,.0f} tokens): "
        f"{_ms(_percentile([s.prompt_len for s in specs], 99) * 327_680 / link.bandwidth)}; "
        f"a 28k prompt: {_ms(28_000 * 327_680 / link.bandwidth)}.",
    ]
    result = simulate(_config(Mode.DISAGG, network="ib-400"), specs)
    times = [
        r.server_extra["kv_transfer_ms"] / 1000
        for r in result.records
        if "kv_transfer_ms" in r.server_extra
    ]
    report.simulation = [
        f"`disagg 1×TP8 : 1×TP8`, Llama-3-70B, one 400 Gb/s NIC per node, Azure trace at "
        f"its own pace ({num_prompts:,} requests): KV transfer median {_ms(median(times))}, "
        f"p99 {_ms(_percentile(times, 99))}."
    ]
    report.status, report.figure = HOLDS_IF, "served"
    report.verdict = (
        "Holds only for a typical chat prompt on a 70B GQA model (~1k tokens → ~7 ms on a "
        "dedicated 400 Gb/s link), not in general: transfer time is linear in prompt length "
        "and KV size per token, and links are shared."
    )
    return report


# ---- the seed claims (issue 26): each with the runs that judge it --------------------
# Colocated against disaggregated on the same 16 H100s, Llama-3-70B, the Azure trace: at a
# load both layouts carry (TTFT, its spikes) and at one near the colocated pair's limit
# (goodput per GPU: tokens per dollar at equal GPU prices).
PAIR_RATES = {"moderate": 8.0, "high": 20.0}
PAIR_SLO_S = {"ttft": 1.0, "tpot": 0.05}


@functools.cache
def _pair_runs(num_prompts: int) -> dict[tuple[str, str], SimResult]:
    layouts = {
        "colocated 2×TP8": _config(Mode.COLOCATED, workers=2),
        "disagg 1×TP8 : 1×TP8": _config(Mode.DISAGG, prefill=1, workers=1),
    }
    return {
        (label, load): simulate(config, _trace(num_prompts, rate))
        for label, config in layouts.items()
        for load, rate in PAIR_RATES.items()
    }


def _pair_lines(runs: dict[tuple[str, str], SimResult], load: str) -> list[str]:
    return [
        f"{label} at {PAIR_RATES[load]:g} req/s: TTFT mean {_ms(_mean_ttft(r))}, p99 "
        f"{_ms(_p99(r, 'ttft'))}; TPOT p99 {_ms(_percentile(_tpots(r), 99))}"
        for (label, run_load), r in runs.items()
        if run_load == load
        for r in [r]
    ]


def _mean_ttft(result: SimResult) -> float:
    done = [r.ttft for r in result.records if r.success]
    return sum(done) / len(done)


def _tpots(result: SimResult) -> list[float]:
    return [r.tpot for r in result.records if r.success and r.tpot is not None]


def _good_tokens_per_s(result: SimResult) -> float:
    """Output tokens/s of the requests within PAIR_SLO_S."""
    good = [
        r
        for r in result.records
        if r.success
        and r.ttft <= PAIR_SLO_S["ttft"]
        and (r.tpot is None or r.tpot <= PAIR_SLO_S["tpot"])
    ]
    return sum(r.num_output_tokens for r in good) / result.duration_s


def _pair_intro(num_prompts: int) -> str:
    return (
        f"Llama-3-70B, the Azure trace ({num_prompts:,} requests), 16 H100s in each layout, "
        f"{_calibrated('served')}:"
    )


def claim_6(num_prompts: int) -> ClaimReport:
    report = ClaimReport(6, "Disaggregation eliminated 84% of P99 TTFT spikes.")
    runs = _pair_runs(num_prompts)
    colocated = runs[("colocated 2×TP8", "moderate")]
    disagg = runs[("disagg 1×TP8 : 1×TP8", "moderate")]
    threshold = _p99(colocated, "ttft")
    spikes = [sum(r.success and r.ttft > threshold for r in x.records) for x in (colocated, disagg)]
    eliminated = 1 - spikes[1] / max(spikes[0], 1)
    change = (
        f"{eliminated:.0%} of them eliminated"
        if eliminated >= 0
        else f"{spikes[1] / max(spikes[0], 1):.1f}x as many, none eliminated"
    )
    report.physics = [
        "Not a physical figure: a TTFT spike is a prompt that waited, behind another long "
        "prefill (colocated) or in the prefill pool's queue (disaggregated). Disaggregation "
        "removes the first cause only; the second grows as the prefill pool gets fewer GPUs.",
    ]
    report.simulation = [
        _pair_intro(num_prompts),
        *_pair_lines(runs, "moderate"),
        f"Spikes (TTFT above the colocated run's p99, {_ms(threshold)}): colocated "
        f"{spikes[0]}, disaggregated {spikes[1]}: {change}.",
    ]
    report.status, report.figure = (HOLDS_IF if eliminated >= 0.84 else FAILS), "served"
    report.verdict = (
        f"{'Reproduced' if eliminated >= 0.84 else 'Not reproduced'} on this traffic "
        f"(spikes {spikes[0]} -> {spikes[1]}, {change}, at {PAIR_RATES['moderate']:g} req/s). It "
        "can hold only where colocated spikes come from long prefills stalling others and the "
        "prefill pool has spare capacity; the figure is a property of one workload, not of "
        "disaggregation."
    )
    return report


def claim_7(num_prompts: int) -> ClaimReport:
    report = ClaimReport(7, "Disaggregated serving cut TTFT by 65%.")
    runs = _pair_runs(num_prompts)
    colocated = runs[("colocated 2×TP8", "moderate")]
    disagg = runs[("disagg 1×TP8 : 1×TP8", "moderate")]
    change = _mean_ttft(disagg) / _mean_ttft(colocated) - 1
    p99_change = _p99(disagg, "ttft") / _p99(colocated, "ttft") - 1
    report.physics = [
        "A lone prompt's TTFT is its prefill either way, plus the KV transfer when "
        "disaggregated: disaggregation cannot make an unloaded TTFT faster. It can only "
        "remove waiting, and only where the prefill pool waits less than a colocated worker.",
    ]
    report.simulation = [
        _pair_intro(num_prompts),
        *_pair_lines(runs, "moderate"),
        f"Disaggregated against colocated: mean TTFT {change:+.0%}, p99 {p99_change:+.0%}.",
    ]
    holds = change <= -0.65
    report.status, report.figure = (HOLDS_IF if holds else FAILS), "served"
    report.verdict = (
        f"{'Reproduced' if holds else 'Not reproduced'}: mean TTFT {change:+.0%} here. A cut "
        "of 65% needs a colocated baseline whose TTFT is mostly waiting behind decode-heavy "
        "batches, and a prefill pool with spare capacity; with the GPUs split evenly the "
        "prefill pool carries every prompt on half the GPUs."
    )
    return report


def claim_8(num_prompts: int) -> ClaimReport:
    report = ClaimReport(8, "Disaggregation gave +42% tokens per dollar.")
    runs = _pair_runs(num_prompts)
    good = {label: _good_tokens_per_s(r) for (label, load), r in runs.items() if load == "high"}
    (colocated, disagg) = good.values()
    gain = disagg / colocated - 1 if colocated else math.inf
    report.physics = [
        "At equal GPUs and price, tokens per dollar is goodput per GPU: output tokens/s of "
        "the requests that meet the SLOs. Disaggregation gains where colocated decode steps "
        "carry prefills that break the TPOT SLO; it loses where one pool idles while the other "
        "queues (the split is fixed, the traffic's mix is not).",
    ]
    report.simulation = [
        _pair_intro(num_prompts),
        *_pair_lines(runs, "high"),
        f"Output tokens/s within TTFT ≤ {PAIR_SLO_S['ttft'] * 1e3:,.0f} ms and TPOT ≤ "
        f"{PAIR_SLO_S['tpot'] * 1e3:,.0f} ms: "
        + ", ".join(
            f"{label} {value:,.0f} ({value / 16:,.0f} per GPU)" for label, value in good.items()
        )
        + f"; disaggregated {gain:+.0%}.",
    ]
    holds = gain >= 0.42
    report.status, report.figure = (HOLDS_IF if holds else FAILS), "served"
    report.verdict = (
        f"{'Reproduced' if holds else 'Not reproduced'} at {PAIR_RATES['high']:g} req/s "
        f"({gain:+.0%}). Tokens per dollar depends on the SLOs, the load and the split; "
        "a +42% holds only for the traffic and SLOs it was measured at, with the split "
        "matched to that traffic's prompt-to-output ratio."
    )
    return report


def claim_9() -> ClaimReport:
    report = ClaimReport(
        9, "A 32k-token prompt at 1,024-token chunks takes 16 iterations to prefill."
    )
    chunks = {tokens: math.ceil(tokens / 1024) for tokens in (32_000, 32_768)}
    report.physics = [
        f"Chunks of 1,024 tokens: {chunks[32_768]} for 32,768 tokens "
        f"(32,768 / 1,024), {chunks[32_000]} for 32,000 (31 full chunks and one of "
        f"{32_000 - 31 * 1024} tokens). 16 iterations would need 2,048-token chunks.",
    ]
    report.simulation = [
        "None needed: the count is arithmetic (with decodes sharing each step's budget, as in "
        "claim 2, the chunks are smaller and there are more)."
    ]
    report.status, report.figure = FAILS, "physics"
    report.verdict = "Does not hold: it is 32 iterations (off by 2x)."
    return report


def claim_10() -> ClaimReport:
    report = ClaimReport(10, "The serving engine ran at 92% tensor-core utilisation.")
    best = _best_measured_gemm_share()
    decode = CostModel(LLAMA_70B, H100, 8, efficiency=CALIBRATED)
    batch = [SeqWork(1, 1024, True)] * 64
    work = decode.step_work(batch)
    decode_share = (work.linear[0] + work.lm_head[0]) / (
        decode.step_time(batch) * decode.peak_linear_flops
    )
    report.physics = [
        f"The best measured 16-bit GEMM share in the profiles behind the H100 calibration "
        f"(Vidur's linear layers, {best[1]}): {best[0]:.0%} of peak; the calibration's fitted "
        f"shares: {CALIBRATED.linear_share('bf16'):.0%} (16-bit), "
        f"{CALIBRATED.linear_share('fp8'):.0%} (FP8 GEMMs of TensorRT-LLM's engine).",
        f"Decode is memory-bound: a 64-sequence decode step of Llama-3-70B on 8×H100 keeps "
        f"the tensor cores {decode_share:.1%} busy at the calibration. A serving run mixes "
        "such steps with prefills, so its average utilisation sits far below any kernel's.",
    ]
    report.simulation = ["None needed: utilisation is FLOPs over time at the calibration."]
    report.status, report.figure = FAILS, "kernel"
    report.verdict = (
        f"Does not hold for a serving engine: no measured GEMM here reaches 92% "
        f"(best {best[0]:.0%}), and decode steps run the tensor cores at a few percent. It "
        "can hold only for one large GEMM in isolation on a tuned kernel, not a served run."
    )
    return report


def _best_measured_gemm_share() -> tuple[float, str]:
    """The highest share of the 16-bit peak Vidur's H100 linear-layer profiles reach."""
    best = (0.0, "")
    for p in load_source("vidur-linear")["points"]:
        if p["hardware"] != "H100-SXM":
            continue
        model = MODELS[p["model"]]
        flops = 2 * p["num_tokens"] * model.linear_params_per_layer / p["tp"]
        share = flops / (p["seconds"] * H100.peak_flops("bf16"))
        if share > best[0]:
            best = (share, f"{p['model']} TP{p['tp']} over {p['num_tokens']:,} rows")
    return best


def claim_11() -> ClaimReport:
    report = ClaimReport(
        11, "Seed 004's KV-cache size formula (its per-token KV bytes for Llama-family models)."
    )
    sizes = {
        name: MODELS[name].kv_bytes_per_token("bf16")
        for name in ("Llama-3.1-8B", "Llama-3-70B", "Mistral-7B")
    }
    report.physics = [
        "KV bytes per token = 2 (K and V) × layers × KV heads × head dim × bytes per value: "
        + ", ".join(f"{name} {b:,} B" for name, b in sizes.items())
        + " in bf16 (GQA models hold 8 KV heads, not their 32 or 64 query heads).",
        "Issue 26 compared seed 004's formula with this one and found it off by "
        "500–1,300x; the seed's text is not in this repository, so that comparison is "
        "quoted, not recomputed here.",
    ]
    report.simulation = ["None needed: the size is arithmetic (`ModelSpec.kv_bytes_per_token`)."]
    report.status, report.figure = FAILS, "physics"
    report.verdict = (
        "Does not hold: per issue 26's comparison it is off by 500–1,300x from the formula "
        "above, which the cost-model tests check against hand-computed values."
    )
    return report


def _rate_for_ttft(config: SimConfig, num_prompts: int, target_s: float):
    """Bisect the Azure-trace rate at which `config`'s p99 TTFT reaches `target_s`."""
    low, high = 4.0, 512.0
    best = None
    for _ in range(8):
        rate = math.sqrt(low * high)
        result = simulate(config, _trace(num_prompts, rate))
        best = (rate, result)
        if _p99(result, "ttft") < target_s:
            low = rate
        else:
            high = rate
    return best


def _utilization(result: SimResult, pool: str) -> float:
    stats = result.pool_stats[pool]
    return sum(s.busy_s for s in stats) / (result.duration_s * len(stats))


# ---- output ----------------------------------------------------------------------------
def render(reports: list[ClaimReport]) -> str:
    e = CALIBRATED
    lines = [
        "# Claims about prefill/decode disaggregation, checked",
        "",
        "Generated by `python benchmarks/claims.py` (do not edit by hand). For each claim: "
        "what the physics says (the cost model at 100% of every peak — a bound no "
        "implementation beats), what `pdserve simulate` says for the claim's scenario "
        "(pdserve's scheduler and router on the cost model at the H100's shipped "
        f"calibration, `{CALIBRATION.name}`: {CALIBRATION.metadata['summary']}; "
        f"{e.linear_share('bf16'):.0%} of peak FLOP/s in 16-bit GEMMs, "
        f"{e.linear_share('fp8'):.0%} in FP8 ones, {e.attention_compute:.0%} in attention, "
        f"{e.memory:.0%} of HBM bandwidth, {e.layer_overhead_s * 1e6:.0f} µs per layer and "
        f"{e.step_overhead_s * 1e3:.1f} ms per step, all-reduces at NVLink's measured "
        "latency and bandwidth; docs/calibrations.md), and a "
        "verdict: holds, holds only if (the condition named), or does not hold.",
        "",
        "**Bands.** Each simulated figure carries the band of its kind, the 90th percentile "
        "of |residual| over every point of that kind (set-aside ones included): engine "
        f"±{BANDS['engine']:.0%} (a lone request or one node's batch: what the engine tables "
        f"it was fitted to measure), served ±{BANDS['served']:.0%} (a fleet under a trace's "
        "load: from the held-out check against NVIDIA NIM's served Llama-3.3-70B, which this "
        f"calibration misses by that much), kernel ±{BANDS['kernel']:.0%}. Key figures give "
        "in parentheses their value with every step that much faster and slower. An operator "
        "calibrates their own stack with `pdserve bench --workload profile` and `pdserve "
        "simulate calibrate --bench`, or from a table with `--points`.",
        "",
        "| # | claim | figure | calibration, band | verdict |",
        "|---|---|---|---|---|",
        *(
            f"| {r.number} | {r.claim} | {r.figure} | {band_text(r.figure)} | {r.status} |"
            for r in reports
        ),
        "",
    ]
    for r in reports:
        lines += [f"## {r.number}. {r.claim}", "", "**Physics.**", ""]
        lines += [f"- {p}" for p in r.physics]
        lines += ["", "**Simulator.**", ""]
        lines += [f"- {s}" for s in r.simulation]
        lines += ["", f"**Verdict: {r.status}.** {r.verdict}", ""]
        lines += [f"*Figures: {r.figure}; {band_text(r.figure)}.*", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="docs/claims.md")
    parser.add_argument(
        "--num-prompts", type=int, default=2000, help="trace requests per simulated scenario"
    )
    args = parser.parse_args(argv)
    reports = [
        claim_1(),
        claim_2(),
        claim_3(args.num_prompts),
        claim_4(args.num_prompts),
        claim_5(args.num_prompts),
        claim_6(args.num_prompts),
        claim_7(args.num_prompts),
        claim_8(args.num_prompts),
        claim_9(),
        claim_10(),
        claim_11(),
    ]
    Path(args.output).write_text(render(reports))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
