"""Kernel choices measured on this machine: the prefill attention path picks what its own
timing says, the timing is taken once per case and cached on disk, and a timing the test
makes itself agrees with the choice wherever the two paths differ clearly."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from pdserve.model import auto_dtype
from pdserve.model.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    prefill_case,
    prefill_cases,
    prefill_kernel_choice,
)
from pdserve.model.kernels import choice as kernel_choice
from pdserve.model.kernels.choice import MeasuredChoice, interleaved_best_seconds, size_bucket
from pdserve.model.kernels.cpu_ops import (
    BF16_KERNEL_MAX_ROWS,
    DPBF16_ALL_ROWS,
    DPBF16_FEW_ROWS,
    DPBF16_TILE_ROWS,
    KV_PREFETCH_SEQS,
    dpbf16_choice,
    kv_prefetch_choice,
    load_cpu_ops,
)
from tests.model.helpers import kernel_variants, require_kernels

# A margin past which the test's own timing must agree with the choice (shared CPUs are noisy).
CLEAR_MARGIN = 1.5
ATTEMPTS = 3
BF16_TOL = dict(rtol=2e-2, atol=5e-2)


def test_size_bucket():
    assert [size_bucket(n) for n in (0, 1, 16, 17, 512, 513, 3000)] == [
        0,
        16,
        16,
        32,
        512,
        1024,
        4096,
    ]


def test_measured_once_per_case_and_cached_on_disk(tmp_path):
    measured = []

    def prepare(case):
        """A sleeps 1 ms and B 20 ms for case "a", the other way round for "b"."""
        measured.append(case)
        fast, slow = (lambda: time.sleep(0.001)), (lambda: time.sleep(0.02))
        return (fast, slow) if case[0] == "a" else (slow, fast)

    choice = MeasuredChoice("demo", "build-1", prepare, tmp_path)
    assert choice.a_wins(("a", 1)) and choice.a_wins(("a", 1))
    assert not choice.a_wins(("b", 1))
    assert measured == [("a", 1), ("b", 1)]
    again = MeasuredChoice("demo", "build-1", prepare, tmp_path)  # a later process
    assert again.a_wins(("a", 1)) and not again.a_wins(("b", 1))
    assert len(measured) == 2
    other_build = MeasuredChoice("demo", "build-2", prepare, tmp_path)
    other_build.a_wins(("a", 1))
    assert len(measured) == 3  # another library is measured anew


def test_serving_lookups_never_measure_and_leave_the_case_for_idle_time(tmp_path):
    measured = []

    def prepare(case):
        measured.append(case)
        return (lambda: None), (lambda: time.sleep(0.001))

    choice = MeasuredChoice("demo", "build-1", prepare, tmp_path)
    assert choice.a_wins_or(("a", 1), default=False) is False  # unmeasured: the default
    assert choice.a_wins_or(("a", 1), default=False) is False
    assert measured == [] and choice.num_defaulted == 2 and list(choice.pending) == ['["a", 1]']
    assert choice.measure_pending() and measured == [("a", 1)]
    assert not choice.measure_pending() and not choice.pending
    assert choice.a_wins_or(("a", 1), default=False) is True  # measured: A (no sleep) wins


def test_an_unmeasured_case_answers_as_the_nearest_measured_size(tmp_path):
    """Until idle time measures it, a case takes the answer of the measured case with its
    other fields and the nearest sizes; another model's case (no such case) the default."""

    def prepare(case):  # A wins on short prompts, B on long ones
        is_long = case[1] >= 1024
        return (lambda: time.sleep(0.001 * is_long)), (lambda: time.sleep(0.001 * (not is_long)))

    choice = MeasuredChoice("demo", "build-1", prepare, tmp_path, num_size_fields=2)
    choice.measure([("m", 16, 0), ("m", 4096, 4096)], budget_s=60.0)
    assert choice.a_wins_or(("m", 16, 0), default=False) is True  # measured
    assert choice.a_wins_or(("m", 4096, 4096), default=True) is False
    assert choice.a_wins_or(("m", 32, 16), default=False) is True  # nearest: (16, 0)
    assert choice.a_wins_or(("m", 2048, 8192), default=True) is False  # nearest: (4096, 4096)
    assert choice.a_wins_or(("other", 16, 0), default=False) is False  # nothing to borrow
    assert (choice.num_borrowed, choice.num_defaulted) == (2, 1)
    assert set(choice.pending) == {'["m", 32, 16]', '["m", 2048, 8192]', '["other", 16, 0]'}
    without_sizes = MeasuredChoice("demo", "build-1", prepare, tmp_path)  # reads the cache
    assert without_sizes.a_wins_or(("m", 32, 16), default=False) is False  # no borrowing


