"""The same greedy output however the prompt's computation is split or shared."""

import pytest

from pdserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(make_llm, chat_token_ids):
    """Each prompt alone, prefilled whole (colocated)."""
    llm = make_llm(mode="colocated", enable_prefix_caching=False)
    return [llm.generate([p], PARAMS, use_tqdm=False)[0].token_ids for p in chat_token_ids]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_whole(make_llm, chat_token_ids, reference, chunk):
    llm = make_llm(
        mode="chunked",
        max_num_batched_tokens=max(chunk, 8),
        long_prefill_token_threshold=chunk,
        enable_prefix_caching=False,
    )
    results = llm.generate(chat_token_ids[:2], PARAMS, use_tqdm=False)
    assert [r.token_ids for r in results] == reference[:2]


def test_batched_with_other_requests_matches_alone(make_llm, chat_token_ids, reference):
    llm = make_llm(mode="chunked", max_num_batched_tokens=96, max_num_partial_prefills=4)
    results = llm.generate(chat_token_ids, PARAMS, use_tqdm=False)
    assert [r.token_ids for r in results] == reference


def test_prefix_cache_hit_matches_and_skips_work(make_llm, chat_token_ids, reference):
    llm = make_llm(mode="chunked", max_num_batched_tokens=256)
    llm.generate([chat_token_ids[0]], PARAMS, use_tqdm=False)
    again = llm.generate([chat_token_ids[0]], PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16
    assert again.token_ids == reference[0]
    # Shared system-prompt prefix: the second prompt reuses the first one's blocks.
    other = llm.generate([chat_token_ids[1]], PARAMS, use_tqdm=False)[0]
    assert other.num_cached_tokens > 0 and other.token_ids == reference[1]


def test_preemption_completes_all_with_same_output(make_llm, chat_token_ids, reference):
    # 14 blocks of 16 tokens cannot hold four ~50-token prompts plus 24 outputs each at once.
    llm = make_llm(
        mode="chunked",
        num_kv_blocks=14,
        max_num_batched_tokens=128,
        max_num_partial_prefills=4,
        enable_prefix_caching=False,
    )
    results = llm.generate(chat_token_ids, PARAMS, use_tqdm=False)
    assert [r.token_ids for r in results] == reference
    assert llm.engine.scheduler.num_preemptions > 0
    stats = llm.engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
