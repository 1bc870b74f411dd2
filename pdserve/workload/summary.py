"""The one-screen summary table printed at the end of a run."""

from __future__ import annotations

from pdserve.workload.metrics import LATENCY_METRICS
from pdserve.workload.results import rate_text
from pdserve.workload.run import BenchResult

_WIDTH = 78


def format_summary(result: BenchResult) -> str:
    """A fixed-width block: counts and throughputs, a latency table, the verdict."""
    m = result.metrics
    lines = [
        f" {result.label} ".center(_WIDTH, "="),
        _pair("Model", result.model, "Workload", result.spec.workload.name),
        _pair(
            "Request rate (req/s)",
            rate_text(result.request_rate),
            "Duration (s)",
            f"{m.duration:.2f}",
        ),
        _pair("Completed", m.completed, "Failed", m.failed),
        _pair("Input tokens", m.total_input_tokens, "Output tokens", m.total_output_tokens),
        _pair(
            "Requests/s",
            f"{m.request_throughput:.3f}",
            "Output tok/s",
            f"{m.output_throughput:.1f}",
        ),
        _pair(
            "Total tok/s", f"{m.total_token_throughput:.1f}", "Goodput (req/s)", _goodput(result)
        ),
        "-" * _WIDTH,
        f"{'ms':<6}{'mean':>12}{'median':>12}{'p90':>12}{'p99':>12}{'max':>12}{'std':>12}",
    ]
    for name in LATENCY_METRICS:
        d = getattr(m, name)
        values = (d.mean, d.median, d.p90, d.p99, d.max, d.std)
        lines.append(f"{name.upper():<6}" + "".join(f"{v:>12.1f}" for v in values))
    lines += ["-" * _WIDTH, result.interference.verdict, "=" * _WIDTH]
    return "\n".join(lines)


def _goodput(result: BenchResult) -> str:
    goodput = result.metrics.request_goodput
    if goodput is None:
        return "- (no --goodput)"
    return f"{goodput:.3f} ({result.metrics.num_good} ok)"


def _pair(k1: str, v1, k2: str, v2) -> str:
    return f"{k1 + ':':<22}{v1!s:<17}{k2 + ':':<20}{v2!s}"
