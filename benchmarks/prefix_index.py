"""What the router's prefix index costs per request and per KV event, in CPU microseconds.

Two or more workers, each with `--blocks` block hashes indexed (as their KV events left it),
and prompts of `--prompt-tokens` whose first half is cached on one worker: per request the
router hashes the prompt's blocks (`PromptInfo.from_token_ids`) and matches them on every
worker (`WorkerPool.select`, prefix_aware); per event it applies one stored event of one block
and one removed one (`KVEventSubscriber.apply`, JSON decoded). Figures are the median of
`--repeats` timed loops.

    .venv/bin/python benchmarks/prefix_index.py [--workers 2] [--blocks 10000]
        [--prompt-tokens 2000] [--block-size 16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pdserve.router.kv_events import KVEventSubscriber, _Position
from pdserve.router.policies import PoolRole, make_policy
from pdserve.router.pool import WorkerPool, WorkerRegistry, WorkerState
from pdserve.router.prefix_index import PrefixIndex, PromptInfo


def _median_us(run, num_calls: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(num_calls):
            run()
        samples.append((time.perf_counter() - start) / num_calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=10_000)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(0)
    index = PrefixIndex(args.block_size)
    pools = [WorkerPool(role, make_policy("prefix_aware", role), index) for role in PoolRole]
    registry = WorkerRegistry(*pools)
    tokens = [rng.randrange(50_000) for _ in range(args.prompt_tokens)]
    prompt = PromptInfo.from_token_ids(tokens, args.block_size)
    for i in range(args.workers):
        worker = registry.add(f"http://w{i}:8000", PoolRole.DECODE)
        worker.state = WorkerState.HEALTHY
        index.replace(worker.url, (rng.getrandbits(64) for _ in range(args.blocks)))
    first = registry.decode.routable()[0]
    index.add(first.url, prompt.block_hashes[: len(prompt.block_hashes) // 2])

    hash_us = _median_us(
        lambda: PromptInfo.from_token_ids(tokens, args.block_size), 200, args.repeats
    )
    select_us = _median_us(lambda: registry.decode.select(prompt), 2000, args.repeats)
    assert registry.decode.select(prompt).worker is first

    subscriber = KVEventSubscriber(index, client=None, connect_timeout_s=1.0)
    position = _Position()
    position.epoch, position.seq = "e", 0
    lines = []
    for seq in range(1, 20_001, 2):
        block_hash = rng.getrandbits(64)
        lines.append(json.dumps({"type": "stored", "seq": seq, "block_hashes": [block_hash]}))
        lines.append(json.dumps({"type": "removed", "seq": seq + 1, "block_hashes": [block_hash]}))
    start = time.perf_counter()
    for line in lines:
        subscriber.apply(first.url, position, json.loads(line))
    event_us = (time.perf_counter() - start) / len(lines) * 1e6
    print(
        json.dumps(
            {
                "workers": args.workers,
                "indexed_blocks_per_worker": args.blocks,
                "prompt_tokens": args.prompt_tokens,
                "hash_prompt_us": round(hash_us, 1),
                "select_us": round(select_us, 1),
                "per_request_us": round(hash_us + select_us, 1),
                "per_event_us": round(event_us, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
