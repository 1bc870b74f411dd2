"""Result files: `vllm bench serve`'s keys, plus pdserve's per-request records and config."""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

from pdserve.bench.benchmark import BenchResult


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
