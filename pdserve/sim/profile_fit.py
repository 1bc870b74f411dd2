"""Calibrations from measured points: a server's profile (`pdserve bench --workload profile`)
or published ones, fitted and written with the stack they describe and each point's residual.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from pdserve.sim.calibration import Fit, Measurement, fit_efficiency, fit_link, predict
from pdserve.sim.cost_model import CostModel
from pdserve.sim.efficiency import Calibration
from pdserve.sim.errors import SimConfigError
from pdserve.sim.points import deployment, measurement
from pdserve.workload.errors import BenchError
from pdserve.workload.profile import profile_points
from pdserve.workload.records import RequestRecord


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


def load_points(path: str | Path) -> list[dict]:
    """Points from a JSON file: a list of points (`sim/points.py`), or an object whose
    "points" holds them (a source file, as in `sim/data/sources/`)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SimConfigError(f"--points: cannot read {path}: {exc}") from None
    points = data.get("points") if isinstance(data, dict) else data
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise SimConfigError(f"--points: {path} holds no list of point objects")
    return points


def hold_out_matcher(specs: Sequence[str] | None):
    """A predicate for `--hold-out KEY=VALUE[,KEY=VALUE] ...`: a point matching every pair
    of any one spec is held out (values compared as text: tp=4, kind=itl)."""
    rules = []
    for spec in specs or ():
        pairs = [part.split("=", 1) for part in spec.split(",")]
        if not all(len(pair) == 2 and pair[0] for pair in pairs):
            raise SimConfigError(f"--hold-out: {spec!r} is not KEY=VALUE[,KEY=VALUE]")
        rules.append(pairs)
    return lambda point: any(
        all(str(point.get(key)) == value for key, value in rule) for rule in rules
    )


def calibrate_table(
    points: Sequence[dict],
    cost_model: CostModel,
    budget: int | None,
    hold_out: Sequence[str] | None = None,
) -> tuple[Fit, list[dict], list[dict]]:
    """Fit published or hand-measured points (`sim/points.py`) on `cost_model`'s hardware:
    each on the deployment it names (model, tp, dtype), else `cost_model`'s; points of other
    hardware are left out. Points `hold_out` matches are not fitted: their rows report the
    fit's error on them. Returns the fit, the fitted rows and the held-out rows."""
    hardware = cost_model.hardware.name
    mine = [p for p in points if p.get("hardware", hardware) == hardware]
    collectives = [p for p in mine if p.get("kind") == "all_reduce"]
    mine = [p for p in mine if p.get("kind") != "all_reduce"]
    if not mine:
        raise SimConfigError(f"--points: no point on {hardware} (give --hardware)")
    is_held = hold_out_matcher(hold_out)
    measurements = [measurement(p, _deployment(p, cost_model), budget) for p in mine]
    fitted = [(p, m) for p, m in zip(mine, measurements, strict=True) if not is_held(p)]
    held = [(p, m) for p, m in zip(mine, measurements, strict=True) if is_held(p)]
    if len(fitted) < 3:
        raise SimConfigError(f"--hold-out leaves {len(fitted)} points to fit; need 3")
    # A curve needs many row counts of one deployment: published tables get the roofline.
    named = any("model" in p for p in mine)
    network = network_share(collectives, cost_model)
    fit = fit_efficiency(cost_model, [m for _, m in fitted], network=network, allow_curve=not named)
    rows = point_rows(fit, [m for _, m in fitted], [p for p, _ in fitted], cost_model)
    held_rows = [{**_row(fit, m, p, cost_model), "held_out": True} for p, m in held]
    return fit, rows, held_rows


def network_share(collectives: Sequence[dict], cost_model: CostModel) -> float:
    """`Efficiency.network` from the stack's own all-reduce points: their fitted share of
    the TP link's line rate over the link's catalogued share (1.0 without such points)."""
    if not collectives:
        return 1.0
    link = cost_model.tp_link
    try:
        fit = fit_link(link.bandwidth, collectives)
    except (KeyError, TypeError) as exc:
        raise SimConfigError(
            f"--points: all_reduce points need num_gpus, bytes, seconds: {exc!r}"
        ) from None
    return min(1.0, max(fit.efficiency / link.efficiency, 1e-3))


def _deployment(point: dict, cost_model: CostModel) -> CostModel:
    """The deployment `point` names, what it leaves out taken from `cost_model`'s."""
    if "model" not in point:
        return cost_model
    given = {"hardware": cost_model.hardware.name, "tp": cost_model.tp, "dtype": cost_model.dtype}
    return deployment({**given, **point})


def _row(fit: Fit, m: Measurement, point: dict, cost_model: CostModel) -> dict:
    predicted = predict((m.cost_model or cost_model).with_efficiency(fit.efficiency), m)
    return {
        "label": m.label,
        "measured_s": m.seconds,
        "predicted_s": predicted,
        "residual": predicted / m.seconds - 1,
        **{k: point[k] for k in ("source", "table") if k in point},
    }


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
