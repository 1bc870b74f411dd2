"""A layout family, sized to any number of GPUs: what `plan` searches over and scales."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.config import Mode
from pdserve.sim.config import SimConfig


@dataclass(frozen=True)
class Layout:
    """Colocated/chunked: workers of `tp` devices (chunked with `budget` tokens per step).
    Disagg: `prefill_fraction` of the devices in prefill workers of `prefill_tp`, the rest in
    decode workers of `tp`; prompts with fewer than `local_prefill_threshold` uncached
    tokens prefill on the decode worker, in chunks of `decode_budget` (default: `budget`)."""

    mode: Mode
    tp: int
    budget: int | None = None
    prefill_tp: int | None = None
    prefill_fraction: float | None = None
    local_prefill_threshold: int = 0
    decode_budget: int | None = None

    def split(self, num_gpus: int) -> tuple[int, int] | None:
        """(prefill workers, decode workers) on `num_gpus`, or None if it does not divide."""
        num_prefill = max(1, round(self.prefill_fraction * num_gpus / self.prefill_tp))
        num_decode_gpus = num_gpus - num_prefill * self.prefill_tp
        if num_decode_gpus < self.tp or num_decode_gpus % self.tp:
            return None
        return num_prefill, num_decode_gpus // self.tp

    def label(self, num_gpus: int) -> str:
        if self.mode is Mode.DISAGG:
            split = self.split(num_gpus)
            if split is None:
                return f"disagg {self.prefill_fraction:.0%} prefill (does not fit {num_gpus})"
            text = f"disagg {split[0]}×TP{self.prefill_tp} : {split[1]}×TP{self.tp}"
            if self.local_prefill_threshold:
                text += f", local < {self.local_prefill_threshold}"
            if self.decode_budget is not None:
                text += f", decode budget {self.decode_budget}"
            return text
        text = f"{self.mode.value} {num_gpus // self.tp}×TP{self.tp}"
        return text + (f", budget {self.budget}" if self.mode is Mode.CHUNKED else "")

    def config(self, deployment, num_gpus: int, **overrides) -> SimConfig | None:
        """The deployment (`options.Deployment`) on `num_gpus`, with SimConfig `overrides`;
        None if it does not fit."""
        if self.mode is not Mode.DISAGG:
            if num_gpus % self.tp:
                return None
            return deployment.config(
                self.mode,
                tp=self.tp,
                num_workers=num_gpus // self.tp,
                budget=self.budget,
                **overrides,
            )
        split = self.split(num_gpus)
        if split is None:
            return None
        return deployment.config(
            Mode.DISAGG,
            budget=self.budget,
            prefill=(split[0], self.prefill_tp),
            decode=(split[1], self.tp),
            decode_budget=self.decode_budget,
            local_prefill_threshold=self.local_prefill_threshold,
            **overrides,
        )

    @property
    def granularity(self) -> int:
        """The smallest step in GPUs between sizes of this family."""
        return self.tp if self.mode is not Mode.DISAGG else max(self.tp, self.prefill_tp)
