"""Allocation objectives: what the knapsack minimises, the loss of each slot at each tier.

`OBJECTIVES` is the one list: `--objective`'s choices, metavar and help, the settings' check and the allocator's
rules all read it. A new objective is a subclass with `losses` and one line in `OBJECTIVES`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

from tiers import Tier
from tqsdeploy.encoding.slots import Slot

LAZY_BITS = 16
"""Tiers of at least this many bits (float copies: bf16, fp16) are priced only when an allocation picks them."""

Loss = Callable[[Slot, Tier], float]


class PricingView(Protocol):
    """What an objective reads of the export to price a slot (`tqsdeploy.export.pricing.TierPricing`)."""

    gamma: Mapping[str, float]
    dead: set[str]
    steps: int

    def probe(self, tier: Tier) -> str: ...

    def price_key(self, slot: Slot, tier: Tier) -> str: ...

    def weight_error_sq(self, slot: Slot, tier: Tier) -> float: ...


@dataclass(frozen=True)
class Objective:
    """One way to price a slot at a tier."""

    name: str
    help: str
    fp32_share: float = 0.0
    """Share of the units' FP32 size forced to FP32 for the most sensitive units when --fp32-fraction is not given."""
    ranks_ties: bool = False
    """Among slots of equal costs, the more sensitive get the more precise tiers (the loss cannot rise)."""
    measures: bool = False
    """Its losses are rollouts of the model with one slot at one tier (cached in the run folder)."""
    unread_rows_as_read: bool = True
    """A Gather table's slots holding only rows no context read take the price per parameter of its read slots."""

    def losses(self, view: PricingView, measured: Mapping | None) -> tuple[Loss, set[tuple[str, str]]]:
        """The loss of (slot, tier), and the (slot, tier) pairs it bounded by 0 without measuring them."""
        raise NotImplementedError


class Measured(Objective):
    def losses(self, view: PricingView, measured: Mapping | None) -> tuple[Loss, set[tuple[str, str]]]:
        unpriced: set[tuple[str, str]] = set()
        labelled = {(r.unit, r.probe.split("#")[0]) for r in measured.values()}  # known without encoding the slot

        def loss(slot: Slot, tier: Tier) -> float:
            if slot.unit in view.dead or tier.name == "fp32":
                return 0.0
            lazy = tier.bits >= LAZY_BITS and (slot.name, view.probe(tier)) not in labelled
            result = None if lazy else measured.get(view.price_key(slot, tier))
            if result is None:  # a float copy not priced yet: 0 bounds its loss from below (`TierPricing.allocate`)
                unpriced.add((slot.name, tier.name))
                return 0.0
            return math.inf if result.nonfinite else float(sum(result.div_sq))

        return loss, unpriced


class Response(Objective):
    def losses(self, view: PricingView, measured: Mapping | None) -> tuple[Loss, set[tuple[str, str]]]:
        def loss(slot: Slot, tier: Tier) -> float:
            if slot.unit in view.dead or tier.name == "fp32":
                return 0.0
            gain = math.exp(min(view.steps * view.gamma[slot.unit], 700.0))
            return gain * view.weight_error_sq(slot, tier)

        return loss, set()


class Paper(Objective):
    def losses(self, view: PricingView, measured: Mapping | None) -> tuple[Loss, set[tuple[str, str]]]:
        weights = paper_weights(dict(view.gamma), view.dead)
        return (lambda slot, tier: weights[slot.unit] * 2.0 ** (-tier.bits)), set()


def paper_weights(gammas: dict[str, float], dead: set[str]) -> dict[str, float]:
    """Positive per-unit weights that keep the γ ranking: γ itself when every live γ is positive, else γ shifted so
    the least sensitive live unit weighs 1% of the range (a higher γ always asks for more bits)."""
    live = {u: g for u, g in gammas.items() if u not in dead and math.isfinite(g)}
    if not live:
        return {u: 1.0 for u in gammas}
    low, high = min(live.values()), max(live.values())
    offset = 0.0 if low > 0 else -low + 0.01 * max(high - low, 1e-6)
    biggest = high + offset
    return {
        u: 0.0
        if u in dead
        else (10 * biggest if g == math.inf else max(g + offset, 0.0) if math.isfinite(g) else biggest)
        for u, g in gammas.items()
    }


OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in (
        Measured(
            "measured",
            "the mean squared trajectory divergence measured with only that slot at that tier",
            measures=True,
        ),
        Response("response", "exp(T·γ) · ||Q(θ) − θ||², a linear-response estimate of that divergence from the score"),
        Paper(
            "paper",
            "γ · 2^-bits (the paper's Algorithm 1)",
            fp32_share=0.10,
            ranks_ties=True,
            unread_rows_as_read=False,
        ),
    )
}


def objective_names() -> str:
    """`--objective`'s metavar: every objective of `OBJECTIVES`, as registered now."""
    return "|".join(OBJECTIVES)


def objectives_help() -> str:
    names = list(OBJECTIVES)
    return f"Allocation objective: {names[0] if len(names) == 1 else ', '.join(names[:-1]) + ' or ' + names[-1]}."
