import importlib.util
import sys
from pathlib import Path

# docs/claims.md's generator is a script, not part of the installed package.
_SPEC = importlib.util.spec_from_file_location(
    "claims", Path(__file__).parents[2] / "benchmarks" / "claims.py"
)
claims = importlib.util.module_from_spec(_SPEC)
sys.modules["claims"] = claims  # dataclasses look their module up while the class is built
_SPEC.loader.exec_module(claims)
ClaimReport, claim_1, claim_2, render = (
    claims.ClaimReport,
    claims.claim_1,
    claims.claim_2,
    claims.render,
)


def test_claim_1_physics_and_verdict():
    report = claim_1()
    text = " ".join(report.physics)
    assert "9.18 GB" in text  # 28,000 × 327,680 B
    assert "184 ms" in text  # over 50 GB/s
    assert "H100-SXM fp8 372 ms" in text  # 4.86e15 FLOPs at 8 × peak
    assert report.verdict.startswith("Cannot hold")
    assert "KV transfer" in report.simulation[0]


def test_claim_2_chunking_bounds_the_stall():
    report = claim_2()
    colocated, chunked = report.simulation[1:]
    assert "colocated" in colocated and "chunked" in chunked
    assert report.verdict.startswith("Plausible")


def test_render_lists_every_claim():
    reports = [ClaimReport(i, f"claim {i}", ["p"], ["s"], "v") for i in range(1, 6)]
    text = render(reports)
    assert all(f"## {i}. claim {i}" in text for i in range(1, 6))
    assert "**Verdict.** v" in text
