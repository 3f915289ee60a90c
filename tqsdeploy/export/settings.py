"""`export`'s settings: how to allocate, round and store, validated once when made."""

from __future__ import annotations

from dataclasses import dataclass

from tiers import DEFAULT_TIERS, METHODS, TRT_TIERS
from tqsdeploy.encoding.choices import check_grids
from tqsdeploy.errors import InputError
from tqsdeploy.export.allocate import check_allocator
from tqsdeploy.export.objectives import OBJECTIVES
from tqsdeploy.size import check_basis

AUTO_ROUNDING = "auto"
"""`--rounding auto`: per tier the method whose uniform model at that tier drifts least on the scoring contexts
(`export.roundings`); any other value is one method of `tiers.METHODS` for every tier."""
GROUP_PRICES = ("shared", "exact")
"""`--group-prices`: a channel group's price from its unit's rollout (`shares.GroupShares`), or a rollout of its own."""
TARGETS = ("ort-cpu", "ort-cuda", "trt")
"""Where the exported model will run (`--target`); 'ort' is read as 'ort-cpu'."""
RUNTIME_LAYOUTS = ("auto", "dequantized", "fused")
AUTO_LAYOUT = {"ort-cpu": "dequantized", "ort-cuda": "dequantized", "trt": "fused"}
"""What `--runtime-layout auto` writes for each target: ONNX Runtime targets dequantize once at load (its float
kernels beat MatMulNBits on batched windows, docs/export.md); TensorRT builds its low-bit kernels from
DequantizeLinear nodes, which 'fused' keeps."""


@dataclass(frozen=True)
class ExportSettings:
    """How to allocate, round and store."""

    tiers: tuple[str, ...] | None = None
    """Tier names; None: the default ladder of the target (asymmetric grids for ort, symmetric for trt)."""
    target: str = "ort-cpu"
    """ort-cpu, ort-cuda or trt ('ort': ort-cpu): the runtime the model is written for (tiers, `runtime_layout`)."""
    runtime_layout: str = "auto"
    """How codes reach their consumers (`graph_ops.qdq.LAYOUTS`); 'auto': `AUTO_LAYOUT` of the target."""
    group_size: int | None = None
    objective: str = "measured"
    rounding: str = "qep"
    """How codes are chosen on each tier's grid: rtn, gptq, gptaq, qep, or auto (chosen per tier by measurement)."""
    grids: str = "auto"
    """The grids a calibrated rounding takes on the clip-searched tiers (`encoding.encoder.GRID_CHOICES`): 'auto', per
    tier the one whose uniform model drifts less on the scoring contexts (`Roundings.measured_rounding`)."""
    fp32_fraction: float | None = None
    """Share of the units' FP32 size forced to FP32 (Algorithm 1); None: 0.10 for the paper objective, 0 otherwise."""
    allocator: str = "mckp"
    fallback: bool = True
    refine: int = 0
    """Rounds of joint re-pricing (2 joint rollouts per live slot per round, a calibration pass per kept round); off
    by default: on the frontiers it rarely changed the model and cost a quarter of an export (benchmarks/results)."""
    split_fraction: float = 0.02
    """Units holding more than this share of the unit parameters are split into channel groups of about this share."""
    group_prices: str = "shared"
    """A channel group's price: 'shared', its unit's rollout times the group's share of the unit's layer-output error
    (`shares.GroupShares`: a rollout per unit and tier at any cut), or 'exact', a rollout of its own per tier."""
    basis: str = "file"
    """What --C divides: 'file' (every stored tensor) or 'units' (the scored units only)."""
    single_file: bool = False
    """Write every tensor inside the .onnx (refused past protobuf's 2 GiB); False: one file unless the input keeps
    its weights in external-data files or the output reaches 1 GiB (`graph_ops.qdq.write_storage`)."""
    lanes: int | None = None
    """Rollouts that do not depend on each other (pricing, refinement's trials) run this many at once (`sweep.Lanes`);
    None: as `score` decides, except past `job.FED_FLOATS_BYTES`, whose candidates run one at a time."""

    def __post_init__(self):
        if self.target == "ort":
            object.__setattr__(self, "target", "ort-cpu")
        if self.target not in TARGETS:
            raise InputError(f"unknown target '{self.target}'; choose one of {', '.join(TARGETS)}")
        if self.runtime_layout not in RUNTIME_LAYOUTS:
            raise InputError(
                f"unknown runtime layout '{self.runtime_layout}'; choose one of {', '.join(RUNTIME_LAYOUTS)}"
            )
        if self.objective not in OBJECTIVES:
            raise InputError(f"unknown objective '{self.objective}'; choose one of {', '.join(OBJECTIVES)}")
        if self.rounding not in (*METHODS, AUTO_ROUNDING):
            raise InputError(
                f"unknown rounding '{self.rounding}'; choose one of {', '.join((*METHODS, AUTO_ROUNDING))}"
            )
        check_grids(self.grids)
        check_basis(self.basis)
        check_allocator(self.allocator)
        if self.refine < 0:
            raise InputError(f"--refine takes a number of rounds >= 0, not {self.refine}")
        if self.group_prices not in GROUP_PRICES:
            raise InputError(f"unknown --group-prices '{self.group_prices}'; choose one of {', '.join(GROUP_PRICES)}")
        if not 0 <= self.split_fraction < 1:
            raise InputError(f"--split takes a fraction in [0, 1), not {self.split_fraction}")

    @property
    def layout(self) -> str:
        """The runtime layout written: the one asked for, or the target's (`AUTO_LAYOUT`)."""
        return AUTO_LAYOUT[self.target] if self.runtime_layout == "auto" else self.runtime_layout

    @property
    def runtime(self) -> str:
        """The tier registry's name for the target's runtime ('ort' or 'trt')."""
        return "trt" if self.target == "trt" else "ort"

    @property
    def tier_names(self) -> tuple[str, ...]:
        if self.tiers:
            return tuple(self.tiers)
        return TRT_TIERS if self.target == "trt" else DEFAULT_TIERS

    @property
    def fp32_share(self) -> float:
        if self.fp32_fraction is not None:
            return self.fp32_fraction
        return OBJECTIVES[self.objective].fp32_share
