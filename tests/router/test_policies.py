import pytest

from pdserve.router.policies import (
    LeastLoaded,
    PoolRole,
    PrefixAware,
    RoundRobin,
    WorkerLoad,
    make_policy,
)

DECODE, PREFILL = PoolRole.DECODE, PoolRole.PREFILL


def test_round_robin_cycles_over_the_candidates():
    policy = RoundRobin(DECODE)
    loads = [WorkerLoad()] * 3
    assert [policy.select(loads, 10) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_decode_counts_sequences_then_kv_usage():
    policy = LeastLoaded(DECODE)
    loads = [
        WorkerLoad(num_running=3),
        WorkerLoad(num_running=1, num_waiting=1, kv_cache_usage=0.3),
        WorkerLoad(num_running=2, kv_cache_usage=0.1),
    ]
    assert policy.select(loads, 10) == 2  # 2 sequences each; lower KV usage wins
    loads[1] = WorkerLoad(num_running=1)
    assert policy.select(loads, 10) == 1


def test_least_loaded_prefill_counts_pending_prompt_tokens_not_sequences():
    policy = LeastLoaded(PREFILL)
    loads = [
        WorkerLoad(num_running=5, num_pending_prefill_tokens=100),
        WorkerLoad(num_running=1, num_pending_prefill_tokens=3000),
    ]
    assert policy.select(loads, 10) == 0


def test_least_loaded_ties_go_to_lowest_index():
    assert LeastLoaded(DECODE).select([WorkerLoad(), WorkerLoad()], 1) == 0


def test_prefix_aware_prefers_longest_cached_prefix():
    policy = PrefixAware(DECODE)
    loads = [
        WorkerLoad(num_cached_tokens=16),
        WorkerLoad(num_running=1, num_cached_tokens=64),
        WorkerLoad(),
    ]
    assert policy.select(loads, 100) == 1


def test_prefix_aware_without_any_match_is_least_loaded():
    policy = PrefixAware(DECODE)
    assert policy.select([WorkerLoad(num_running=2), WorkerLoad(num_running=1)], 100) == 1


def test_prefix_aware_falls_back_when_the_match_is_overloaded():
    policy = PrefixAware(DECODE, balance_factor=2.0)
    # best: 4 sequences (+1 = 5) vs least: 1 (+1 = 2): 5 > 2 * 2 -> imbalanced.
    loads = [WorkerLoad(num_running=4, num_cached_tokens=64), WorkerLoad(num_running=1)]
    assert policy.select(loads, 100) == 1
    # best: 2 (+1 = 3) vs 1 (+1 = 2): 3 <= 4 -> keep the cache.
    loads[0] = WorkerLoad(num_running=2, num_cached_tokens=64)
    assert policy.select(loads, 100) == 0


def test_prefix_aware_prefill_weighs_imbalance_in_prompt_sized_units():
    policy = PrefixAware(PREFILL, balance_factor=2.0)
    # A 3000-token prompt: 1000 pending tokens on the match is no reason to leave it...
    loads = [WorkerLoad(num_pending_prefill_tokens=1000, num_cached_tokens=2048), WorkerLoad()]
    assert policy.select(loads, 3000) == 0
    # ...but a whole extra prompt and more is.
    loads[0] = WorkerLoad(num_pending_prefill_tokens=3500, num_cached_tokens=2048)
    assert policy.select(loads, 3000) == 1


def test_prefix_aware_ties_between_matches_go_to_the_less_loaded():
    policy = PrefixAware(DECODE)
    loads = [
        WorkerLoad(num_running=2, num_cached_tokens=32),
        WorkerLoad(num_running=1, num_cached_tokens=32),
    ]
    assert policy.select(loads, 100) == 1


def test_make_policy_names_and_errors():
    assert isinstance(make_policy("round_robin", DECODE), RoundRobin)
    assert isinstance(make_policy("least_loaded", PREFILL), LeastLoaded)
    assert isinstance(make_policy("prefix_aware", DECODE, 3.0), PrefixAware)
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random", DECODE)
    with pytest.raises(ValueError, match="balance_factor"):
        PrefixAware(DECODE, balance_factor=0.5)


def test_empty_candidate_list_is_an_error():
    with pytest.raises(ValueError, match="no candidate"):
        LeastLoaded(DECODE).select([], 1)


def test_a_registered_policy_is_a_choice_of_the_router_flags_and_its_config():
    """A new policy is one `register_policy`: the flags offer it, the config accepts it,
    `make_policy` (the router's and the simulator's) builds it."""
    import argparse

    from pdserve.flags import add_flags
    from pdserve.router import policies
    from pdserve.router.cli import ROUTING_FLAGS
    from pdserve.router.config import RouterConfig

    class First:
        def __init__(self, role):
            self.role = role

        def select(self, loads, prompt_len):
            return 0

    policies.register_policy("first", lambda role, balance_factor: First(role))
    try:
        with pytest.raises(ValueError, match="registered already"):
            policies.register_policy("first", lambda role, balance_factor: First(role))
        assert isinstance(make_policy("first", PREFILL), First)
        RouterConfig(prefill_urls=(), decode_urls=("http://127.0.0.1:1",), decode_policy="first")
        parser = argparse.ArgumentParser()
        add_flags(parser, None, ROUTING_FLAGS)
        assert parser.parse_args(["--decode-policy", "first"]).decode_policy == "first"
    finally:
        del policies.POLICIES["first"]
    with pytest.raises(ValueError, match="unknown policy 'first'"):
        RouterConfig(prefill_urls=(), decode_urls=("http://127.0.0.1:1",), decode_policy="first")
