"""`export`'s settings: how to allocate, round and store, validated once when made."""

from __future__ import annotations

from dataclasses import dataclass

from runtimes.ort_versions import IR_FROM, Release, parse_version, version_text
from tiers import DEFAULT_TIERS, METHODS, TRT_TIERS
from tqsdeploy.encoding.choices import check_grids
from tqsdeploy.errors import InputError
from tqsdeploy.evaluation.gate import parse_memory
from tqsdeploy.export.allocate import check_allocator
from tqsdeploy.export.bounds import check_slowdown
from tqsdeploy.export.forms import KERNEL_ACCURACY, FormPolicy
from tqsdeploy.export.objectives import OBJECTIVES
from tqsdeploy.size import check_basis

AUTO_ROUNDING = "auto"
"""`--rounding auto`: per tier the method whose uniform model at that tier drifts least on the scoring contexts
(`export.roundings`); any other value is one method of `tiers.METHODS` for every tier."""
GROUP_PRICES = ("shared", "exact")
"""`--group-prices`: a channel group's price from its unit's rollout (`shares.GroupShares`), or a rollout of its own."""
TARGETS = ("ort-cpu", "ort-cuda", "trt")
"""Where the exported model will run (`--target`); 'ort' is read as 'ort-cpu'."""
RUNTIME_LAYOUTS = ("auto", "native", "dequantized", "fused")
AUTO_LAYOUT = {"ort-cpu": "native", "ort-cuda": "native", "trt": "fused"}
"""What `--runtime-layout auto` writes for each target: ONNX Runtime's own low-bit kernels where they take a weight
(the model stays small in memory and runs at float speed), TensorRT's DequantizeLinear nodes (it builds its low-bit
kernels from them)."""


@dataclass(frozen=True)
class ExportSettings:
    """How to allocate, round and store."""

    tiers: tuple[str, ...] | None = None
    """Tier names; None: the default ladder of the target (asymmetric grids for ort, symmetric for trt)."""
    target: str = "ort-cpu"
    """ort-cpu, ort-cuda or trt ('ort': ort-cpu), optionally @RELEASE (ort-cpu@1.20): the runtime the model is
    written for (tiers, `runtime_layout`, and for ONNX Runtime the oldest release the file must load on)."""
    kernel_accuracy: str = "int8"
    """How ONNX Runtime's MatMulNBits computes (`forms.KERNEL_ACCURACY`): int8 activations (fast), or exact."""
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
    max_memory: str | None = None
    """`--max-memory SIZE|RATIOx`, as gate reads it: the resident memory the allocation must keep within
    (`export.bounds`); None: no bound."""
    max_slowdown: float | None = None
    """`--max-slowdown X`: the written model's latency over the original's, measured after writing; None: none."""
    lanes: int | None = None
    """Rollouts that do not depend on each other (pricing, refinement's trials) run this many at once (`sweep.Lanes`);
    None: as `score` decides, except past `job.FED_FLOATS_BYTES`, whose candidates run one at a time."""

    def __post_init__(self):
        engine, _, release = self.target.partition("@")
        if engine == "ort":
            engine = "ort-cpu"
        if engine not in TARGETS:
            raise InputError(f"unknown target '{engine}'; choose one of {', '.join(TARGETS)}")
        if release:
            _release(release, engine)
        object.__setattr__(self, "target", engine + (f"@{release}" if release else ""))
        if self.kernel_accuracy not in KERNEL_ACCURACY:
            raise InputError(
                f"unknown kernel accuracy '{self.kernel_accuracy}'; choose one of {', '.join(KERNEL_ACCURACY)}"
            )
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
        if self.max_memory is not None:
            parse_memory(self.max_memory)
        check_slowdown(self.max_slowdown)
        if self.refine < 0:
            raise InputError(f"--refine takes a number of rounds >= 0, not {self.refine}")
        if self.group_prices not in GROUP_PRICES:
            raise InputError(f"unknown --group-prices '{self.group_prices}'; choose one of {', '.join(GROUP_PRICES)}")
        if not 0 <= self.split_fraction < 1:
            raise InputError(f"--split takes a fraction in [0, 1), not {self.split_fraction}")

    @property
    def engine(self) -> str:
        """The target without its release: ort-cpu, ort-cuda or trt."""
        return self.target.partition("@")[0]

    @property
    def release(self) -> Release:
        """The oldest ONNX Runtime release the file must load on (`runtimes.ort_versions`)."""
        given = self.target.partition("@")[2]
        return _release(given, self.engine) if given else Release()

    @property
    def layout(self) -> str:
        """The runtime layout written: the one asked for, or the target's (`AUTO_LAYOUT`)."""
        return AUTO_LAYOUT[self.engine] if self.runtime_layout == "auto" else self.runtime_layout

    @property
    def policy(self) -> FormPolicy:
        """How each weight may be written for the target (`forms.WeightForms`)."""
        return FormPolicy(self.layout, self.release, self.kernel_accuracy)

    @property
    def runtime(self) -> str:
        """The tier registry's name for the target's runtime ('ort' or 'trt')."""
        return "trt" if self.engine == "trt" else "ort"

    @property
    def tier_names(self) -> tuple[str, ...]:
        if self.tiers:
            return tuple(self.tiers)
        if self.engine == "trt":
            return TRT_TIERS
        two_bit = self.release.version >= (1, 24)  # 2-bit codes load from ONNX Runtime 1.24
        return tuple(t for t in DEFAULT_TIERS if two_bit or not t.startswith("int2"))

    @property
    def fp32_share(self) -> float:
        if self.fp32_fraction is not None:
            return self.fp32_fraction
        return OBJECTIVES[self.objective].fp32_share


def _release(text: str, engine: str) -> Release:
    """The ONNX Runtime release of `--target ENGINE@RELEASE`, refused where nothing was measured on it."""
    if engine == "trt":
        raise InputError(f"--target trt@{text}: a release is for ONNX Runtime targets (ort-cpu, ort-cuda)")
    try:
        version = parse_version(text)
    except ValueError as exc:
        raise InputError(f"--target {engine}@{text}: {exc}") from None
    oldest, newest = min(IR_FROM.values()), max(IR_FROM.values())
    if not oldest <= version:
        raise InputError(
            f"--target {engine}@{text}: files are written for ONNX Runtime {version_text(oldest)} or later"
        )
    return Release(min(version, newest) if version > newest else version)
