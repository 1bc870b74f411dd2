"""Hand-made records with exactly known timelines."""

from __future__ import annotations

from pdserve.workload.records import RequestRecord


def record(
    index: int,
    send: float,
    ttft: float,
    gaps: list[float],
    prompt_len: int = 100,
    kind: str = "chat",
) -> RequestRecord:
    """A successful request sent at `send` whose tokens arrive `ttft` later, then `gaps` apart."""
    times = [send + ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(
        index=index,
        kind=kind,
        prompt_len=prompt_len,
        output_len=len(times),
        arrival_time=send,
        send_time=send,
        end_time=times[-1],
        token_times=times,
        num_output_tokens=len(times),
        is_usage_reported=True,
    )


def failed(index: int, send: float, end: float) -> RequestRecord:
    return RequestRecord(
        index, "chat", 10, 10, send, send_time=send, end_time=end, error="HTTP 500: boom"
    )