def test_measure_times_what_its_budget_allows_and_skips_the_rest(tmp_path):
    """What the budget left out takes the default and is never queued for idle time."""
    measured = []

    def prepare(case):
        measured.append(case)
        return (lambda: None), (lambda: None)

    cases = [("a", n) for n in range(4)]
    choice = MeasuredChoice("demo", "build-1", prepare, tmp_path)
    assert choice.measure(cases, budget_s=0.0) == 0
    assert measured == [] and len(choice.skipped) == 4 and not choice.pending
    assert choice.a_wins_or(cases[3], default=False) is False and not choice.pending
    assert choice.measure(cases[:3], budget_s=60.0) == 3
    assert measured == cases[:3] and choice.skipped == {'["a", 3]'} and not choice.pending
    assert choice.measure(cases, budget_s=60.0) == 1  # the cached three are not timed again
    assert MeasuredChoice("demo", "build-1", prepare, tmp_path).timings.keys() == {
        json.dumps(case) for case in cases
    }


def test_prefill_cases_cover_every_chunk_the_limits_allow_and_no_more():
    max_num_new, max_model_len = 512, 3000
    cases = prefill_cases(torch.float32, torch.bfloat16, 9, 3, 64, max_num_new, max_model_len)
    assert len(cases) == len(set(cases))
    met = {
        prefill_case(torch.float32, torch.bfloat16, 9, 3, 64, num_new, num_computed)
        for num_new in range(2, max_num_new + 1)
        for num_computed in range(0, max_model_len - num_new + 1, 7)
    }
    assert met == set(cases)
    costs = [num_new * (num_new + num_computed) for *_, num_new, num_computed in cases]
    assert costs == sorted(costs)


