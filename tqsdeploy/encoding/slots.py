"""What is encoded: a model's units as slots (whole units, or channel groups of a large one) and their layouts.

Slots let the allocator spend a budget finely: a unit holding a large share of the weights is split into groups
of output channels, each priced and assigned on its own and written as its own stretch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

import graph_ops
from graph_ops.layout import WeightLayout
from tiers import Layout, Tier
from tqsdeploy.errors import InputError
from tqsdeploy.units import Unit, UnitSelection, select_units

MAX_PARTS = 64
"""Most channel groups one unit is split into."""


@dataclass(frozen=True)
class Slot:
    """What the allocator assigns one tier to: a whole unit, or output channels start..stop of a one-tensor unit
    (a channel group: a unit holding a large share of the weights is cut so the budget can be spent finely)."""

    name: str
    unit: str
    params: int
    rows: tuple[int, int] | None = None
    label: str = ""
    """What reports call it: its unit's label (`Unit.label`, a module path where the exporter generated the name),
    with the channels `[a:b]` of a channel group; `name` stays its identity."""

    @property
    def display(self) -> str:
        return self.label or self.name


def make_slots(units: Sequence[Unit], layouts: Mapping[str, WeightLayout], split_fraction: float) -> list[Slot]:
    """Units as slots; a one-tensor unit with known layout holding more than `split_fraction`
    of all unit parameters is split into channel groups of about that share each."""
    total = sum(u.params for u in units)
    slots = []
    for unit in units:
        layout = layouts[unit.tensors[0].name]
        limit = split_fraction * total
        if split_fraction <= 0 or len(unit.tensors) != 1 or layout.perm is None or unit.params <= limit:
            slots.append(Slot(unit.name, unit.name, unit.params, label=unit.label))
            continue
        channels = layout.shape[layout.perm[0]]
        parts = max(1, min(channels, MAX_PARTS, math.ceil(unit.params / limit)))
        bounds = np.linspace(0, channels, parts + 1).round().astype(int)
        per_channel = unit.params // channels
        for a, b in zip(bounds[:-1], bounds[1:]):
            cut = "" if parts == 1 else f"[{a}:{b}]"
            slots.append(
                Slot(
                    unit.name + cut,
                    unit.name,
                    per_channel * (b - a),
                    None if parts == 1 else (int(a), int(b)),
                    unit.label + cut,
                )
            )
    return slots


def checked_layouts(
    proto, min_params: int, group_size: int | None, tiers: Sequence[Tier]
) -> tuple[list[Unit], list[str], dict[str, WeightLayout]]:
    """The weights a baseline or a frontier quantizes (units of at least `min_params`) and their layouts,
    refusing a --group-size none of them would use (`check_group_size`) before any work starts."""
    units = select_units(graph_ops.find_weight_tensors(proto), UnitSelection(min_params=min_params))
    names = [n for u in units for n in u.tensor_names]
    layouts = graph_ops.weight_layouts(proto, names)
    check_group_size(group_size, layouts, tiers)
    return units, names, layouts


def check_group_size(group_size: int | None, layouts: Mapping[str, WeightLayout], tiers: Sequence[Tier]) -> None:
    """Refuse a --group-size nothing would use: only integer tiers take blocks, and only on rank-2 weights
    (Conv kernels keep a scale per output channel), so a user would not know it did nothing."""
    if not group_size:
        return
    if not any(t.blockwise for t in tiers):
        raise InputError(
            f"--group-size {group_size} would change nothing: no tier here ({', '.join(t.name for t in tiers)}) "
            "takes blocks",
            hint="only the integer tiers int2 to int8 do; int1, fp8 and the float tiers keep one scale per "
            "output channel",
        )
    if not any(Layout(w.shape, w.perm, w.row_groups).block_axis is not None for w in layouts.values()):
        raise InputError(
            f"--group-size {group_size} would change nothing: none of this model's {len(layouts)} quantized weights "
            "is a rank-2 "
            f"weight with known layout (MatMul, Gemm); e.g. '{next(iter(layouts), '')}' keeps one scale per output "
            "channel",
            hint="leave --group-size out for this model",
        )
