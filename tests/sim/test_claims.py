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
    assert report.verdict.startswith("Cannot hold") and report.status == claims.FAILS
    assert "KV transfer" in report.simulation[0]


def test_claim_2_chunking_bounds_the_stall():
    report = claim_2()
    colocated, chunked = report.simulation[1:]
    assert "colocated" in colocated and "chunked" in chunked
    assert report.status == claims.HOLDS_IF


def test_render_lists_every_claim():
    reports = [
        ClaimReport(i, f"claim {i}", ["p"], ["s"], "v", claims.HOLDS_IF, "served")
        for i in range(1, 6)
    ]
    text = render(reports)
    assert all(f"## {i}. claim {i}" in text for i in range(1, 6))
    assert "**Verdict: holds only if.** v" in text
    # The summary table names each claim's band: the served one for served figures.
    assert (
        f"| 3 | claim 3 | served | `h100-sxm-trtllm`, served band ±{claims.BANDS['served']:.0%}"
        in text
    )


def test_seed_claims_judged_by_arithmetic():
    assert claims.claim_9().status == claims.FAILS
    assert "32 for 32,768 tokens" in claims.claim_9().physics[0]
    ten = claims.claim_10()
    assert ten.status == claims.FAILS and ten.figure == "kernel"
    best, _ = claims._best_measured_gemm_share()
    assert 0.5 < best < 0.92
