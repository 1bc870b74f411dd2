"""Calibrations from measured points: a server's profile (`pdserve bench --workload profile`)
or published ones, fitted and written with the stack they describe and each point's residual.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from pdserve.bench.errors import BenchError
from pdserve.bench.records import RequestRecord
from pdserve.bench.workloads.profile import profile_points
from pdserve.sim.calibration import Fit, Measurement, fit_efficiency, predict
from pdserve.sim.cost_model import CostModel
from pdserve.sim.efficiency import Calibration
from pdserve.sim.errors import SimConfigError
from pdserve.sim.points import measurement


def load_profile(path: str | Path) -> tuple[list[dict], dict]:
    """The points of a saved profile run (`pdserve bench --workload profile --save-result`),
    and the run's config (base URL, model) for provenance."""
    try:
        data = json.loads(Path(path).read_text())
        run = data["pdserve"]
        records = [RequestRecord.from_dict(r) for r in run["records"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SimConfigError(f"--bench: {path} is not a pdserve bench result ({exc})") from None
    try:
        points = profile_points(records)
    except BenchError as exc:
        raise SimConfigError(f"--bench: {path}: {exc}") from None
    config = run.get("config", {})
    return points, {"base_url": config.get("base_url"), "model_id": data.get("model_id")}


def calibrate_points(
    points: Sequence[dict],
    cost_model: CostModel,
    budget: int | None,
    *,
    allow_curve: bool = True,
) -> tuple[Fit, list[Measurement]]:
    """Fit `points` measured on `cost_model`'s deployment (prompts chunked by `budget`)."""
    measurements = [measurement(p, cost_model, budget) for p in points]
    return fit_efficiency(cost_model, measurements, allow_curve=allow_curve), measurements


def point_rows(
    fit: Fit, measurements: Sequence[Measurement], points: Sequence[dict], cost_model: CostModel
) -> list[dict]:
    """Per point: its label, the measured and predicted seconds, the residual, the spread of
    its repeats where measured (JSON-ready)."""
    rows = []
    for m, point, residual in zip(measurements, points, fit.residuals, strict=True):
        model = (m.cost_model or cost_model).with_efficiency(fit.efficiency)
        row = {
            "label": m.label,
            "measured_s": m.seconds,
            "predicted_s": predict(model, m),
            "residual": residual,
        }
        for key in ("spread", "source", "table"):
            if key in point:
                row[key] = point[key]
        rows.append(row)
    return rows


def format_rows(rows: Sequence[dict]) -> str:
    """The fit's error per point, one line each."""
    width = max(len(r["label"]) for r in rows)
    lines = []
    for r in rows:
        spread = f" (repeats ±{r['spread'] / 2:.0%})" if "spread" in r else ""
        lines.append(
            f"  {r['label']:<{width}}  measured {_ms(r['measured_s'])}{spread}  model "
            f"{_ms(r['predicted_s'])}  {r['residual']:+.1%}"
        )
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def calibration_of(fit: Fit, name: str, rows: list[dict] | None, **metadata) -> Calibration:
    """The calibration a fit makes, its fit statistics (and points, if given) beside it."""
    extra = {} if rows is None else {"points": rows}
    return Calibration(name, fit.efficiency, fit.band, {**metadata, "fit": fit.metadata(), **extra})
