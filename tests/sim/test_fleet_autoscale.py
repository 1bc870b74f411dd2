"""benchmarks/fleet_autoscale.py: the same load per worker on every fleet, and the table
judges the autoscaler against the best fixed split."""

import importlib.util
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "fleet_autoscale", Path(__file__).parents[2] / "benchmarks" / "fleet_autoscale.py"
)
fleet = importlib.util.module_from_spec(_SPEC)
sys.modules["fleet_autoscale"] = fleet
_SPEC.loader.exec_module(fleet)

TRACE = fleet.default_trace_path()


@pytest.mark.skipif(not TRACE.is_file(), reason="the Azure trace is not beside the checkout")
def test_traffic_scales_with_the_fleet():
    args = fleet.parse_args(["--window", "30", "--copies-per-16", "1"])
    small, large = fleet.traffic(args, 16), fleet.traffic(args, 64)
    assert len(large) == 4 * len(small)
    span = max(s.arrival_time for s in small)
    assert span <= 30 * args.time_scale
    assert max(s.arrival_time for s in large) <= 30 * args.time_scale
    assert [s.arrival_time for s in large] == sorted(s.arrival_time for s in large)
    # A fractional count per trace request keeps the ratio too.
    args = fleet.parse_args(["--window", "30", "--copies-per-16", "1.5"])
    assert len(fleet.traffic(args, 16)) == pytest.approx(1.5 * len(small), rel=0.1)


def row(layout: str, goodput: float, worker_seconds: float):
    """A fleet of 16's row: 100 requests over 36 s, run for 40 s."""
    return fleet.Row(16, layout, goodput, worker_seconds, 40.0, 100, 36.0)


def test_the_table_compares_with_the_best_fixed_split():
    args = fleet.parse_args(["--fleets", "16"])
    rows = [
        row("fixed 4:12", 80.0, 640.0),
        row("fixed 8:8", 90.0, 640.0),
        row("autoscaled from 8:8 (3 decisions)", 99.0, 320.0),
    ]
    text = fleet.render(rows, args)
    assert "| 16 | fixed 8:8 | 100 | 90.0 | 640 | 5.062 | best fixed |  |" in text
    assert "x1.10, x0.50 | no fixed layout reaches it |" in text


def test_the_best_fixed_layout_is_the_cheapest_of_those_tied_on_goodput():
    args = fleet.parse_args(["--fleets", "16"])
    rows = [
        row("fixed 8:8", 90.0, 640.0),
        row("fixed 4:4", 89.5, 320.0),
        row("fixed 2:2", 60.0, 160.0),
        row("autoscaled from 2:2 (9 decisions)", 70.0, 200.0),
    ]
    assert fleet.best_fixed(rows).layout == "fixed 4:4"
    assert fleet.cheapest_fixed_at(rows, 70.0).layout == "fixed 4:4"
    assert fleet.cheapest_fixed_at(rows, 95.0) is None
    text = fleet.render(rows, args)
    assert "| fixed 4:4 | 100 | 89.5 | 320 | 10.069 | best fixed |" in text
    assert "x0.78, x0.62 | x0.62 (fixed 4:4) |" in text


def test_fixed_layouts_cover_every_size_and_split_once():
    args = fleet.parse_args(["--sizes", "0.5", "1", "--prefill-shares", "0.25", "0.5"])
    assert fleet.fixed_layouts(args, 16) == [(2, 6), (4, 4), (4, 12), (8, 8)]
    # Tiny fleets keep a worker in each pool and never repeat a layout.
    assert fleet.fixed_layouts(args, 2) == [(1, 1)]
