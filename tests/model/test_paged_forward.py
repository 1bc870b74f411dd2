"""The paged forward pass over mixed flat batches equals a dense causal forward."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.core.config import SchedulerConfig
from pdserve.model.attention import AttentionMetadata, allocate_kv_cache, kv_bytes_per_token
from pdserve.model.config import Quantization
from tests.model.helpers import TINY_VOCAB_SIZE, kernel_variants, pdserve_from_hf, tiny_hf_model

BLOCK_SIZE = 16
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _schedule(lengths: dict[str, int], chunk_sizes: dict[str, int]) -> list[dict[str, int]]:
    """Steps of {seq: num_new_tokens}: every unfinished sequence advances one chunk a step."""
    done = dict.fromkeys(lengths, 0)
    steps = []
    while any(done[s] < lengths[s] for s in lengths):
        step = {
            s: min(chunk_sizes[s], lengths[s] - done[s]) for s in lengths if done[s] < lengths[s]
        }
        for s, n in step.items():
            done[s] += n
        steps.append(step)
    return steps


def _run_paged(
    model,
    tokens: dict[str, torch.Tensor],
    steps: list[dict[str, int]],
    block_tables: dict[str, list[int]],
    num_blocks: int,
    before_step: Callable[[int], None] = lambda index: None,
) -> dict[str, torch.Tensor]:
    """Logits of every token of every sequence, computed step by step in flat batches
    (`before_step(i)` runs before step i)."""
    cache = allocate_kv_cache(model.config, num_blocks, BLOCK_SIZE, model.dtype, "cpu")
    done = dict.fromkeys(tokens, 0)
    logits = {s: [] for s in tokens}
    for index, step in enumerate(steps):
        before_step(index)
        ids, positions, seqs = [], [], []
        for s, n in step.items():
            ids.append(tokens[s][done[s] : done[s] + n])
            positions.append(torch.arange(done[s], done[s] + n))
            seqs.append((block_tables[s], done[s], n))
        meta = AttentionMetadata.build(seqs, BLOCK_SIZE, "cpu")
        hidden = model(torch.cat(ids), torch.cat(positions), cache, meta)
        step_logits = model.compute_logits(hidden)
        start = 0
        for s, n in step.items():
            logits[s].append(step_logits[start : start + n])
            start += n
            done[s] += n
    return {s: torch.cat(chunks) for s, chunks in logits.items()}


@pytest.mark.parametrize(
    ("arch", "tie", "rope_scaling", "use_cpu_kernels"),
    [
        ("llama", True, None, True),
        ("llama", True, None, False),  # plain torch ops instead of the CPU kernels
        ("qwen2", False, None, True),  # QKV bias, untied head
        ("llama", False, LLAMA3_SCALING, True),
    ],
)
def test_mixed_flat_batches_match_dense_forward(arch, tie, rope_scaling, use_cpu_kernels):
    hf_model = tiny_hf_model(arch, tie_word_embeddings=tie, rope_scaling=rope_scaling)
    model = pdserve_from_hf(hf_model, use_cpu_kernels=use_cpu_kernels)
    generator = torch.Generator().manual_seed(1)
    lengths = {"long": 200, "sevens": 40, "ones": 12, "whole": 90, "short": 3}
    # A chunk of 1 decodes; "ones" sits between prefills, so decode rows are not contiguous.
    chunk_sizes = {"long": 64, "sevens": 7, "ones": 1, "whole": 90, "short": 1}
    tokens = {
        s: torch.randint(0, TINY_VOCAB_SIZE, (n,), generator=generator) for s, n in lengths.items()
    }
    # Shuffled, interleaved physical blocks; block 0 is left unused.
    needed = {s: -(-n // BLOCK_SIZE) for s, n in lengths.items()}
    physical = (torch.randperm(sum(needed.values()), generator=generator) + 1).tolist()
    block_tables = {}
    for s, n in needed.items():
        block_tables[s], physical = physical[:n], physical[n:]
    steps = _schedule(lengths, chunk_sizes)
    assert any(len(step) >= 4 for step in steps)  # the batches really are mixed
    paged = _run_paged(model, tokens, steps, block_tables, sum(needed.values()) + 1)
    with torch.no_grad():
        for s, ids in tokens.items():
            dense = hf_model(ids[None]).logits[0]
            torch.testing.assert_close(paged[s], dense, atol=2e-4, rtol=1e-4, msg=s)


@pytest.mark.parametrize("use_cpu_kernels", [True, False])
def test_all_decode_batch_with_unequal_contexts_matches_dense(use_cpu_kernels):
    hf_model = tiny_hf_model("llama")
    model = pdserve_from_hf(hf_model, use_cpu_kernels=use_cpu_kernels)
    lengths = {"a": 5, "b": 33, "c": 17}
    tokens = {s: torch.arange(n) % TINY_VOCAB_SIZE for s, n in lengths.items()}
    block_tables = {"a": [7], "b": [1, 5, 3], "c": [2, 6]}
    # Prefill all but the last token together, then decode the last tokens as one batch.
    steps = [{s: n - 1 for s, n in lengths.items()}, dict.fromkeys(lengths, 1)]
    paged = _run_paged(model, tokens, steps, block_tables, num_blocks=8)
    with torch.no_grad():
        for s, ids in tokens.items():
            torch.testing.assert_close(
                paged[s], hf_model(ids[None]).logits[0], atol=2e-4, rtol=1e-4
            )


def test_bfloat16_forward_tracks_float32():
    hf_model = tiny_hf_model("llama")
    model32 = pdserve_from_hf(hf_model)
    model16 = pdserve_from_hf(hf_model, torch.bfloat16)
    ids = torch.randint(0, TINY_VOCAB_SIZE, (50,), generator=torch.Generator().manual_seed(3))
    logits = []
    for model in (model32, model16):
        cache = allocate_kv_cache(model.config, 4, BLOCK_SIZE, model.dtype, "cpu")
        meta = AttentionMetadata.build([([0, 1, 2, 3], 0, 50)], BLOCK_SIZE, "cpu")
        logits.append(model.compute_logits(model(ids, torch.arange(50), cache, meta)))
    assert logits[1].dtype == torch.float32
    assert (logits[1] - logits[0]).abs().max() < 0.05 * logits[0].abs().max()


def _prefill_then_batched_decode(
    model, before_step: Callable[[int], None] = lambda index: None
) -> dict[str, torch.Tensor]:
    """Three sequences prefilled together (step 0), then three decode steps of all three."""
    generator = torch.Generator().manual_seed(5)
    tokens = {
        s: torch.randint(0, TINY_VOCAB_SIZE, (n,), generator=generator)
        for s, n in {"a": 30, "b": 21, "c": 9}.items()
    }
    block_tables = {"a": [1, 2], "b": [3, 4], "c": [5]}
    steps = [{"a": 27, "b": 18, "c": 6}] + [dict.fromkeys(tokens, 1)] * 3
    return _run_paged(model, tokens, steps, block_tables, num_blocks=6, before_step=before_step)


def test_cpu_kernels_track_torch_ops_in_bfloat16():
    """Prefill then batched decode in bfloat16: the fused CPU kernels (streaming linears,
    norms, rotary, decode attention) against plain torch ops on the same weights."""
    hf_model = tiny_hf_model("qwen2", seed=7)
    logits = [
        _prefill_then_batched_decode(
            pdserve_from_hf(hf_model, torch.bfloat16, use_cpu_kernels=kernels)
        )
        for kernels in (True, False)
    ]
    for s in logits[0]:
        scale = logits[1][s].abs().max()
        assert (logits[0][s] - logits[1][s]).abs().max() < 0.03 * scale, s


@pytest.mark.parametrize("cpu_isa", kernel_variants())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", [Quantization.NONE, Quantization.INT8])
def test_one_call_decode_step_equals_the_per_op_path(cpu_isa, dtype, quantization):
    """A batch of single-token sequences runs the whole stack in one native call; it computes
    exactly what the per-op kernel path does."""
    hf_model = tiny_hf_model("qwen2", seed=7)
    logits = []
    for fused in (True, False):
        model = pdserve_from_hf(hf_model, dtype, cpu_isa=cpu_isa, quantization=quantization)
        assert model.fused_decoder is not None and model.fused_decoder_max_rows >= 3
        if not fused:
            model.fused_decoder = None
        logits.append(_prefill_then_batched_decode(model))
    for s in logits[0]:
        torch.testing.assert_close(logits[0][s], logits[1][s], atol=0, rtol=0)


@pytest.mark.parametrize("cpu_isa", kernel_variants())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_up_drops_its_onednn_copy_where_the_fused_silu_pass_takes_every_row_count(
    cpu_isa, dtype
):
    """Where AMX tiles run bfloat16 [gate; up] with SiLU at every row count past the kernels'
    own (`linear_silu_mul`), the oneDNN copy of those weights, as large as they are, is
    dropped; elsewhere it packs as the layer's other dense linears do."""
    model = pdserve_from_hf(tiny_hf_model("qwen2", seed=7), dtype, cpu_isa=cpu_isa)
    is_fused = dtype == torch.bfloat16 and bool(model.cpu_ops._lib.linear_has_amx())
    for layer in model.layers:
        gate_up, o_proj = layer.gate_up_proj, layer.o_proj
        if is_fused:
            assert gate_up.onednn_weight is None and gate_up.kernel_max_rows is None
            assert o_proj.onednn_weight is not None
        else:
            assert (gate_up.onednn_weight is None) == (o_proj.onednn_weight is None)
            assert gate_up.kernel_max_rows == o_proj.kernel_max_rows


