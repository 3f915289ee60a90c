"""`export`'s size accounting: what each slot costs in the file at each tier, the budget a target C sets, and
the opset the files are written at (a mixin of `tqsdeploy.export.planner.Planner`)."""

from __future__ import annotations

from collections import Counter

from graph_ops.qdq import computes_in_half, conversion_overhead_bits, emitted_bits
from tiers import TIERS, Encoded, Tier, ladder_opset
from tqsdeploy.encoding.encoder import Slot
from tqsdeploy.size import SizeBudget, split_bits
from tqsdeploy.units import Unit, outside_hint


class Sizing:
    def overhead_bits(self, opset: int) -> int:
        """Bits the opset conversion adds (attributes that become constant inputs)."""
        if opset <= self.model_opset:
            return 0
        if opset not in self._overhead:
            self._overhead[opset] = conversion_overhead_bits(self.model.proto, opset)
        return self._overhead[opset]

    def output_opset(self, proto, units: list[Unit]) -> int:
        """The opset this export writes every file at and measures its candidates at (`tiers.ladder_opset`), for a
        graph computing in 16-bit floats (`graph_ops.qdq.computes_in_half`); others, 1: each file at the lowest it needs."""
        return ladder_opset(self.tiers, {t.dtype for u in units for t in u.tensors}, bool(self.settings.group_size)) if computes_in_half(proto) else 1

    @property
    def budget(self) -> SizeBudget:
        """C on the --C basis: the stored bits outside the units count at their size plus what the opset
        conversion adds (the output opset's, or the worst case over the tier set's opsets)."""
        return self.sizes.budget(self.settings.basis, self.overhead_bits(max([self.opset] + [t.opset for t in self.tiers])))

    def cost(self, slot: Slot, tier: Tier | str) -> int:
        """Bits the slot's stored form puts in the file at `tier` (the same for every rounding method).

        A slot pays its own codes, scales and zero points, and its share (by channels) of what the form
        emits once per stored run beside them (INT1's unpack constants: 65 bytes). The writer joins a
        tensor's neighbouring slots of one tier into one run, so the slots' prices are scaled to sum to
        exactly what the unit at one tier writes (`size.split_bits`): charging each slot the whole overhead
        priced a split INT1 unit 15% above its file, and channel groups of a blockwise grid priced 20 bits
        above it, which made the largest reachable C smaller than the uniform file of the lowest tier. A unit split
        over several tiers writes that overhead once per stretch: `written_costs` prices an allocation as written."""
        tier = TIERS[tier] if isinstance(tier, str) else tier
        key = (self.split_fraction, slot.name, tier.name)
        if key not in self._costs:  # every slot of the unit at once: one stored form per tensor
            forms = self.encoder.stored_forms(slot.unit, tier)
            written = {n: emitted_bits(n, e, self.settings.layout) for n, e in forms.items()}
            slots = self.slots_of[slot.unit]
            shares = []
            for other in slots:
                bits = 0.0
                for name, encoded in forms.items():
                    part = self.encoder.channels(name, encoded, other.rows)
                    share = 1.0 if other.rows is None else (other.rows[1] - other.rows[0]) / self.encoder.layouts[name].channels
                    bits += part.payload_bits + (written[name] - encoded.payload_bits) * share
                shares.append(bits)
            for other, bits in zip(slots, split_bits(shares, sum(written.values()))):
                self._costs[(self.split_fraction, other.name, tier.name)] = bits
        return self._costs[key]

    def stretches(self, tiers: dict[str, str]) -> list[tuple[str, str, list[Slot]]]:
        """(unit, tier, slots) of every stretch the writer stores: a unit's neighbouring slots at one tier, joined."""
        found = []
        for unit, slots in self.slots_of.items():
            for slot in sorted(slots, key=lambda s: (s.rows or (0, 0))[0]):
                if found and found[-1][0] == unit and found[-1][1] == tiers[slot.name]:
                    found[-1][2].append(slot)
                else:
                    found.append((unit, tiers[slot.name], [slot]))
        return found

    def written_costs(self, tiers: dict[str, str]) -> dict[str, int]:
        """Each slot's bits in the file that the assignment `tiers` writes, summing to exactly what it writes.

        `cost` shares by channels what a unit stores once per stretch at one tier (the block-index shape
        constants of a blockwise grid's dequantized layout, about 512 bits; INT1's unpack constants): exact for
        a unit at one tier, but a unit split over several tiers writes those once per stretch, which no
        additive price can know (it depends on the neighbours' tiers). Here each stretch's slots share what the
        stretch writes (`size.split_bits`)."""
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
                self._stretch_bits[key] = sum(emitted_bits(n, self.encoder.channels(n, e, rows), self.settings.layout) for n, e in forms[(unit, tier)].items())
            costs.update(zip([slot.name for slot in slots], split_bits([self.cost(slot, tier) for slot in slots], self._stretch_bits[key])))
        return costs

    def costs(self) -> dict[str, dict[str, int]]:
        """Every slot's cost at every tier of the set."""
        return {slot.name: {tier.name: self.cost(slot, tier) for tier in self.tiers} for slot in self.slots}

    def floor_bits(self) -> int:
        """The slots' bits with every slot at its cheapest tier: the uniform file of the lowest tier's units."""
        return sum(min(c.values()) for c in self.costs().values())

    def max_compression(self) -> float:
        """The largest compression reachable with these tiers (every slot at its cheapest)."""
        return self.budget.compression(self.floor_bits())

    def reachable(self, target: float) -> bool:
        return self.budget.reachable(self.floor_bits(), target)

    def check_targets(self, targets: list[float]) -> None:
        """Fail before any work when a target cannot be met."""
        budget, floor = self.budget, self.floor_bits()
        hint = "lower --C or add a cheaper tier"
        if budget.fixed_bits > 0 and budget.basis_bits / floor > 1.25 * budget.compression(floor):  # the tensors outside the units bind
            selection = self.scores.selection
            large = outside_hint(self.model.proto, [n for u in self.units for n in u.tensor_names], selection)
            why = f"{large}, or use --basis units" if large else "score with a lower --min-params (or --include) to quantize them, or use --basis units"
            hint += (
                f"; {budget.fixed_bits / budget.basis_bits:.1%} of the stored bits are in tensors that are not units"
                + ("" if large else f" (smaller than --min-params {selection.min_params} or not weight operands)")
                + f", which alone caps C at {budget.basis_bits / budget.fixed_bits:.3g}: {why}"
            )
        for target in targets:
            budget.check(target, floor, [t.name for t in self.tiers], hint)
