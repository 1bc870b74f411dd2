import dataclasses
import random

import pytest

from pdserve.sim.cost_model import CostModel, SeqWork, ring_all_reduce_s
from pdserve.sim.efficiency import Efficiency
from pdserve.sim.errors import SimConfigError
from pdserve.sim.hardware import get_hardware
from pdserve.sim.model_spec import MODELS
from pdserve.sim.network import get_network

# Peak everything, no overhead: times are pure physics and easy to compute by hand.
IDEAL = Efficiency(
    linear_compute=1,
    attention_compute=1,
    memory=1,
    network=1,
    step_overhead_s=0,
    per_seq_overhead_s=0,
)
H100 = get_hardware("H100-SXM")
LLAMA_8B = MODELS["Llama-3.1-8B"]
LLAMA_70B = MODELS["Llama-3-70B"]


def ideal(model=LLAMA_8B, tp=1, **kwargs):
    return CostModel(model, H100, tp, efficiency=IDEAL, **kwargs)


def test_decode_is_weight_bandwidth_bound():
    cost = ideal().step_cost([SeqWork(1, 1000)])
    layers_bytes = 2 * 32 * 218_103_808  # bf16 q/k/v/o/gate/up/down of 32 layers
    head_bytes = 2 * 128256 * 4096
    assert cost.linear_s == pytest.approx((layers_bytes + head_bytes) / 3.35e12)
    # Attention reads 1000 tokens' KV and writes one token's K and V (read + write).
    assert cost.attention_s == pytest.approx(1002 * 131_072 / 3.35e12)
    assert cost.communication_s == 0


def test_prefill_is_compute_bound():
    cost = ideal().step_cost([SeqWork(4096, 0, is_sampling=False)])
    assert cost.linear_s == pytest.approx(2 * 4096 * 32 * 218_103_808 / 989e12)
    # 4096 × 4097 / 2 causal query-key pairs, 4 FLOPs each per (layer, q-dim).
    pairs = 4096 * 4097 / 2
    assert cost.attention_s == pytest.approx(4 * 32 * 4096 * pairs / 989e12)


def test_chunk_attends_to_its_context():
    model = ideal()
    first = model.step_cost([SeqWork(512, 0, False)]).attention_s
    later = model.step_cost([SeqWork(512, 8192, False)]).attention_s
    assert later / first == pytest.approx((8192 + 256.5) / 256.5)


def test_ring_all_reduce():
    assert ring_all_reduce_s(1e6, 8, 1e9, 0.0) == pytest.approx(1.75e-3)
    assert ring_all_reduce_s(1e6, 1, 1e9, 1.0) == 0


def test_tp_all_reduces_two_per_layer():
    cost = ideal(LLAMA_70B, tp=8).step_cost([SeqWork(1024, 0)])
    # NVLink 4 at its measured share of the line rate and latency (sim/network.py).
    link = get_network("nvlink-h100")
    one = 2 * 7 / 8 * 1024 * 8192 * 2 / (450e9 * link.efficiency) + link.latency_s
    assert cost.communication_s == pytest.approx(2 * 80 * one)
    # A slower link share (the network efficiency a calibration may carry) slows it.
    slower = dataclasses.replace(IDEAL, network=0.5)
    half = CostModel(LLAMA_70B, H100, 8, efficiency=slower).step_cost([SeqWork(1024, 0)])
    assert half.communication_s == pytest.approx(
        2 * 80 * (2 * (one - link.latency_s) + link.latency_s)
    )


def test_tp_across_nodes_needs_a_network():
    with pytest.raises(SimConfigError, match="--network"):
        ideal(LLAMA_70B, tp=16)
    model = ideal(LLAMA_70B, tp=16, inter_node_link=get_network("ib-400"))
    assert model.tp_link.name == "ib-400"
    # 8 KV heads over 16 devices: each device holds one head, i.e. 1/8 of the KV.
    assert model.kv_shard_fraction == 1 / 8


def test_kv_transfer_time_70b_28k_over_400gbps():
    link = get_network("ib-400")
    seconds = ideal(LLAMA_70B, tp=8).kv_transfer_time(28_000, link)
    # ~204 ms: the line rate at the link's (assumed) efficiency.
    assert seconds == pytest.approx(5e-6 + 28_000 * 327_680 / (50e9 * link.efficiency))
    eight_lanes = ideal(LLAMA_70B, tp=8).kv_transfer_time(28_000, get_network("ib-8x400"))
    assert eight_lanes == pytest.approx(5e-6 + 28_000 * 327_680 / (400e9 * link.efficiency))


def test_kv_capacity_is_memory_minus_weights():
    model = ideal()
    tokens = model.kv_capacity_tokens(2048, 256, memory_utilization=0.9)
    free = 72e9 - LLAMA_8B.weight_bytes() - model.activation_reserve_bytes(2048, 256)
    assert tokens == int(free / 131_072)
    with pytest.raises(SimConfigError, match="raise --tp"):
        ideal(LLAMA_70B, tp=1).kv_capacity_tokens(2048, 256)


