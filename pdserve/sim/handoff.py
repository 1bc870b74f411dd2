"""How much of a KV hand-off's transfer lands on the TTFT's critical path (issue 24).

Pulled after prefill, all of it: the decode worker starts fetching once the prefill leg
answered. Streamed, only what the link cannot hide: the prefill worker publishes each
chunk's KV as the chunk's step ends, the link carries the chunks in order while the next ones
compute, and the first token waits for the last chunk to land. With `num_chunks` equal chunks
of a prefill lasting `prefill_s` (chunk i ends at ``i * prefill_s / n``) and a link moving
`bandwidth` bytes/s, chunk i lands at ``max(end of chunk i, landing of chunk i-1) + b / bw``,
so the exposed part is::

    max(B / (n * bw), B / bw - (n - 1) / n * prefill_s)

the last chunk's own transfer, or what the link fell behind over the whole prefill. Both
`pdserve simulate` (`sim/simulator.py`) and `benchmarks/kv_stream.py` use this.
"""

from __future__ import annotations


def exposed_fraction(num_bytes: float, bandwidth: float, hiding_s: float, num_chunks: int) -> float:
    """The share of a streamed transfer's bytes still to move once the prefill ended;
    `hiding_s`: the compute after the first chunk's step (``(n - 1) / n * prefill_s`` for
    equal chunks), while which the link carries the earlier chunks."""
    if num_bytes <= 0:
        return 0.0
    num_chunks = max(num_chunks, 1)
    return max(1.0 / num_chunks, 1.0 - bandwidth * hiding_s / num_bytes)


def exposed_seconds(
    num_bytes: float,
    bandwidth: float,
    prefill_s: float,
    num_chunks: int,
    *,
    is_streamed: bool,
    latency_s: float = 0.0,
) -> float:
    """Transfer time on the critical path, after the prefill's last step."""
    hiding_s = prefill_s * (num_chunks - 1) / max(num_chunks, 1)
    fraction = exposed_fraction(num_bytes, bandwidth, hiding_s, num_chunks) if is_streamed else 1
    return num_bytes * fraction / bandwidth + latency_s


def predicted_ttft(
    prefill_s: float, num_bytes: float, bandwidth: float, num_chunks: int, latency_s: float = 0.0
) -> dict[str, float]:
    """TTFT of the prefill alone, pulled and streamed hand-offs (compute beyond the prefill,
    e.g. the decode worker's first step, left out: it is the same for both)."""
    return {
        "alone": prefill_s,
        **{
            name: prefill_s
            + exposed_seconds(
                num_bytes,
                bandwidth,
                prefill_s,
                num_chunks,
                is_streamed=name == "stream",
                latency_s=latency_s,
            )
            for name in ("pull", "stream")
        },
    }
