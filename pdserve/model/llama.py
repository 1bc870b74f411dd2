"""The Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) on a paged KV cache.

One `forward` runs a flat batch of T tokens from many sequences: prefill chunks of any length
and single decode tokens mixed. Q/K/V and gate/up projections are fused into single linears
(weights [out, in]); the per-layer loop is a handful of large ops so Python overhead stays far
below the time spent streaming weights.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from pdserve.model.config import ModelConfig, Quantization
from pdserve.model.cpu_runtime import huge_page_buffer, release_free_heap
from pdserve.model.kernels.cpu_ops import (
    MAX_HEAD_DIM,
    CpuOps,
    DecoderLayerWeights,
    FusedDecoder,
    load_cpu_ops,
)
from pdserve.model.layers import Linear, RMSNorm, RotaryEmbedding, SiluAndMul
from pdserve.model.quant import QuantizedWeight

logger = logging.getLogger(__name__)
# Batches up to this many sequences decode in one native call when the kernels cover them.
FUSED_DECODE_MAX_ROWS = 256


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device, ops: CpuOps | None
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device, ops)
        # Rows [q; k; v] and [gate; up] of the fused projections.
        self.qkv_proj = Linear(
            hidden, config.q_size + 2 * config.kv_size, config.attention_bias, dtype, device, ops
        )
        self.o_proj = Linear(config.q_size, hidden, False, dtype, device, ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device, ops)
        self.gate_up_proj = Linear(hidden, 2 * config.intermediate_size, False, dtype, device, ops)
        self.act = SiluAndMul(ops)
        self.down_proj = Linear(config.intermediate_size, hidden, False, dtype, device, ops)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        angles: tuple[torch.Tensor, torch.Tensor],
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        attention: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] (the previous layer's output), residual [T, H] (the stream before
        it, None at the first layer) -> the same pair for the next layer."""
        x, residual = self.input_layernorm(hidden, residual)
        qkv = self.qkv_proj(x)
        num_tokens = qkv.shape[0]
        # q and k are adjacent in the fused output: rotate them together.
        qk = rotary.rotate(qkv, self.num_heads + self.num_kv_heads, angles)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        attn = attention.forward(
            qk[:, : self.num_heads], qk[:, self.num_heads :], v, kv_layer, meta
        )
        x, residual = self.post_attention_layernorm(self.o_proj(attn), residual)
        return self.down_proj(self._silu_mul_gate_up(x)), residual

    def _silu_mul_gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of x's [gate; up] projection, in one kernel pass where its weights'
        format has one (`CpuOps.fuses_silu_mul`): the [T, 2 * intermediate] product then never
        reaches memory."""
        proj = self.gate_up_proj
        if proj.kernel_weight is not None and proj.ops.fuses_silu_mul(
            proj.kernel_weight, x.shape[0], x.dtype
        ):
            return proj.ops.linear_silu_mul(x, proj.kernel_weight)
        return self.act(proj(x))


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM. Weights are created empty; fill them with `load_weights`.

    Call `pack()` after loading (the loader does) to put the linears in their kernels' layout.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        attention: AttentionBackend | None = None,
        use_cpu_kernels: bool = True,
        cpu_isa: str | None = None,
        quantization: Quantization = Quantization.NONE,
    ) -> None:
        """`use_cpu_kernels`: on CPU, run linears, norms, rotary, SiLU and decode attention
        in the fused native kernels where they can be built (else plain torch ops), compiled
        for `cpu_isa` (default: `PDSERVE_CPU_ISA`, else the best variant this CPU runs).
        `quantization`: how `pack()` stores the linear weights (GGUF blocks come from
        `load_weights`)."""
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.quantization = quantization
        self.cpu_ops = (
            load_cpu_ops(cpu_isa)
            if (use_cpu_kernels and device.type == "cpu" and CpuOps.supports(dtype))
            else None
        )
        ops = self.cpu_ops
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype, device, ops) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, ops)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device, ops)
        self.rotary = RotaryEmbedding(config, dtype, device, ops)
        self.attention = attention or TorchAttentionBackend(config.head_dim**-0.5, ops)
        # Set by `pack()`: the whole decode step in one native call, for batches of single-token
        # sequences up to `fused_decoder_max_rows`.
        self.fused_decoder: FusedDecoder | None = None
        self.fused_decoder_max_rows = 0

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden_size].

        kv_cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] receives the
        new tokens' K/V at `attn_metadata.slot_mapping`.
        """
        hidden = F.embedding(input_ids, self.embed_tokens)
        angles = self.rotary.angles(positions)
        decode = attn_metadata.decode
        if (
            self.fused_decoder is not None
            and attn_metadata.is_all_decode
            and decode.num_seqs <= self.fused_decoder_max_rows
            and hidden.device.type == "cpu"
        ):
            if attn_metadata.max_block_id >= kv_cache.shape[2]:
                raise ValueError(
                    f"block id {attn_metadata.max_block_id} is outside the KV cache "
                    f"({kv_cache.shape[2]} blocks)"
                )
            return self.fused_decoder(
                hidden,
                *angles,
                kv_cache,
                attn_metadata.slot_mapping,
                decode.block_tables,
                decode.seq_lens,
            )
        residual = None
        for layer, kv_layer in zip(self.layers, kv_cache, strict=True):
            hidden, residual = layer(
                hidden, residual, self.rotary, angles, kv_layer, attn_metadata, self.attention
            )
        return self.norm(hidden, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (only the rows that sample) -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def pack(self) -> None:
        """Put every linear weight in the fastest layout for this device (see `Linear`), and
        set up the one-call decode step where the CPU kernels cover every layer."""
        if self.quantization is not Quantization.NONE and self.cpu_ops is None:
            logger.warning(
                "--quantization %s needs the CPU kernels; weights run dequantized to %s here",
                self.quantization.value,
                self.dtype,
            )
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(self.quantization)
        self._gather_kernel_weights()
        for layer in self.layers:
            proj = layer.gate_up_proj
            if proj.kernel_weight is not None and proj.ops.fuses_silu_mul(
                proj.kernel_weight, proj.kernel_max_rows or 1, self.dtype
            ):
                # linear_silu_mul takes every row count the oneDNN copy would: drop it.
                proj.kernel_max_rows = proj.onednn_weight = None
        self.fused_decoder, self.fused_decoder_max_rows = self._build_fused_decoder()

    def _gather_kernel_weights(self) -> None:
        """Move every packed weight into one mapping of 2 MiB pages (`huge_page_buffer`), one
        after the other, each freed as soon as copied and the heap then trimmed."""
        linears = [
            m for m in self.modules() if isinstance(m, Linear) and m.kernel_weight is not None
        ]
        if not linears:
            return
        sizes = [-(-linear.kernel_weight.nbytes // 64) * 64 for linear in linears]
        arena, offset = huge_page_buffer(sum(sizes)), 0
        for linear, size in zip(linears, sizes, strict=True):
            weight = linear.kernel_weight
            data = arena[offset : offset + weight.nbytes].view(weight.data.dtype)
            linear.kernel_weight = replace(weight, data=data.view(weight.data.shape))
            linear.kernel_weight.data.copy_(weight.data)
            offset += size
        release_free_heap()

    def decoder_linears(self) -> list[Linear]:
        """Every decoder layer's linears (what prefill steps run; not the LM head)."""
        return [
            linear
            for layer in self.layers
            for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        ]

    def _build_fused_decoder(self) -> tuple[FusedDecoder | None, int]:
        """The native decode step and the batch size up to which it runs (that of the
        linears' kernels), or (None, 0) where some piece has no kernel."""
        config, ops = self.config, self.cpu_ops
        linears = self.decoder_linears()
        if (
            ops is None
            or type(self.attention) is not TorchAttentionBackend
            or config.head_dim % 16
            or config.head_dim > MAX_HEAD_DIM
            or any(linear.kernel_weight is None for linear in linears)
        ):
            return None, 0
        max_rows = min(
            (linear.kernel_max_rows for linear in linears if linear.kernel_max_rows is not None),
            default=FUSED_DECODE_MAX_ROWS,
        )
        layers = [
            DecoderLayerWeights(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                layer.qkv_proj.kernel_weight,
                layer.qkv_proj.bias,
                layer.o_proj.kernel_weight,
                layer.gate_up_proj.kernel_weight,
                layer.down_proj.kernel_weight,
            )
            for layer in self.layers
        ]
        decoder = ops.fused_decoder(
            layers,
            self.norm.weight,
            intermediate=config.intermediate_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            eps=config.rms_norm_eps,
            scale=self.attention.scale,
        )
        return decoder, min(max_rows, FUSED_DECODE_MAX_ROWS)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of weights a decode step reads: every linear in its stored format, plus the
        norms (one embedding row per token is negligible)."""
        linears = sum(m.weight_nbytes for m in self.modules() if isinstance(m, Linear))
        norms = sum(
            m.weight.numel() * m.weight.element_size()
            for m in self.modules()
            if isinstance(m, RMSNorm)
        )
        return linears + norms

    @torch.inference_mode()
    def load_weights(self, weights: Mapping[str, torch.Tensor | QuantizedWeight]) -> None:
        """Copy Hugging Face-named tensors (see `hf_weight_shapes`) into the fused layout.
        Linear weights may be `QuantizedWeight`s (GGUF blocks, kept as they are).

        Shapes must already be checked; `lm_head.weight` may be absent when tied.
        """
        embed = weights["model.embed_tokens.weight"]
        self.embed_tokens.copy_(_dense(embed))
        self.norm.weight.copy_(weights["model.norm.weight"])
        self.lm_head.load(weights.get("lm_head.weight", embed))
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            attn, mlp = prefix + "self_attn.", prefix + "mlp."
            layer.input_layernorm.weight.copy_(weights[prefix + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(
                weights[prefix + "post_attention_layernorm.weight"]
            )
            layer.qkv_proj.load(_fused([weights[f"{attn}{p}_proj.weight"] for p in "qkv"]))
            if layer.qkv_proj.bias is not None:
                layer.qkv_proj.bias.copy_(
                    torch.cat([weights[f"{attn}{p}_proj.bias"] for p in "qkv"])
                )
            layer.o_proj.load(weights[attn + "o_proj.weight"])
            layer.gate_up_proj.load(
                _fused([weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"]])
            )
            layer.down_proj.load(weights[mlp + "down_proj.weight"])


def _dense(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight


def _fused(parts: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """The parts' rows stacked: as blocks when all are blocks of one type, else as floats."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        fused = QuantizedWeight.concat(parts)
        if fused is not None:
            return fused
    return torch.cat([_dense(p) for p in parts])


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this config holds, with its shape.

    `lm_head.weight` is listed only for untied models.
    """
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        shapes |= {
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "self_attn.q_proj.weight": (config.q_size, hidden),
            prefix + "self_attn.k_proj.weight": (config.kv_size, hidden),
            prefix + "self_attn.v_proj.weight": (config.kv_size, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, config.q_size),
            prefix + "mlp.gate_proj.weight": (inter, hidden),
            prefix + "mlp.up_proj.weight": (inter, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inter),
        }
        if config.attention_bias:
            shapes |= {
                prefix + "self_attn.q_proj.bias": (config.q_size,),
                prefix + "self_attn.k_proj.bias": (config.kv_size,),
                prefix + "self_attn.v_proj.bias": (config.kv_size,),
            }
    return shapes
