"""What a Mixture-of-Experts model's routing did in one optimizer step, as the engine reports it (StepStats.moe).

The engine gathers these with the step's one reduction over all ranks (no collective of their own), so every
rank holds the same figures for the whole global batch. The summaries here are what a user watches (the progress
line, metrics.jsonl, W&B): how unevenly the router spreads tokens, what capacity dropped, which experts starve.
"""

from __future__ import annotations

from dataclasses import dataclass

IDLE_WARN_STEPS = 10  # consecutive steps without a token before an expert is reported idle


@dataclass
class MoEStepStats:
    """One optimizer step's routing over the global batch (the same on every rank)."""

    tokens_per_expert: list[list[float]]  # [MoE layer][expert]: (token, slot) assignments routed to it
    balance_loss: float  # the load-balancing loss, mean over layers and micro-batches (before its coefficient)
    z_loss: float  # the router z-loss, mean over layers and micro-batches (before its coefficient)
    dropped: float  # assignments dropped for capacity, summed over layers (0 when dropless)

    def layers(self) -> list[LayerLoad]:
        """Each MoE layer's spread of tokens over its experts, in layer order."""
        return [LayerLoad.of(tokens) for tokens in self.tokens_per_expert]

    def worst_layer(self) -> int:
        """The layer whose busiest expert is furthest above its mean: it sets the step's pace under expert
        parallelism (every rank waits for the one holding that expert) and is where capacity drops first."""
        loads = self.layers()
        return max(range(len(loads)), key=lambda i: loads[i].imbalance)

    def dropped_fraction(self) -> float:
        """Dropped over all routed assignments (every layer; `tokens_per_expert` counts them before capacity
        drops any): the share of expert work capacity threw away."""
        total = sum(sum(tokens) for tokens in self.tokens_per_expert)
        return self.dropped / total if total > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        """The `moe/*` metrics of a step (metrics.jsonl and W&B)."""
        loads = self.layers()
        out = {
            "moe/balance_loss": self.balance_loss,
            "moe/z_loss": self.z_loss,
            "moe/dropped_fraction": self.dropped_fraction(),
            "moe/imbalance_max": max(load.imbalance for load in loads),
            "moe/idle_experts": sum(len(load.idle) for load in loads),
        }
        for i, load in enumerate(loads):
            out.update(
                {
                    f"moe/layer{i}/tokens_min": load.tokens_min,
                    f"moe/layer{i}/tokens_max": load.tokens_max,
                    f"moe/layer{i}/imbalance": load.imbalance,
                }
            )
        return out


@dataclass(frozen=True)
class LayerLoad:
    """One MoE layer's tokens per expert, summarised."""

    tokens_min: float
    tokens_max: float
    tokens_mean: float
    idle: tuple[int, ...]  # experts that received no token

    @classmethod
    def of(cls, tokens: list[float]) -> LayerLoad:
        return cls(
            tokens_min=min(tokens),
            tokens_max=max(tokens),
            tokens_mean=sum(tokens) / len(tokens),
            idle=tuple(e for e, n in enumerate(tokens) if n == 0),
        )

    @property
    def imbalance(self) -> float:
        """Max over mean: 1.0 is a perfect balance, n_experts is every token on one expert. A layer that routed
        nothing counts as balanced (nothing waits on it)."""
        return self.tokens_max / self.tokens_mean if self.tokens_mean > 0 else 1.0


class IdleExperts:
    """Experts that received no token for `steps` consecutive steps. A starved expert's router weights stop
    learning and it rarely recovers by itself, but one step without tokens is routine noise, so each is reported
    once, when its idle run reaches `steps`, and again only after it has received tokens and starved anew."""

    def __init__(self, steps: int = IDLE_WARN_STEPS) -> None:
        self.steps = steps
        self._idle_for: dict[tuple[int, int], int] = {}  # (layer, expert) -> consecutive idle steps

    def update(self, stats: MoEStepStats) -> dict[int, list[int]]:
        """This step's newly reported experts, per layer ({} most steps)."""
        idle_for: dict[tuple[int, int], int] = {}
        reached: dict[int, list[int]] = {}
        for layer, load in enumerate(stats.layers()):
            for expert in load.idle:
                n = idle_for[layer, expert] = self._idle_for.get((layer, expert), 0) + 1
                if n == self.steps:
                    reached.setdefault(layer, []).append(expert)
        self._idle_for = idle_for  # an expert that received tokens starts again from 0
        return reached