@pytest.mark.parametrize("cpu_isa", kernel_variants())
def test_one_call_decode_step_covers_the_default_max_num_seqs(cpu_isa):
    """Decode batches up to `max_num_seqs` (64 by default) run in one call, not op by op
    (2x slower at 48-64 sequences on Sapphire Rapids)."""
    model = pdserve_from_hf(tiny_hf_model("qwen2", seed=7), torch.float32, cpu_isa=cpu_isa)
    assert model.fused_decoder_max_rows >= SchedulerConfig().max_num_seqs


@pytest.mark.parametrize("cpu_isa", kernel_variants())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_decode_step_does_not_depend_on_the_thread_count(cpu_isa, dtype):
    """Threads split the step's outputs, never a sum: decoded on 2, 3 and 5 threads (more
    than the 3 sequences, so some have no attention rows), the steps equal one thread's. The
    prefill runs on one thread each time: oneDNN's GEMMs may sum in another order on more."""
    model = pdserve_from_hf(tiny_hf_model("qwen2", seed=7), dtype, cpu_isa=cpu_isa)
    previous = torch.get_num_threads()
    logits = {}
    try:
        for threads in (1, 2, 3, 5):
            logits[threads] = _prefill_then_batched_decode(
                model, lambda index, n=threads: torch.set_num_threads(1 if index == 0 else n)
            )
    finally:
        torch.set_num_threads(previous)
    for threads in (2, 3, 5):
        for s in logits[1]:
            torch.testing.assert_close(logits[threads][s], logits[1][s], atol=0, rtol=0)


