"""`export --max-memory` and `--max-slowdown`: deployment bounds beside C.

The memory bound is a second constraint of the knapsack, on the resident bytes each slot's runtime form holds after
load (`WeightForms.priced`, beside its bits). What a session holds besides its weights is a constant: the original's
peak in a fresh process minus its weight bytes when memory is measured; otherwise the bound covers weights alone.
The slowdown bound is not priced: ONNX Runtime's kernels take only the weights they run at float speed (smaller ones
are folded to float at load, `FormPolicy`), so it is checked by timing the written model against the original,
as `eval` does, and fails the export (exit 1) when the measured ratio exceeds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tqsdeploy.errors import BoundUnmet, InputError
from tqsdeploy.evaluation.gate import parse_memory
from tqsdeploy.export.allocate import MemoryCap

SESSION = "session peak: the weights as priced plus the original session's own memory, measured"
WEIGHTS = "weights only: resident weight bytes as priced (session memory not measured)"


def check_slowdown(value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise InputError(f"--max-slowdown takes a positive finite ratio such as 1.05, not {value:g}")
    return value


@dataclass(frozen=True)
class MemoryBound:
    """The memory bound in bytes, what it covers, and the bytes outside the slots it must leave room for."""

    asked: str
    limit_bytes: int
    outside_bytes: int
    """The tensors outside the slots, as stored, and (when measured) the session's own memory."""
    overhead_bytes: int | None
    """The original session's peak minus its weight bytes; None: not measured, the bound covers weights only."""

    @classmethod
    def of(cls, asked: str, weight_bytes: int, outside_weight_bytes: int, original_peak: int | None) -> "MemoryBound":
        """The bound `asked` on a model of `weight_bytes` (all stored tensors), `outside_weight_bytes` of them
        outside the slots; `original_peak`: the original session's measured peak, or None."""
        most, ratio = parse_memory(asked)  # as gate's --max-memory reads it
        overhead = max(original_peak - weight_bytes, 0) if original_peak is not None else None
        reference = original_peak if original_peak is not None else weight_bytes
        limit = int(most if most is not None else ratio * reference)
        return cls(asked, limit, outside_weight_bytes + (overhead or 0), overhead)

    @property
    def basis(self) -> str:
        return SESSION if self.overhead_bytes is not None else WEIGHTS

    def cap(self) -> MemoryCap:
        return MemoryCap(self.limit_bytes - self.outside_bytes, self.outside_bytes, f"--max-memory {self.asked}")

    def priced(self, slot_bytes: int) -> int:
        return slot_bytes + self.outside_bytes

    def check(self, least_slot_bytes: int, target: float | None = None) -> None:
        """Refuse a bound below what the slots at their smallest resident forms reach."""
        if least_slot_bytes > self.limit_bytes - self.outside_bytes:
            raise self.cap().unmet(least_slot_bytes, target)

    def record(self, slot_bytes: int, measured_peak: int | None) -> dict:
        """The allocation JSON's `bounds.memory`: asked, priced, measured, met."""
        priced = self.priced(slot_bytes)
        return {
            "asked": self.asked,
            "bound_bytes": self.limit_bytes,
            "covers": self.basis,
            "session_overhead_bytes": self.overhead_bytes,
            "priced_bytes": priced,
            "measured_peak_bytes": measured_peak,
            "met": priced <= self.limit_bytes and (measured_peak is None or measured_peak <= self.limit_bytes),
        }


def slowdown_record(bound: float, latency: dict | None) -> dict:
    """The allocation JSON's `bounds.slowdown`: asked, measured (the worst batch's ratio of medians), met."""
    ratios = [row["slowdown"] for row in (latency or {}).get("batches", [])]
    measured = max(ratios) if ratios else None
    return {
        "asked": bound,
        "priced": None,
        "how": "measured: the written model timed against the original in paired rounds, as eval's latency "
        + (f"({latency['method']})" if latency else "(could not be measured)"),
        "measured": measured,
        "met": measured is not None and measured <= bound,
    }


def unmet_after_writing(bounds: dict, path) -> BoundUnmet | None:
    """The failure to report when a written model's record says a bound was not met (None: all met)."""
    said = []
    if (memory := bounds.get("memory")) and not memory["met"]:
        peak = memory["measured_peak_bytes"]
        seen = f"measured peak {peak:,} bytes, " if peak is not None else ""
        said.append(
            f"--max-memory {memory['asked']}: {seen}priced {memory['priced_bytes']:,} bytes, above the bound "
            f"{memory['bound_bytes']:,}"
        )
    if (slowdown := bounds.get("slowdown")) and not slowdown["met"]:
        seen = f"measured {slowdown['measured']:.3f}x" if slowdown["measured"] is not None else "not measured"
        said.append(f"--max-slowdown {slowdown['asked']:g}: {seen}")
    if not said:
        return None
    return BoundUnmet(f"{path} was written but does not meet {'; '.join(said)} (its allocation JSON says so)")
