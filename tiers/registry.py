"""The precision tiers: each a named instance of its stored format (`tiers.formats`).

Float tiers keep the weight as a float (narrower float + Cast); integer tiers
store codes on the tier's grid behind DequantizeLinear, symmetric (INT codes,
no zero point: what TensorRT runs) or asymmetric (UINT codes + zero points:
the grid every GPTQ-family reference uses, and the better one at 2 to 4 bits);
fp8 stores E4M3 codes; int1 stores packed sign bits. How the codes are chosen
(round to nearest, GPTQ, GPTAQ, QEP) is a separate axis: `tiers.quantizer`.
A new tier is its format's file in `tiers/formats/` and one line in `TIERS`.
"""

from __future__ import annotations

from tiers.formats.base import Tier
from tiers.formats.floats import FloatTier
from tiers.formats.fp8 import Fp8Tier
from tiers.formats.integer import IntegerTier
from tiers.formats.sign import SignTier
from tiers.formats.split import Split  # noqa: F401 - registers the 'split' form

BOTH, ORT = {"ort", "trt"}, {"ort"}

TIERS: dict[str, Tier] = {
    t.name: t
    for t in (
        FloatTier("fp32", 32, frozenset(BOTH), 1),
        FloatTier("bf16", 16, frozenset(BOTH), 13, narrow="bfloat16"),
        FloatTier("fp16", 16, frozenset(BOTH), 1, narrow="float16"),
        Fp8Tier("fp8", 8, frozenset(BOTH), 19),
        IntegerTier.make(8, True, BOTH),
        IntegerTier.make(8, False, ORT),
        IntegerTier.make(4, True, BOTH),
        IntegerTier.make(4, False, ORT),
        IntegerTier.make(3, True, ORT),
        IntegerTier.make(3, False, ORT),
        IntegerTier.make(2, True, ORT),
        IntegerTier.make(2, False, ORT),
        SignTier("int1", 1, frozenset(ORT), 18),
    )
}
"""Built-in tiers by name, from most to least precise."""

DEFAULT_TIERS = ("fp32", "fp16", "bf16", "int8-asym", "int4-asym", "int2-asym")
"""The paper's five-tier ladder (FP32, BF16, INT8, INT4, INT2) on asymmetric grids, which round 2-4-bit
weights better than symmetric ones (docs/design-notes/tiers.md, 'Asymmetric grids'), with fp16 beside bf16:
at the same 16 bits fp16 keeps 3 more mantissa bits (an 8x smaller rounding error on every weight
inside its range), bf16 stays for weights past fp16's range. Both are priced only when an
allocation picks one (`Export.allocate`), so the extra tier costs a rollout only where it is used."""

TRT_TIERS = ("fp32", "fp16", "bf16", "int8", "int4")
"""The same ladder for TensorRT: symmetric integer grids, INT4 blockwise."""

TRT_BLOCK_SIZES = (64, 128)
"""TensorRT runs weight-only INT4 only blockwise with these block sizes."""


class TierError(ValueError):
    """An unknown tier, or a tier the target runtime cannot run."""


def tier_for_bits(bits: int, symmetric: bool = False) -> Tier:
    """The integer (or, at 1 bit, sign) tier of a uniform b-bit baseline."""
    if bits == 1:
        return TIERS["int1"]
    name = f"int{bits}" + ("" if symmetric else "-asym")
    if name not in TIERS:
        raise TierError(f"no {bits}-bit tier; choose 1, 2, 3, 4 or 8 bits")
    return TIERS[name]


def precision_order(tier: Tier) -> tuple[int, int]:
    """Sort key of a tier set, most precise first (more bits, then the registry's order)."""
    return -tier.bits, list(TIERS).index(tier.name)


def get_tiers(names: list[str] | tuple[str, ...], target: str = "ort", group_size: int | None = None) -> list[Tier]:
    """Resolve tier names, most precise first, checking the target runtime takes them."""
    tiers = []
    for name in names:
        key = name.strip().lower()
        if key not in TIERS:
            raise TierError(f"unknown tier '{name}'; known tiers: {', '.join(TIERS)}")
        tier = TIERS[key]
        if target not in tier.runtimes:
            raise TierError(
                f"tier '{tier.name}' cannot run on target '{target}' (it runs on: {', '.join(sorted(tier.runtimes))})"
            )
        if target == "trt" and tier.name == "int4" and group_size not in TRT_BLOCK_SIZES:
            raise TierError(
                f"TensorRT runs INT4 weights only in blocks of {' or '.join(map(str, TRT_BLOCK_SIZES))}; "
                "pass --group-size 64 or 128"
            )
        tiers.append(tier)
    if not tiers:
        raise TierError("no tiers given")
    return sorted(dict.fromkeys(tiers), key=precision_order)


def ladder_opset(tiers: list[Tier], dtypes: set[str], blockwise: bool) -> int:
    """The highest opset any of `tiers`' stored forms of weights of `dtypes` can need (several tiers: a unit split
    over them joins its parts with Concat, opset 11): an export that must write at one opset decided up front."""
    return max([11 if len(tiers) > 1 else 1] + [t.opset_for(d, blockwise) for t in tiers for d in dtypes])