def test_metadata_slots_follow_block_tables():
    meta = AttentionMetadata.build([([3, 1], 6, 4), ([2], 5, 1)], 8, "cpu")
    # Positions 6..9 of the first sequence: block 3 offsets 6,7 then block 1 offsets 0,1.
    assert meta.slot_mapping.tolist() == [30, 31, 8, 9, 21]
    assert meta.slot_mapping.dtype == torch.int64
    assert (meta.num_tokens, meta.max_block_id) == (5, 3)
    assert not meta.is_all_decode
    (chunk,) = meta.prefills
    assert (chunk.rows, chunk.num_computed_tokens, chunk.seq_len) == (slice(0, 4), 6, 10)
    assert chunk.block_table.tolist() == [3, 1]
    assert meta.decode.token_index == slice(4, 5)
    assert meta.decode.block_tables.tolist() == [[2]]
    assert meta.decode.seq_lens.tolist() == [6]


def test_decode_batches_pad_their_tables_and_index_scattered_rows():
    meta = AttentionMetadata.build(
        [([4], 2, 1), ([7, 8, 9], 3, 3), ([5, 6, 2], 16, 1), ([1], 0, 1)], 8, "cpu"
    )
    # The decodes sit at rows 0, 4 and 5 (the prefill chunk holds rows 1..3).
    assert meta.slot_mapping.tolist() == [34, 59, 60, 61, 16, 8]
    assert meta.decode.token_index.tolist() == [0, 4, 5]
    assert meta.decode.block_tables.tolist() == [[4, 0, 0], [5, 6, 2], [1, 0, 0]]
    assert meta.decode.seq_lens.tolist() == [3, 17, 1]
    assert meta.decode.max_len == 17
    assert meta.max_block_id == 7


def test_block_ids_outside_the_cache_are_rejected():
    model = pdserve_from_hf(tiny_hf_model("llama"))
    cache = allocate_kv_cache(model.config, 2, BLOCK_SIZE, torch.float32, "cpu")
    meta = AttentionMetadata.build([([5], 0, 3)], BLOCK_SIZE, "cpu")
    with pytest.raises(ValueError, match="block id 5 is outside the KV cache"):
        model(torch.tensor([1, 2, 3]), torch.arange(3), cache, meta)


def test_metadata_rejects_block_table_too_short():
    with pytest.raises(ValueError, match="cannot hold 17 tokens"):
        AttentionMetadata.build([([0], 16, 1)], 16, "cpu")


def test_kv_cache_shape_and_bytes_per_token():
    config = pdserve_from_hf(tiny_hf_model("llama")).config
    cache = allocate_kv_cache(config, 5, 16, torch.bfloat16, "cpu")
    assert cache.shape == (2, 2, 5, 16, 2, 16)
    # 2 layers x (K, V) x 2 KV heads x 16 dims x 2 bytes
    assert kv_bytes_per_token(config, torch.bfloat16) == 2 * 2 * 2 * 16 * 2
    assert kv_bytes_per_token(config, torch.bfloat16) * 5 * 16 == cache.numel() * 2
