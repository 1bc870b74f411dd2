"""Physical cost of one engine step on one tensor-parallel group, and of moving KV caches.

Step time = linear layers (roofline, or a measured curve) + attention (per-sequence roofline)
+ TP all-reduces + overhead. All FLOP and byte counts are per device: a TP group of `tp`
devices splits the weights, the heads and the KV cache `tp` ways (KV heads are replicated once
tp exceeds them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pdserve.sim.efficiency import Efficiency, default_efficiency
from pdserve.sim.errors import SimConfigError
from pdserve.sim.hardware import Hardware
from pdserve.sim.linear_curve import seconds_per_param
from pdserve.sim.model_spec import ModelSpec, dtype_bytes
from pdserve.sim.network import NETWORKS, Interconnect

ACTIVATION_DTYPE = "bf16"


class SeqWork(NamedTuple):
    """One sequence's share of a step: `num_new_tokens` computed on top of
    `num_context_tokens` already in the KV cache; `is_sampling` if it yields a token.
    (A tuple: the simulator builds one per sequence per step.)"""

    num_new_tokens: int
    num_context_tokens: int
    is_sampling: bool = True


@dataclass(frozen=True)
class StepWork:
    """What one step asks of a device, before any efficiency: FLOPs and bytes per component
    (attention per sequence), for calibration to weigh against measured times."""

    linear: tuple[float, float]
    lm_head: tuple[float, float]
    attention: tuple[tuple[float, float], ...]
    num_seqs: int


@dataclass(frozen=True)
class StepCost:
    """Seconds of one step, by where they go."""

    linear_s: float
    attention_s: float
    communication_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return self.linear_s + self.attention_s + self.communication_s + self.overhead_s

    def scaled(self, factor: float) -> StepCost:
        return StepCost(
            self.linear_s * factor,
            self.attention_s * factor,
            self.communication_s * factor,
            self.overhead_s * factor,
        )


def overlap(compute_s, memory_s, sharpness: float | None = None):
    """Seconds of a kernel that needs `compute_s` at its FLOP rate and `memory_s` at its
    bandwidth (floats or numpy arrays): the larger, or with a `sharpness` p their p-norm
    (`Efficiency.roofline_sharpness`)."""
    if sharpness is None:
        return np.maximum(compute_s, memory_s)
    return (compute_s**sharpness + memory_s**sharpness) ** (1 / sharpness)


def roofline(
    flops: float,
    num_bytes: float,
    flops_per_s: float,
    bytes_per_s: float,
    sharpness: float | None = None,
) -> float:
    """Seconds for a kernel bounded by whichever of compute and memory traffic is slower."""
    if sharpness is None:
        return max(flops / flops_per_s, num_bytes / bytes_per_s)
    return float(overlap(flops / flops_per_s, num_bytes / bytes_per_s, sharpness))


def ring_all_reduce_s(num_bytes: float, tp: int, bandwidth: float, latency_s: float) -> float:
    """A ring all-reduce: each device sends and receives 2(tp-1)/tp of the buffer."""
    if tp == 1:
        return 0.0
    return 2 * (tp - 1) / tp * num_bytes / bandwidth + latency_s


class CostModel:
    """Step and transfer times for `model` on a TP group of `tp` `hardware` devices."""

    def __init__(
        self,
        model: ModelSpec,
        hardware: Hardware,
        tp: int = 1,
        *,
        dtype: str = "bf16",
        kv_dtype: str = "bf16",
        efficiency: Efficiency | None = None,
        inter_node_link: Interconnect | None = None,
    ) -> None:
        if tp < 1:
            raise SimConfigError(f"--tp must be >= 1, got {tp}")
        if tp > hardware.devices_per_node and inter_node_link is None:
            raise SimConfigError(
                f"--tp {tp} spans nodes of {hardware.devices_per_node} "
                f"{hardware.name}; give --network for the link between them"
            )
        self.model = model
        self.hardware = hardware
        self.tp = tp
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.efficiency = efficiency or default_efficiency(hardware.name)
        within_node = tp <= hardware.devices_per_node
        self.tp_link = NETWORKS[hardware.intra_node_link] if within_node else inter_node_link
        self._init_constants()

    def with_efficiency(self, efficiency: Efficiency) -> CostModel:
        """The same deployment at other efficiencies."""
        return CostModel(
            self.model,
            self.hardware,
            self.tp,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            efficiency=efficiency,
            inter_node_link=self.tp_link,
        )

    def _init_constants(self) -> None:
        # Everything below is per device and fixed for the deployment; step_cost only sums.
        m, eff, tp = self.model, self.efficiency, self.tp
        self.peak_linear_flops = self.hardware.peak_flops(self.dtype)
        # Attention runs in bf16 whatever the weights' dtype.
        self.peak_attention_flops = self.hardware.peak_flops("bf16")
        self._flops_per_s = self.peak_linear_flops * eff.linear_share(self.dtype)
        self._attn_flops_per_s = self.peak_attention_flops * eff.attention_compute
        self._bytes_per_s = self.hardware.memory_bandwidth * eff.memory
        self._weight_bytes = dtype_bytes(self.dtype)
        # Parameters of the decoder layers' linears and of the LM head, per device.
        self.layer_params = m.num_layers * m.linear_params_per_layer / tp
        self.head_params = m.lm_head_params / tp
        # Q·K and P·V: 2 matmuls × 2 FLOPs per multiply-add, per query-key pair.
        self._attn_flops_per_pair = 4 * m.num_layers * m.q_size / tp
        self._kv_bytes_per_token_device = self.kv_bytes_per_token * self.kv_shard_fraction
        # Query heads per KV head on a device: what an attention kernel that reads its KV
        # once per query head multiplies its reads by at most (`kv_read_amplification`).
        self.kv_group = m.num_attention_heads / tp / (m.num_kv_heads * self.kv_shard_fraction)
        self._kv_reads = min(eff.kv_read_amplification, self.kv_group)
        self._all_reduce_bytes_per_token = m.hidden_size * dtype_bytes(ACTIVATION_DTYPE)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over the whole model (all layers, all KV heads)."""
        return self.model.kv_bytes_per_token(self.kv_dtype)

    @property
    def kv_shard_fraction(self) -> float:
        """Fraction of a token's KV each device holds (heads replicate past tp = KV heads)."""
        return max(1 / self.tp, 1 / self.model.num_kv_heads)

    def step_cost(self, batch: Sequence[SeqWork]) -> StepCost:
        """Seconds one forward pass over `batch` takes, by component."""
        num_tokens = sum(seq.num_new_tokens for seq in batch)
        num_sampled = sum(1 for seq in batch if seq.is_sampling)
        linear = self._linear_s(num_tokens, self.layer_params) + self._linear_s(
            num_sampled, self.head_params
        )
        attention = sum(
            roofline(
                *self._attention_work(seq),
                self._attn_flops_per_s,
                self._bytes_per_s,
                self.efficiency.roofline_sharpness,
            )
            for seq in batch
        )
        eff = self.efficiency
        overhead = (
            eff.step_overhead_s
            + eff.per_seq_overhead_s * len(batch)
            + self._layers_overhead_s(num_tokens)
        )
        cost = StepCost(linear, attention, self._all_reduces_s(num_tokens), overhead)
        return cost if eff.time_scale == 1 else cost.scaled(eff.time_scale)

    def step_time(self, batch: Sequence[SeqWork]) -> float:
        return self.step_cost(batch).total_s

    def step_work(self, batch: Sequence[SeqWork]) -> StepWork:
        """FLOPs and bytes per device of one step over `batch`, by component."""
        num_tokens = sum(seq.num_new_tokens for seq in batch)
        num_sampled = sum(1 for seq in batch if seq.is_sampling)
        return StepWork(
            self._linear_work(num_tokens, self.layer_params),
            self._linear_work(num_sampled, self.head_params),
            tuple(self._attention_work(seq) for seq in batch),
            len(batch),
        )

    def layers_linear_s(self, num_rows: int) -> float:
        """Seconds of the decoder layers' linears (all layers, no LM head) over `num_rows`,
        with each layer's fixed cost (what a kernel-level profile of them measures)."""
        return self._linear_s(num_rows, self.layer_params) + self._layers_overhead_s(num_rows)

    def _layers_overhead_s(self, num_tokens: int) -> float:
        return self.model.num_layers * self.efficiency.layer_overhead_s if num_tokens else 0.0

    def _linear_s(self, num_rows: int, num_params: float) -> float:
        """Seconds of linear layers holding `num_params` parameters (per device) over
        `num_rows` rows: the calibrated curve where there is one, else the roofline."""
        if num_rows == 0:
            return 0.0
        curve = self.efficiency.linear_curve
        if curve:
            return num_params * seconds_per_param(curve, num_rows)
        return roofline(
            *self._linear_work(num_rows, num_params),
            self._flops_per_s,
            self._bytes_per_s,
            self.efficiency.roofline_sharpness,
        )

    def _linear_work(self, num_rows: int, num_params: float) -> tuple[float, float]:
        """FLOPs and weight bytes of linears holding `num_params` over `num_rows` rows; none
        without rows (the LM head runs only for the rows that sample)."""
        if not num_rows:
            return 0.0, 0.0
        return 2 * num_rows * num_params, num_params * self._weight_bytes

    def _attention_work(self, seq: SeqWork) -> tuple[float, float]:
        flops, read, written = self.attention_traffic(seq)
        return flops, read * self._kv_reads + written

    def attention_traffic(self, seq: SeqWork) -> tuple[float, float, float]:
        """FLOPs of one sequence's attention, the KV bytes it reads once (every visible
        token's K and V) and those it writes (the new tokens')."""
        new, context = seq.num_new_tokens, seq.num_context_tokens
        # Causal: new token i sees the context plus new tokens 0..i.
        pairs = new * (context + (new + 1) / 2)
        kv = self._kv_bytes_per_token_device
        return pairs * self._attn_flops_per_pair, (context + new) * kv, new * kv

    def _all_reduces_s(self, num_tokens: int) -> float:
        if self.tp == 1 or num_tokens == 0:
            return 0.0
        link = self.tp_link
        one = ring_all_reduce_s(
            num_tokens * self._all_reduce_bytes_per_token,
            self.tp,
            link.achieved_bandwidth * self.efficiency.network,
            link.latency_s,
        )
        return 2 * self.model.num_layers * one

    def prefill_time(self, num_tokens: int, chunk_size: int | None = None) -> float:
        """Seconds to prefill a lone prompt, whole or in chunks of `chunk_size` tokens."""
        chunk = chunk_size or num_tokens
        total, done = 0.0, 0
        while done < num_tokens:
            new = min(chunk, num_tokens - done)
            total += self.step_time([SeqWork(new, done, done + new == num_tokens)])
            done += new
        return total

    def kv_transfer_time(
        self, num_tokens: int, link: Interconnect, num_devices: int | None = None
    ) -> float:
        """Seconds to move `num_tokens` tokens of KV over an otherwise idle `link` from a
        group of `num_devices` devices (default: this TP group)."""
        lanes_bw = link.transfer_bandwidth(num_devices or self.tp) * self.efficiency.network
        return link.latency_s + num_tokens * self.kv_bytes_per_token / lanes_bw

    def activation_reserve_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        """Rough peak activation memory per device: one layer's widest live tensors for a
        full token budget (residual, normed input, gate and up outputs) + fp32 logits."""
        m = self.model
        per_token = 2 * m.hidden_size + 2 * m.intermediate_size / self.tp
        act = max_num_batched_tokens * per_token * dtype_bytes(ACTIVATION_DTYPE)
        return act + max_num_seqs * m.vocab_size / self.tp * 4

    def kv_capacity_tokens(
        self, max_num_batched_tokens: int, max_num_seqs: int, memory_utilization: float = 0.9
    ) -> int:
        """Tokens of KV the group holds: device memory × utilization − weights − activations.

        Raises `SimConfigError` when the weights alone do not fit.
        """
        per_device = self.hardware.memory_capacity * memory_utilization
        weights = self.model.weight_bytes(self.dtype) / self.tp
        free = (
            per_device
            - weights
            - self.activation_reserve_bytes(max_num_batched_tokens, max_num_seqs)
        )
        if free <= 0:
            raise SimConfigError(
                f"{self.model.name} needs {weights / 1e9:.1f} GB of weights per device at "
                f"--tp {self.tp}; a {self.hardware.name} has "
                f"{self.hardware.memory_capacity / 1e9:.0f} GB: raise --tp"
            )
        return int(free / self._kv_bytes_per_token_device)