def test_efficiency_and_overhead_slow_steps_down():
    batch = [SeqWork(1, 500)] * 32
    fast = ideal().step_time(batch)
    slow = CostModel(LLAMA_8B, H100, efficiency=Efficiency()).step_time(batch)
    assert slow > fast + Efficiency().step_overhead_s


def test_prefill_time_in_chunks_costs_more_attention_passes():
    model = ideal()
    whole = model.prefill_time(8192)
    chunked = model.prefill_time(8192, chunk_size=1024)
    # Same FLOPs either way, but each chunk re-reads the weights (and the KV so far).
    assert chunked >= whole
    assert chunked == pytest.approx(whole, rel=0.05)


def test_measured_linear_curve_replaces_the_roofline():
    curve = ((1, 1e-11), (8, 2e-11), (16, 8e-11))
    model = CostModel(LLAMA_8B, H100, efficiency=dataclasses.replace(IDEAL, linear_curve=curve))
    params = 32 * 218_103_808 + 128256 * 4096

    def linear_s(num_rows):
        return model.step_cost([SeqWork(1, 0)] * num_rows).linear_s

    assert linear_s(8) == pytest.approx(params * 2e-11)  # on a knot
    assert linear_s(12) == pytest.approx(params * 5e-11)  # halfway between knots
    assert linear_s(32) == pytest.approx(params * 16e-11)  # past the last: ∝ rows
    # A prompt samples one row: the LM head is read at one row, the layers at 16.
    prefill = model.step_cost([SeqWork(16, 0)]).linear_s
    assert prefill == pytest.approx(32 * 218_103_808 * 8e-11 + 128256 * 4096 * 1e-11)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("linear_compute", 0.0, r"\(0, 1\]"),
        ("memory", 1.5, r"\(0, 1\]"),
        ("step_overhead_s", -1e-3, ">= 0"),
    ],
)
def test_efficiency_factors_are_validated(field, value, message):
    with pytest.raises(SimConfigError, match=message):
        Efficiency(**{field: value})


def test_linear_curve_must_be_increasing_and_positive(tmp_path):
    with pytest.raises(SimConfigError, match="increasing"):
        Efficiency(linear_curve=((4, 1e-11), (2, 1e-11)))
    with pytest.raises(SimConfigError, match="positive"):
        Efficiency(linear_curve=((1, 0.0),))
    saved = Efficiency(linear_curve=((1, 1e-11), (4, 3e-11)))
    saved.save(tmp_path / "cal.json")
    assert Efficiency.load(tmp_path / "cal.json") == saved


def test_jitter_draws_follow_the_quantiles_and_average_out_over_long_steps():
    jitter = Efficiency(step_jitter=(0.5, 1.0, 2.0), jitter_step_s=0.01)
    rng = random.Random(0)
    short = sorted(jitter.draw_jitter(rng, 0.01) for _ in range(2000))
    assert short[0] >= 0.5 and short[-1] <= 2.0
    assert short[1000] == pytest.approx(1.0, abs=0.05)
    assert short[1500] == pytest.approx(1.5, abs=0.05)  # 75%: halfway from 1.0 to 2.0
    # A step 100× as long: deviations shrink 10×.
    long = [jitter.draw_jitter(rng, 1.0) for _ in range(2000)]
    assert min(long) >= 0.95 and max(long) <= 1.1
    assert Efficiency().draw_jitter(rng, 0.01) == 1.0
    with pytest.raises(SimConfigError, match="ascending"):
        Efficiency(step_jitter=(1.2, 0.9), jitter_step_s=0.01)


def test_fp8_gemms_have_their_own_share_and_time_scale_stretches_every_step():
    prefill = [SeqWork(4096, 0, False)]
    fp8 = dataclasses.replace(IDEAL, fp8_linear_compute=0.5)
    bf16_s = CostModel(LLAMA_8B, H100, efficiency=fp8).step_cost(prefill).linear_s
    fp8_s = CostModel(LLAMA_8B, H100, dtype="fp8", efficiency=fp8).step_cost(prefill).linear_s
    # FP8's peak is twice bf16's (1,979 and 989 TFLOP/s): at half its share, as long.
    assert fp8_s == pytest.approx(bf16_s, rel=1e-3)
    slower = CostModel(LLAMA_8B, H100, efficiency=dataclasses.replace(IDEAL, time_scale=1.25))
    assert slower.step_time(prefill) == pytest.approx(1.25 * ideal().step_time(prefill))
    with pytest.raises(SimConfigError, match="fp8_linear_compute"):
        Efficiency(fp8_linear_compute=1.5)
