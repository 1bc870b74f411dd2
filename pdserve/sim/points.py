"""Measured points, from a server's profile or a published source, as calibration measurements.

A point is a JSON object with a `kind`:
- "ttft": a lone prompt of `prompt_len` tokens, `seconds` to its first token (prefilled whole,
  or in chunks of the server's token budget; `front_end` false where no HTTP server stood
  in between, as in an engine benchmark);
- "itl": `num_streams` streams decoding together at a mean `context`, `seconds` per token
  (with the single gaps behind it as `observations`);
- "static_batch": a published static-batching run, `batch_size` prompts of `input_len`
  tokens each generating `output_len` tokens, at `out_tokens_per_s_per_gpu`;
- "linear_layer": a kernel-level profile's time (`seconds`) of one decoder layer's linears
  over `num_tokens` rows on one of `tp` shards;
- "all_reduce": the stack's own all-reduce of `bytes` over `num_gpus` GPUs in `seconds`
  (its communication: `simulate calibrate --points` fits the link's share from these, as
  `sim/network.py`'s measured links are fitted, rather than assume the catalog's).
Published points also name their deployment (`hardware`, `model`, `tp`, `dtype`,
`kv_dtype`) and where they come from (`table`, `row`); profile points take the deployment
given on the command line.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.sim.calibration import Measurement
from pdserve.sim.cost_model import CostModel, SeqWork
from pdserve.sim.errors import SimConfigError
from pdserve.sim.hardware import get_hardware
from pdserve.sim.model_spec import load_model_spec

SOURCES_DIR = Path(__file__).parent / "data" / "sources"
# A static batch's decode steps, grouped by context: this many groups of equal step counts
# (attention is linear in the context, so a group's mean stands for its steps).
_DECODE_GROUPS = 8


def measurement(point: dict, cost_model: CostModel, budget: int | None = None) -> Measurement:
    """The measurement `point` is on `cost_model`'s deployment, prompts chunked by `budget`
    tokens per step (None: prefilled whole)."""
    try:
        kind = point["kind"]
        label = point.get("label") or _label(point)
        if kind == "ttft":
            steps = _prefill_steps(int(point["prompt_len"]), budget)
            requests = 1 if point.get("front_end", True) else 0
            return Measurement(steps, float(point["seconds"]), requests, cost_model, label)
        if kind == "itl":
            batch = (SeqWork(1, round(point["context"]), True),) * int(point["num_streams"])
            observations = tuple(float(o) for o in point.get("observations", ()))
            return Measurement(
                ((1, batch),), float(point["seconds"]), 0, cost_model, label, observations
            )
        if kind == "static_batch":
            return _static_batch(point, cost_model, label)
        if kind == "linear_layer":
            # One decoder layer's linears, timed alone: all layers' in the measurement.
            batch = (SeqWork(int(point["num_tokens"]), 0, False),)
            seconds = float(point["seconds"]) * cost_model.model.num_layers
            return Measurement(((1, batch),), seconds, 0, cost_model, label, linear_only=True)
    except (KeyError, TypeError, ValueError) as exc:
        raise SimConfigError(f"point {point!r}: {exc!r}") from None
    raise SimConfigError(
        f"point kind must be ttft, itl, static_batch or linear_layer, got {kind!r}"
    )


def _label(point: dict) -> str:
    if point["kind"] == "ttft":
        return f"TTFT {point['prompt_len']} tokens"
    if point["kind"] == "itl":
        return f"ITL {point['num_streams']} streams at {point['prompt_len']} tokens"
    if point["kind"] == "linear_layer":
        return f"{point['model']} TP{point['tp']} linears over {point['num_tokens']} tokens"
    return f"B={point['batch_size']} {point['input_len']}/{point['output_len']}"


def _prefill_steps(num_tokens: int, budget: int | None):
    chunk = budget or num_tokens
    return tuple(
        (1, (SeqWork(min(chunk, num_tokens - done), done, done + chunk >= num_tokens),))
        for done in range(0, num_tokens, chunk)
    )


def _static_batch(point: dict, cost_model: CostModel, label: str) -> Measurement:
    """One generate call: every prompt prefilled in one step (which samples the first token),
    then `output_len` − 1 decode steps over the whole batch at growing contexts."""
    batch, prompt, output = (int(point[k]) for k in ("batch_size", "input_len", "output_len"))
    seconds = batch * output / (point["out_tokens_per_s_per_gpu"] * cost_model.tp)
    steps = [(1, (SeqWork(prompt, 0, True),) * batch)]
    num_decodes = output - 1
    groups = min(_DECODE_GROUPS, num_decodes)
    for g in range(groups):
        first, last = g * num_decodes // groups, (g + 1) * num_decodes // groups
        if last > first:
            context = prompt + (first + last - 1) // 2
            steps.append((last - first, (SeqWork(1, context, True),) * batch))
    return Measurement(tuple(steps), seconds, 1, cost_model, label)


def deployment(point: dict) -> CostModel:
    """The cost model (default efficiency) of the deployment a published point names."""
    return CostModel(
        load_model_spec(point["model"]),
        get_hardware(point["hardware"]),
        int(point["tp"]),
        dtype=point.get("dtype", "bf16"),
        kv_dtype=point.get("kv_dtype", "bf16"),
    )


def load_source(name_or_path: str | Path) -> dict:
    """A published source's points and provenance: a shipped name or a JSON file."""
    path = Path(name_or_path)
    if not path.is_file():
        path = SOURCES_DIR / f"{name_or_path}.json"
    try:
        source = json.loads(path.read_text())
        source["points"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SimConfigError(f"source {name_or_path}: cannot read {path}: {exc}") from None
    return source


def source_names() -> list[str]:
    return sorted(p.stem for p in SOURCES_DIR.glob("*.json"))
