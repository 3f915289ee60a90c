"""What each slot costs in the file at each tier, the budget a target C sets, and the opset files are written at.

The knapsack prices slots one by one, but the writer stores stretches (a unit's neighbouring slots at one tier)
each with its own scales and nodes: `Sizing.written_costs` prices an assignment exactly as written.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from graph_ops.qdq import computes_in_half, conversion_overhead_bits
from tiers import TIERS, Encoded, Tier, ladder_opset
from tqsdeploy.encoding.slots import Slot
from tqsdeploy.export.allocate import Allocation
from tqsdeploy.export.job import ExportJob
from tqsdeploy.export.settings import ExportSettings
from tqsdeploy.size import SizeBudget, split_bits
from tqsdeploy.units import Unit, outside_hint


def output_opset(tiers: Sequence[Tier], settings: ExportSettings):
    """The opset function `prepare` asks for (proto, units): a graph computing in 16-bit floats is written and
    measured at the opset its tier set needs (`tiers.ladder_opset`); others at 1, each file at the lowest it needs."""

    def opset(proto, units: list[Unit]) -> int:
        if not computes_in_half(proto):
            return 1
        return ladder_opset(tiers, {t.dtype for u in units for t in u.tensors}, bool(settings.group_size))

    return opset


class Sizing:
    """Bits per slot and tier, as the file stores them; the budget of a target on the --C basis."""

    def __init__(self, job: ExportJob):
        self.scored, self.settings, self.encoder, self.cut = job.scored, job.settings, job.encoder, job.cut
        self.forms = job.forms
        self._overhead: dict[int, int] = {}
        self._costs: dict[tuple[float, str, str], int] = {}
        """(cut, slot, tier) -> bits: a slot's share of its unit's bits depends on the other slots of the cut."""
        self._resident: dict[tuple[float, str, str], int] = {}
        """(cut, slot, tier) -> bytes the slot holds in a session after load (`WeightForms.resident_bytes`)."""
        self._joined: dict[tuple, int] = {}
        """(cut, tensor, channel runs) -> resident bytes of a unit tensor split over tiers (`written_resident`)."""
        self._stretch_bits: dict[tuple[str, str, tuple[int, int]], int] = {}

    def overhead_bits(self, opset: int) -> int:
        """Bits the opset conversion adds (attributes that become constant inputs)."""
        if opset <= self.scored.model_opset:
            return 0
        if opset not in self._overhead:
            self._overhead[opset] = conversion_overhead_bits(self.scored.model.proto, opset)
        return self._overhead[opset]

    def budget(self, tiers: Sequence[Tier]) -> SizeBudget:
        """C on the --C basis: the stored bits outside the units at their size plus what the opset conversion adds
        (the output opset's, or the worst case over the tier set's opsets)."""
        return self.scored.sizes.budget(
            self.settings.basis, self.overhead_bits(max([self.scored.opset] + [t.opset for t in tiers]))
        )

    def cost(self, slot: Slot, tier: Tier | str) -> int:
        """Bits the slot's stored form puts in the file at `tier`, whatever the rounding method.

        A slot pays its own codes, scales and zero points, and its share (by channels) of what the form emits
        once per stored run; the shares of a unit's slots sum to exactly what the unit at one tier writes."""
        tier = TIERS[tier] if isinstance(tier, str) else tier
        key = (self.cut.fraction, slot.name, tier.name)
        if key not in self._costs:
            self._price_unit(slot.unit, tier)
        return self._costs[key]

    def resident(self, slot: Slot, tier: Tier | str) -> int:
        """Bytes the slot holds in an ONNX Runtime session after load at `tier` (`WeightForms.resident_bytes`): its
        channel share of its unit's, priced beside `cost` from the same stored forms."""
        tier = TIERS[tier] if isinstance(tier, str) else tier
        key = (self.cut.fraction, slot.name, tier.name)
        if key not in self._resident:
            self._price_unit(slot.unit, tier)
        return self._resident[key]

    def _price_unit(self, unit: str, tier: Tier) -> None:
        """Every slot of the unit at once, bits and resident bytes: one stored form per tensor."""
        forms = self.encoder.stored_forms(unit, tier)
        priced = {n: self.forms.priced(n, e) for n, e in forms.items()}
        written, resident = {n: p[0] for n, p in priced.items()}, {n: p[1] for n, p in priced.items()}
        slots = self.cut.slots_of[unit]
        shares = [self._share_bits(other, forms, written) for other in slots]
        held = [sum(resident[n] * self._channel_share(other, n) for n in forms) for other in slots]
        for other, bits, nbytes in zip(
            slots, split_bits(shares, sum(written.values())), split_bits(held, sum(resident.values()))
        ):
            self._costs[(self.cut.fraction, other.name, tier.name)] = bits
            self._resident[(self.cut.fraction, other.name, tier.name)] = nbytes

    def _channel_share(self, slot: Slot, name: str) -> float:
        """The share of tensor `name`'s channels the slot holds (1 for a whole unit)."""
        return 1.0 if slot.rows is None else (slot.rows[1] - slot.rows[0]) / self.encoder.layouts[name].channels

    def _share_bits(self, slot: Slot, forms: dict[str, Encoded], written: dict[str, int]) -> float:
        """The slot's payload plus its channel share of what each tensor's form writes beside its payload."""
        bits = 0.0
        for name, encoded in forms.items():
            part = self.encoder.channels(name, encoded, slot.rows)
            bits += part.payload_bits + (written[name] - encoded.payload_bits) * self._channel_share(slot, name)
        return bits

    def stretches(self, tiers: dict[str, str]) -> list[tuple[str, str, list[Slot]]]:
        """(unit, tier, slots) of every stretch the writer stores: a unit's neighbouring slots at one tier, joined."""
        found = []
        for unit, slots in self.cut.slots_of.items():
            for slot in sorted(slots, key=lambda s: (s.rows or (0, 0))[0]):
                if found and found[-1][0] == unit and found[-1][1] == tiers[slot.name]:
                    found[-1][2].append(slot)
                else:
                    found.append((unit, tiers[slot.name], [slot]))
        return found

    def written_costs(self, tiers: dict[str, str]) -> dict[str, int]:
        """Each slot's bits in the file that the assignment `tiers` writes, summing to exactly what it writes: a unit
        split over several tiers writes its per-stretch constants once per stretch, which no additive price knows."""
        costs = {}
        stretches = self.stretches(tiers)
        count = Counter(unit for unit, _, _ in stretches)
        forms: dict[tuple[str, str], dict[str, Encoded]] = {}
        for unit, tier, slots in stretches:
            if count[unit] == 1:  # one stretch: the whole unit at one tier, as `cost` priced it
                costs.update({slot.name: self.cost(slot, tier) for slot in slots})
                continue
            rows = (slots[0].rows[0], slots[-1].rows[1])
            key = (unit, tier, rows)
            if key not in self._stretch_bits:
                if (unit, tier) not in forms:
                    forms[(unit, tier)] = self.encoder.stored_forms(unit, tier)
                self._stretch_bits[key] = sum(
                    self.forms.bits(n, self.encoder.channels(n, e, rows)) for n, e in forms[(unit, tier)].items()
                )
            costs.update(
                zip(
                    [slot.name for slot in slots],
                    split_bits([self.cost(slot, tier) for slot in slots], self._stretch_bits[key]),
                )
            )
        return costs

    def costs(self, tiers: Sequence[Tier]) -> dict[str, dict[str, int]]:
        """Every slot's cost at every tier of the set."""
        return {slot.name: {tier.name: self.cost(slot, tier) for tier in tiers} for slot in self.cut.slots}

    def residents(self, tiers: Sequence[Tier]) -> dict[str, dict[str, int]]:
        """Every slot's resident bytes at every tier of the set."""
        return {slot.name: {tier.name: self.resident(slot, tier) for tier in tiers} for slot in self.cut.slots}

    def resident_of(self, tiers: dict[str, str]) -> int:
        """The slots' resident bytes under the assignment `tiers` (slot -> tier), as priced."""
        return sum(self.resident(slot, tiers[slot.name]) for slot in self.cut.slots)

    def written_resident(self, tiers: dict[str, str]) -> int:
        """The slots' resident bytes as the assignment `tiers` is written: a unit split over tiers is one tensor whose
        form (a kernel, or a float folded at load) depends on all its stretches, which no additive price knows."""
        total = 0
        for unit, slots in self.cut.slots_of.items():
            if len({tiers[s.name] for s in slots}) == 1:
                total += sum(self.resident(s, tiers[s.name]) for s in slots)
                continue
            for name in self.scored.units_by_name[unit].tensor_names:
                runs = self.encoder.runs(name, slots, tiers)
                key = (self.cut.fraction, name, tuple(runs))
                if key not in self._joined:
                    self._joined[key] = self.forms.resident_bytes(name, self.encoder.stored_joined(unit, name, runs))
                total += self._joined[key]
        return total

    def floor_bits(self, tiers: Sequence[Tier]) -> int:
        """The slots' bits with every slot at its cheapest tier: the uniform file of the lowest tier's units."""
        return sum(min(c.values()) for c in self.costs(tiers).values())

    def allocation(
        self, assignment: dict[str, str], target: float | None, solver: str, objective: str, tiers: Sequence[Tier]
    ) -> Allocation:
        """`assignment` priced as written, on the budget of the tier set `tiers`."""
        return Allocation(
            dict(assignment), self.written_costs(assignment), self.budget(tiers), target, solver, objective
        )

    def uniform(self, tier: str, tiers: Sequence[Tier], target: float | None = None) -> Allocation:
        """Every slot at `tier`."""
        return self.allocation({s.name: tier for s in self.cut.slots}, target, "uniform", "uniform", tiers)

    def check_targets(self, targets: list[float], tiers: Sequence[Tier]) -> None:
        """Fail before any work when a target cannot be met, saying what caps C."""
        budget, floor = self.budget(tiers), self.floor_bits(tiers)
        hint = "lower --C or add a cheaper tier"
        release = self.settings.release if self.settings.engine.startswith("ort") else None
        if release is not None and release.version < (1, 24) and not any(t.name.startswith("int2") for t in tiers):
            hint += f" (2-bit tiers need ONNX Runtime 1.24: --target {self.settings.target} leaves them out)"
        if budget.fixed_bits > 0 and budget.basis_bits / floor > 1.25 * budget.compression(
            floor
        ):  # the tensors outside the units bind
            hint += self._outside_hint(budget)
        for target in targets:
            budget.check(target, floor, [t.name for t in tiers], hint)

    def _outside_hint(self, budget: SizeBudget) -> str:
        """Why the tensors that are not units cap C, and what would quantize them."""
        selection = self.scored.scores.selection
        large = outside_hint(self.scored.model.proto, [n for u in self.scored.units for n in u.tensor_names], selection)
        why = (
            f"{large}, or use --basis units"
            if large
            else "score with a lower --min-params (or --include) to quantize them, or use --basis units"
        )
        return (
            f"; {budget.fixed_bits / budget.basis_bits:.1%} of the stored bits are in tensors that are not units"
            + ("" if large else f" (smaller than --min-params {selection.min_params} or not weight operands)")
            + f", which alone caps C at {budget.basis_bits / budget.fixed_bits:.3g}: {why}"
        )
