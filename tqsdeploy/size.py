"""The size owner: what a compression target C means in bits, whether it can be reached, and the ratio of a file.

Every ratio divides stored tensor bits (initializers and Constant values, scales and zero points included:
`graph_ops.weight_bits`), the original's over the compressed one's. `--basis file` counts every stored
tensor, so the tensors that are not units stay at their stored size and use up budget; `--basis units`
counts the scored units only. Export, frontier, baseline, eval and gate all ask this module; the allocator
asks it for the budget of the slots it places.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from tqsdeploy.errors import InfeasibleError, InputError

BASES = ("file", "units")

REACH_TOLERANCE = 1e-4
"""A target this little (relative) above the largest reachable C is that C: ratios are printed with four or five
digits, and the printed C of a uniform file must be accepted as a target."""


def compression(reference_bits: int, weight_bits: int) -> float:
    """The original's stored bits over a compressed model's: the one number export, baseline, eval and gate report."""
    return reference_bits / max(weight_bits, 1)


def check_basis(basis: str) -> str:
    if basis not in BASES:
        raise InputError(f"--C basis must be 'file' or 'units', not '{basis}'")
    return basis


def check_target(target: float) -> float:
    if not (isinstance(target, (int, float)) and math.isfinite(target) and target > 0):
        raise InputError(f"compression target must be a positive number, not {target}")
    if target < 1:  # the original's bits over the export's: below 1 asks for a larger file, which no tier makes
        raise InputError(
            f"compression target {target:g} is below 1: "
            "C is the original's size over the exported one (1 keeps it as it is)"
        )
    return float(target)


def split_bits(parts: list[float], total: int) -> list[int]:
    """Whole bits per part, in proportion to `parts` and summing to `total` (largest remainders first): a unit's
    slots at one tier then cost together exactly what the file stores for the unit."""
    if sum(parts) <= 0:
        parts = [1.0] * len(parts)
    exact = [p * total / sum(parts) for p in parts]
    whole = [math.floor(e) for e in exact]
    for i in sorted(range(len(parts)), key=lambda i: whole[i] - exact[i])[: total - sum(whole)]:
        whole[i] += 1
    return whole


def reachable_label(best: float) -> str:
    """The largest reachable C as printed: rounded down, so that the printed number is itself accepted."""
    return f"{math.floor(best * 1e4) / 1e4:.4f}".rstrip("0").rstrip(".")


@dataclass(frozen=True)
class SizeBudget:
    """C on one basis: `basis_bits` / (`fixed_bits` + the bits of the allocated slots)."""

    basis_bits: int
    """What C divides: the original's stored bits on the basis."""
    fixed_bits: int = 0
    """Stored bits on the basis that no allocation changes (tensors that are not units, opset overhead)."""

    def reserving(self, bits: int) -> "SizeBudget":
        """The same C with `bits` more held outside the slots (what the stretches write beyond their prices)."""
        return SizeBudget(self.basis_bits, self.fixed_bits + bits)

    def slot_bits(self, target: float) -> float:
        """The bits the allocated slots may take for compression `target`."""
        return self.basis_bits / check_target(target) - self.fixed_bits

    def compression(self, slot_bits: float) -> float:
        """C of an allocation whose slots take `slot_bits`."""
        return self.basis_bits / (self.fixed_bits + slot_bits)

    def fits(self, slot_bits: float, target: float) -> bool:
        """Whether slots taking `slot_bits` meet compression `target`."""
        return slot_bits <= self.slot_bits(target)

    def reachable(self, floor_bits: float, target: float) -> bool:
        """Whether `target` can be met when the slots cost at least `floor_bits` (see `REACH_TOLERANCE`)."""
        return check_target(target) <= self.compression(floor_bits) * (1 + REACH_TOLERANCE)

    def check(
        self, target: float, floor_bits: float, tiers: Iterable[str], hint: str = "lower --C or add a cheaper tier"
    ) -> None:
        """Refuse a target out of reach, naming the largest reachable C."""
        if not self.reachable(floor_bits, target):
            raise InfeasibleError(
                f"compression {target:g} is out of reach with tiers {', '.join(tiers)}: "
                f"the largest reachable is {reachable_label(self.compression(floor_bits))}",
                hint=hint,
            )


@dataclass(frozen=True)
class ModelSize:
    """The original model's stored bits, all of them and the units' share: the reference of every ratio."""

    reference_bits: int
    unit_reference_bits: int

    @classmethod
    def of(cls, proto, unit_tensors: Iterable[str]) -> "ModelSize":
        import graph_ops

        sizes = graph_ops.io.tensor_sizes(proto)
        return cls(graph_ops.weight_bits(proto), sum(sizes[n] for n in set(unit_tensors)))

    @property
    def outside_bits(self) -> int:
        """Stored bits of the tensors that are not units (they stay at their stored size)."""
        return self.reference_bits - self.unit_reference_bits

    def basis_bits(self, basis: str) -> int:
        return self.reference_bits if check_basis(basis) == "file" else self.unit_reference_bits

    def budget(self, basis: str, overhead_bits: int = 0) -> SizeBudget:
        """The budget on `basis`; `overhead_bits`: what converting the file to a newer opset adds (file basis only)."""
        fixed = 0 if check_basis(basis) == "units" else self.outside_bits + overhead_bits
        return SizeBudget(self.basis_bits(basis), fixed)

    def file_compression(self, weight_bits: int) -> float:
        """C of a written file (its stored bits, `graph_ops.weight_bits`)."""
        return compression(self.reference_bits, weight_bits)

    def unit_compression(self, unit_bits: int) -> float:
        """C over the units alone, their written bits `unit_bits` (the paper's C)."""
        return compression(self.unit_reference_bits, unit_bits)

    def file_bits(self, target: float, basis: str) -> float:
        """About the stored bits of a file compressed `target` times on `basis` (the tensors outside the units kept)."""
        if check_basis(basis) == "file":
            return self.reference_bits / check_target(target)
        return self.outside_bits + self.unit_reference_bits / check_target(target)

    def record(self, written, unit_bits: int, layout: str) -> dict:
        """What the record of a written file (`graph_ops.qdq.Written`) in runtime `layout` says about its size, its
        unit tensors taking `unit_bits` in it: export's and baseline's alike."""
        return {
            "output": str(written.path),
            "file_bytes": written.bytes,
            "files": [str(f) for f in written.files],
            "external_data": str(written.files[1]) if len(written.files) > 1 else None,
            "runtime_layout": layout,
            "compression": self.file_compression(written.weight_bits),
            "unit_compression": self.unit_compression(unit_bits),
            "weight_bits": written.weight_bits,
            "reference_bits": self.reference_bits,
        }
