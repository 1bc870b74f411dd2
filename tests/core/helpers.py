"""Builders and a fake model loop for pure-Python scheduler tests."""

from __future__ import annotations

from pdserve.core.config import CacheConfig, SchedulerConfig
from pdserve.core.request import Request
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.scheduler import Scheduler

EOS = 2
# A Scheduler's max_model_len is set (the engine resolves it from the model).
MAX_MODEL_LEN = 8192


def make_request(
    request_id: str, num_prompt: int, max_tokens: int = 4, first_token: int = 100, **params
) -> Request:
    prompt = [first_token + i for i in range(num_prompt)]
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    return Request(request_id, prompt, sampling, eos_token_ids=frozenset({EOS}))


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **kwargs) -> Scheduler:
    prefix = kwargs.pop("enable_prefix_caching", True)
    config = SchedulerConfig(**{"max_model_len": MAX_MODEL_LEN, **kwargs})
    return Scheduler(config, CacheConfig(block_size, num_blocks, prefix))


def fake_token(request: Request) -> int:
    """A deterministic 'model': the next token depends only on the sequence so far."""
    return 1000 + len(request.all_token_ids) * 7 % 97


def step(scheduler: Scheduler):
    output = scheduler.schedule()
    sampled = {
        s.request.request_id: fake_token(s.request) for s in output.scheduled if s.is_sampling
    }
    finished = scheduler.update_from_output(output, sampled)
    return output, finished


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list:
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        outputs.append(step(scheduler))
    raise AssertionError("scheduler did not finish: deadlock or livelock")
