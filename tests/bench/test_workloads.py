"""Workloads: exact token lengths, reproducible per seed, shaped as specified."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.workload import (
    LengthRange,
    LongContextWorkload,
    MixedWorkload,
    PrefixRepetitionWorkload,
    RandomWorkload,
    TraceEntry,
    TraceWorkload,
    WorkloadOptions,
    make_workload,
)
from pdserve.workload.errors import BenchError
from pdserve.workload.prompts import PromptSynthesizer
from pdserve.workload.run import WARMUP_OUTPUT_LEN, plan_workload
from pdserve.workload.tokenizer import HFTokenizer
from pdserve.workload.words import COMMON_WORDS

SMALL_MIXED = MixedWorkload(
    num_prompts=20, long_fraction=0.2, long_input_len=LengthRange(1500, 2500)
)
WORKLOADS = [
    SMALL_MIXED,
    RandomWorkload(num_prompts=20, input_len=300, output_len=50, range_ratio=0.5),
    PrefixRepetitionWorkload(num_prompts=12, num_prefixes=3, prefix_len=200, input_len=40),
    LongContextWorkload(num_prompts=3),
    TraceWorkload(
        (TraceEntry(0.0, 5, prompt_len=700), TraceEntry(1.5, 9, prompt="Hello there, how are you?"))
    ),
]


def _assert_exact(tokenizer, requests):
    for r in requests:
        assert len(tokenizer.encode(r.prompt)) == r.prompt_len, (r.kind, r.prompt_len)


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
def test_prompts_are_exactly_their_length_and_reproducible(tokenizer, workload):
    plan = plan_workload(workload, tokenizer, seed=1, max_model_len=None)
    _assert_exact(tokenizer, plan.requests)
    assert plan.requests == plan_workload(workload, tokenizer, seed=1, max_model_len=None).requests
    assert np.array_equal(plan.arrivals(2.0, 1.0), plan.arrivals(2.0, 1.0))
    if workload.name != "trace":
        other = plan_workload(workload, tokenizer, seed=2, max_model_len=None)
        assert other.requests != plan.requests


def test_random_lengths_stay_in_the_range(tokenizer):
    plan = plan_workload(WORKLOADS[1], tokenizer, seed=0, max_model_len=None)
    assert {r.prompt_len for r in plan.requests} <= set(range(150, 451))
    assert {r.output_len for r in plan.requests} <= set(range(25, 76))
    assert len({r.prompt_len for r in plan.requests}) > 5


def test_requests_are_fitted_to_the_context(tokenizer):
    plan = plan_workload(LongContextWorkload(num_prompts=3), tokenizer, seed=0, max_model_len=1000)
    for r in plan.requests:
        assert r.prompt_len + r.output_len == 1000
    _assert_exact(tokenizer, plan.requests)


def test_mixed_has_chat_at_the_rate_and_long_documents_in_bursts(tokenizer):
    workload = MixedWorkload(
        num_prompts=60, long_fraction=0.1, burst_size=3, long_input_len=LengthRange(1000, 1200)
    )
    plan = plan_workload(workload, tokenizer, seed=0, max_model_len=None)
    kinds = [r.kind for r in plan.requests]
    assert kinds.count("long-doc") == 6
    chat = [r for r in plan.requests if r.kind == "chat"]
    assert all(32 <= r.prompt_len <= 256 and 128 <= r.output_len <= 512 for r in chat)
    times = plan.arrivals(2.0, 1.0)
    is_doc = np.array([k == "long-doc" for k in kinds])
    doc_times = np.sort(times[is_doc])
    # Two bursts of three, each at one instant, inside the chat traffic's span.
    assert len(np.unique(doc_times)) == 2
    assert np.all(np.bincount(np.unique(doc_times, return_inverse=True)[1]) == 3)
    assert doc_times[0] > 0 and doc_times[-1] < times[~is_doc].max()
    chat_rate = (is_doc.size - is_doc.sum() - 1) / times[~is_doc].max()
    assert chat_rate == pytest.approx(2.0, rel=0.35)
    assert not plan.arrivals(math.inf, 1.0).any()


def test_prefix_repetition_shares_prefix_tokens(tokenizer):
    workload = WORKLOADS[2]
    plan = plan_workload(workload, tokenizer, seed=0, max_model_len=None)
    by_prefix: dict[str, list[list[int]]] = {}
    for r in plan.requests:
        assert r.prompt_len == 240
        by_prefix.setdefault(r.kind, []).append(tokenizer.encode(r.prompt))
    assert len(by_prefix) == 3
    assert all(len(ids) == 4 for ids in by_prefix.values())
    firsts = []
    for ids in by_prefix.values():
        # Same first 200 tokens within a group, different suffixes.
        assert all(x[:200] == ids[0][:200] for x in ids)
        assert len({tuple(x[200:]) for x in ids}) == 4
        firsts.append(tuple(ids[0][:200]))
    assert len(set(firsts)) == 3


def test_trace_arrivals_follow_rescale_or_collapse(tokenizer):
    entries = tuple(TraceEntry(t, 4, prompt_len=20) for t in (0.0, 1.0, 3.0, 4.0))
    plan = plan_workload(TraceWorkload(entries), tokenizer, seed=0, max_model_len=None)
    assert list(plan.arrivals(None, 1.0)) == [0.0, 1.0, 3.0, 4.0]
    # The traced mean rate is 3 requests over 4 s; at 1.5 req/s the same shape takes 2 s.
    assert list(plan.arrivals(1.5, 1.0)) == pytest.approx([0.0, 0.5, 1.5, 2.0])
    assert not plan.arrivals(math.inf, 1.0).any()


def test_a_literal_trace_prompt_too_long_for_the_context_is_cut(tokenizer):
    prompt = " ".join(COMMON_WORDS[:300])
    plan = plan_workload(TraceWorkload((TraceEntry(0.0, 10, prompt=prompt),)), tokenizer, 0, 100)
    [r] = plan.requests
    assert r.prompt_len + r.output_len <= 100
    _assert_exact(tokenizer, plan.requests)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 511, 3000])
def test_synthesizer_hits_every_length(tokenizer, n):
    synth = PromptSynthesizer(tokenizer)
    rng = np.random.default_rng(n)
    assert synth.num_tokens(synth.text(n, rng)) == n
    if n > 20:
        assert synth.num_tokens(synth.text(n, rng, "Summarize this:\n\n")) == n


def test_synthesizer_works_with_a_word_level_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", *COMMON_WORDS, ":", "Summarize"])}
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = HFTokenizer(word_level)
    synth = PromptSynthesizer(tokenizer)
    for n in (3, 10, 333):
        assert len(tokenizer.encode(synth.text(n, np.random.default_rng(0), "Summarize:"))) == n


class _CharTokenizer:
    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode()


def test_synthesizer_rejects_a_tokenizer_without_word_tokens():
    with pytest.raises(BenchError, match="single tokens"):
        PromptSynthesizer(_CharTokenizer())


def test_synthesizer_rejects_a_lead_longer_than_the_prompt(tokenizer):
    with pytest.raises(BenchError, match="lead-in"):
        PromptSynthesizer(tokenizer).text(3, np.random.default_rng(0), "a long lead in text")


def test_registry_builds_by_name_with_defaults_and_overrides():
    rng = np.random.default_rng(0)
    mixed = make_workload("mixed", WorkloadOptions(), rng)
    assert mixed == MixedWorkload()
    random_ = make_workload(
        "random", WorkloadOptions(num_prompts=5, input_len=10, output_len=3), rng
    )
    assert random_ == RandomWorkload(num_prompts=5, input_len=10, output_len=3)
    prefix = make_workload("prefix-repetition", WorkloadOptions(input_len=7), rng)
    assert prefix.input_len == 7
    with pytest.raises(BenchError, match="--workload: unknown 'nope'"):
        make_workload("nope", WorkloadOptions(), rng)


@pytest.mark.parametrize(
    ("make", "option"),
    [
        (lambda: RandomWorkload(num_prompts=0), "--num-prompts"),
        (lambda: RandomWorkload(range_ratio=1.0), "--range-ratio"),
        (lambda: MixedWorkload(long_fraction=1.5), "--long-fraction"),
        (lambda: MixedWorkload(burst_size=0), "--burst-size"),
        (lambda: PrefixRepetitionWorkload(num_prefixes=0), "--num-prefixes"),
        (lambda: LengthRange.parse("9:3", "--chat-input-len"), "--chat-input-len"),
        (lambda: LengthRange.parse("a:b", "--long-input-len"), "--long-input-len"),
    ],
)
def test_bad_options_name_the_option(make, option):
    with pytest.raises(BenchError, match=option):
        make()


@pytest.mark.slow
def test_prompts_are_exact_with_pdserves_own_tokenizer():
    pytest.importorskip("pdserve.model.loader")
    from pdserve.workload.tokenizer import load_tokenizer

    real = load_tokenizer(None)  # the default model's, via pdserve's loader
    plan = plan_workload(SMALL_MIXED, real, seed=0, max_model_len=None)
    _assert_exact(real, plan.requests)


def test_warmups_share_no_prefix_block_with_measured_requests(tokenizer):
    plan = plan_workload(WORKLOADS[1], tokenizer, seed=0, max_model_len=None, num_warmups=2)
    assert len(plan.warmups) == 2
    _assert_exact(tokenizer, plan.warmups)
    firsts = {tuple(tokenizer.encode(r.prompt)[:16]) for r in plan.requests}
    assert not firsts & {tuple(tokenizer.encode(w.prompt)[:16]) for w in plan.warmups}
    assert all(w.output_len == WARMUP_OUTPUT_LEN for w in plan.warmups)


@pytest.mark.parametrize("name", ["mixed", "random", "prefix-repetition", "long-context"])
def test_a_workload_reads_each_option_by_its_own_name(name):
    """No renaming between the command line's options and a workload's fields: every field an
    option names takes that option's value."""
    import dataclasses

    values = {
        "num_prompts": 7,
        "input_len": 33,
        "output_len": 9,
        "range_ratio": 0.25,
        "prefix_len": 55,
        "num_prefixes": 2,
        "long_fraction": 0.5,
        "burst_size": 3,
        "chat_input_len": LengthRange(10, 20),
        "chat_output_len": LengthRange(11, 21),
        "long_input_len": LengthRange(300, 400),
        "long_output_len": LengthRange(12, 22),
    }
    workload = make_workload(name, WorkloadOptions(**values), np.random.default_rng(0))
    read = {f.name for f in dataclasses.fields(workload)} & set(values)
    assert read and all(getattr(workload, field) == values[field] for field in read)