def _own_timing(ops, dtype, num_new, num_computed) -> tuple[float, float]:
    """(kernel, SDPA) best seconds on an input of the test's own (contiguous blocks)."""
    generator = torch.Generator().manual_seed(3)
    num_blocks = -(-(num_computed + num_new) // 16)
    cache = torch.randn(2, num_blocks, 16, 3, 64, generator=generator).to(dtype)
    meta = AttentionMetadata.build([(list(range(num_blocks)), num_computed, num_new)], 16, "cpu")
    chunk = meta.prefills[0]
    q = torch.randn(num_new, 9, 64, generator=generator).to(dtype)
    k, v = cache.view(2, -1, 3, 64)[:, meta.slot_mapping]
    sdpa = TorchAttentionBackend(64**-0.5)
    threads = torch.get_num_threads()
    return interleaved_best_seconds(
        lambda: ops.paged_prefill(q, cache, chunk.block_table, num_computed, sdpa.scale, threads),
        lambda: sdpa._prefill(q, k, v, cache, chunk),
        rounds=7,
    )


@pytest.mark.parametrize("isa", kernel_variants())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_new", "num_computed"), [(512, 0), (256, 1024)])
def test_prefill_choice_follows_the_measurement(
    isa, dtype, num_new, num_computed, tmp_path, monkeypatch
):
    ops = require_kernels(load_cpu_ops(isa), isa)
    monkeypatch.setattr(kernel_choice, "cache_dir", lambda: tmp_path)
    case = prefill_case(dtype, dtype, 9, 3, 64, num_new, num_computed)
    # Other processes share these cores: a burst of load can skew one measurement, so the
    # choice is measured anew (bounded) until it and the test's timing are taken in quiet
    # enough moments to agree; a chooser that is wrong every time fails.
    disagreements = []
    for _ in range(ATTEMPTS):
        prefill_kernel_choice.cache_clear()
        for cached in tmp_path.glob("*.json"):
            cached.unlink()
        try:
            choice = prefill_kernel_choice(ops)
            wins = choice.a_wins(case)
            kernel_s, sdpa_s = choice.timings[json.dumps(case)]
            assert wins == (kernel_s < sdpa_s)
            assert list(tmp_path.glob(f"prefill-attention-{isa}-*.json"))
        finally:
            prefill_kernel_choice.cache_clear()
        own_kernel_s, own_sdpa_s = _own_timing(ops, dtype, num_new, num_computed)
        clearly_kernel = own_kernel_s * CLEAR_MARGIN < own_sdpa_s
        clearly_sdpa = own_sdpa_s * CLEAR_MARGIN < own_kernel_s
        if not (clearly_kernel and not wins) and not (clearly_sdpa and wins):
            return
        disagreements.append((own_kernel_s, own_sdpa_s, kernel_s, sdpa_s))
    pytest.fail(f"the choice disagreed with the test's timing every time: {disagreements}")


def test_auto_dtype_is_the_measured_faster_one(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(kernel_choice, "cache_dir", lambda: tmp_path)
    auto_dtype.dtype_choice.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="pdserve.model.auto_dtype"):
            chosen = auto_dtype.measured_cpu_dtype()
        bf16_s, fp32_s = auto_dtype.dtype_choice().timing(auto_dtype.CASE)
        assert chosen is (torch.bfloat16 if bf16_s < fp32_s else torch.float32)
        assert f"dtype auto: {str(chosen).removeprefix('torch.')} on this CPU" in caplog.text
        assert list(tmp_path.glob("auto-dtype-*.json"))  # the next process reads it
    finally:
        auto_dtype.dtype_choice.cache_clear()


@pytest.mark.parametrize("isa", kernel_variants())
def test_bf16_dot_products_serve_the_rows_they_measured_faster_on(isa, tmp_path, monkeypatch):
    """Where the kernels have vdpbf16ps (and no AMX tiles take those rows), a full tile of
    rows uses it exactly when it timed faster here, and both ways compute the same linear."""
    ops = require_kernels(load_cpu_ops(isa), isa)
    before = ops.tune_bf16_dot()  # from the machine's cache: restored at the end
    if before is None:
        assert not ops.has_bf16_dot or ops._lib.linear_has_amx()
        return
    monkeypatch.setattr(kernel_choice, "cache_dir", lambda: tmp_path)
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 256, generator=generator).bfloat16()
    x = torch.randn(DPBF16_TILE_ROWS, 256, generator=generator).bfloat16()
    packed = ops.pack_dense(weight)
    expected = x.float() @ weight.float().T
    try:
        for rows in (DPBF16_ALL_ROWS, DPBF16_FEW_ROWS):
            ops.set_dpbf16_max_rows(rows)
            torch.testing.assert_close(ops.linear(x, packed, None).float(), expected, **BF16_TOL)
        dpbf16_choice.cache_clear()
        rows = ops.tune_bf16_dot()
        all_s, few_s = dpbf16_choice(ops).timing(("linear-dpbf16", DPBF16_TILE_ROWS))
        assert rows == (DPBF16_ALL_ROWS if all_s < few_s else DPBF16_FEW_ROWS)
        # Batches the dot products serve stay in the kernels (and the one-call decode step).
        kernel_rows = ops.dense_kernel_max_rows(torch.bfloat16)
        assert kernel_rows == (BF16_KERNEL_MAX_ROWS if rows == DPBF16_ALL_ROWS else 8)
        assert list(tmp_path.glob(f"linear-dpbf16-{isa}-*.json"))
    finally:
        dpbf16_choice.cache_clear()
        ops.set_dpbf16_max_rows(before)


@pytest.mark.parametrize("isa", kernel_variants())
def test_decode_attention_prefetches_its_kv_where_it_measured_faster(isa, tmp_path, monkeypatch):
    """Decode attention prefetches its KV into L1 exactly when that timed faster here than
    into L2, and either way computes the same attention, bit for bit."""
    ops = require_kernels(load_cpu_ops(isa), isa)
    before = ops.is_kv_prefetch_into_l1  # from the machine's cache: restored at the end
    monkeypatch.setattr(kernel_choice, "cache_dir", lambda: tmp_path)
    generator = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 12, 16, 3, 64, generator=generator).bfloat16()
    tables = torch.randperm(12, generator=generator).view(3, 4).contiguous()
    seq_lens = torch.tensor([64, 40, 9])
    q = torch.randn(3, 9, 64, generator=generator).bfloat16()
    try:
        outputs = []
        for is_l1 in (True, False):
            ops.set_kv_prefetch_into_l1(is_l1)
            outputs.append(ops.paged_decode(q, cache, tables, seq_lens, 0.125))
        assert torch.equal(*outputs)
        kv_prefetch_choice.cache_clear()
        is_l1 = ops.tune_kv_prefetch()
        l1_s, l2_s = kv_prefetch_choice(ops).timing(("paged-decode-kv-prefetch", KV_PREFETCH_SEQS))
        assert is_l1 == (l1_s < l2_s) == ops.is_kv_prefetch_into_l1
        assert list(tmp_path.glob(f"kv-prefetch-{isa}-*.json"))
    finally:
        kv_prefetch_choice.cache_clear()
        ops.set_kv_prefetch_into_l1(before)
