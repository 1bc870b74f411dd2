"""Result files: `vllm bench serve`'s keys, plus pdserve's per-request records and config;
and back: a saved run judged again from its records."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path

from pdserve.workload import Workload
from pdserve.workload.endpoint import EndpointConfig
from pdserve.workload.errors import BenchError
from pdserve.workload.interference import InterferenceConfig
from pdserve.workload.records import RequestRecord
from pdserve.workload.run import BenchResult, BenchSpec, summarize

# A saved run's server, when its file does not name one.
SAVED_BASE_URL = "http://saved"


def rate_text(rate: float | None) -> str:
    """A request rate for people and JSON: '2', 'inf', or 'trace' (the recorded pace)."""
    if rate is None:
        return "trace"
    return "inf" if math.isinf(rate) else f"{rate:g}"


def result_to_dict(result: BenchResult) -> dict:
    """One run as JSON: vLLM's top-level keys, and pdserve's own under "pdserve"."""
    spec, records = result.spec, result.records
    out = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if spec.endpoint.is_chat else "openai",
        "model_id": result.model,
        "num_prompts": len(records),
        # vLLM writes a float; inf is not valid JSON, so an infinite rate is the string "inf".
        "request_rate": _json_rate(result.request_rate),
        "burstiness": spec.burstiness,
        "max_concurrency": spec.max_concurrency,
        **result.metrics.to_vllm_dict(),
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.num_output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft if r.success else 0.0 for r in records],
        "itls": [r.itls if r.success else [] for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error or "" for r in records],
    }
    out["pdserve"] = {
        "label": result.label,
        "config": spec.describe(),
        "num_good": result.metrics.num_good,
        "slo_attainment": result.metrics.slo_attainment,
        "interference": result.interference.to_dict(),
        "records": [r.to_dict() for r in records],
        "warmups": [r.to_dict() for r in result.warmups],
    }
    return out


def save_results(results: list[BenchResult], path: str | Path) -> Path:
    """Write one run as a vLLM-style object, or a sweep as {"sweep": [run, ...]}."""
    runs = [result_to_dict(r) for r in results]
    payload = runs[0] if len(runs) == 1 else {"sweep": runs}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    return path


def _json_rate(rate: float | None) -> float | str:
    return rate if rate is not None and math.isfinite(rate) else rate_text(rate)


@dataclass(frozen=True)
class SavedWorkload(Workload):
    """A saved run's workload as its file describes it (its requests are in the records)."""

    description: Mapping = field(default_factory=dict)

    @property
    def name(self) -> str:  # type: ignore[override]
        return str(self.description.get("name", "saved"))

    def describe(self) -> dict:
        return dict(self.description)


def has_records(run: dict) -> bool:
    """Whether a saved run carries its per-request records (pdserve's files do)."""
    return isinstance(run.get("pdserve"), dict) and isinstance(run["pdserve"].get("records"), list)


def result_from_dict(
    run: dict,
    label: str,
    slos: Mapping[str, float] | None = None,
    interference: Mapping[str, float] | None = None,
) -> BenchResult:
    """A saved run (`result_to_dict`'s JSON) judged again from its records, as a measured run
    is: with `slos` when given, else the run's own; with the run's detector settings, the
    given `interference` fields replacing theirs."""
    saved = run["pdserve"]
    config = saved.get("config", {})
    known = {f.name for f in fields(InterferenceConfig)}
    settings = {k: v for k, v in config.get("interference", {}).items() if k in known}
    try:
        spec = BenchSpec(
            endpoint=EndpointConfig(base_url=config.get("base_url") or SAVED_BASE_URL),
            workload=SavedWorkload(config.get("workload", {})),
            seed=config.get("seed", 0),
            request_rates=(_rate_of(run.get("request_rate")),),
            burstiness=run.get("burstiness", 1.0),
            max_concurrency=run.get("max_concurrency"),
            num_warmups=config.get("num_warmups", 0),
            slos=dict(config.get("goodput_slos_ms", {}) if slos is None else slos),
            interference=InterferenceConfig(**{**settings, **(interference or {})}),
            show_progress=False,
        )
        records = [RequestRecord.from_dict(r) for r in saved["records"]]
        warmups = [RequestRecord.from_dict(r) for r in saved.get("warmups", [])]
    except (TypeError, ValueError, KeyError) as exc:
        raise BenchError(f"{label}: not a pdserve result file ({exc})") from None
    model = run.get("model_id", "")
    return summarize(label, model, spec, spec.request_rates[0], records, 0.0, warmups)


def _rate_of(value) -> float | None:
    if value == "trace" or value is None:
        return None
    return math.inf if value == "inf" else float(value)
