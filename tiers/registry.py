"""The precision tiers: what each stores, on which grid, for which runtimes.

A tier is a frozen spec. Float tiers keep the weight as a float (narrower
float + Cast); integer tiers store codes on the tier's grid (`tiers.grid`)
behind DequantizeLinear, symmetric (INT codes, no zero point: what TensorRT
runs) or asymmetric (UINT codes + zero points: the grid every GPTQ-family
reference uses, and the better one at 2 to 4 bits); fp8 stores E4M3 codes;
int1 stores packed sign bits. How the codes are chosen (round to nearest,
GPTQ, GPTAQ, QEP) is a separate axis: `tiers.quantizer`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiers.grid import GridSpec


@dataclass(frozen=True)
class Tier:
    """One precision tier."""

    name: str
    bits: int
    family: str
    """'float' (fp32/bf16/fp16), 'int', 'fp8' or 'binary'."""
    runtimes: frozenset[str]
    opset: int
    """Lowest ONNX opset its stored form needs."""
    symmetric: bool = True
    """Integer tiers: signed codes without zero point; False: unsigned codes with a zero point per scale."""

    @property
    def quantized(self) -> bool:
        """Stores codes on a grid (as opposed to a float copy of the weight)."""
        return self.family != "float"

    @property
    def calibratable(self) -> bool:
        """GPTQ, GPTAQ and QEP can choose its codes (integer and sign grids)."""
        return self.family in ("int", "binary")

    @property
    def grid(self) -> GridSpec:
        if self.family == "binary":
            return GridSpec("sign", 1)
        if self.family == "fp8":
            return GridSpec("fp8", 8)
        return GridSpec("int", self.bits, self.symmetric, search=self.bits <= 4)

    @property
    def container_bits(self) -> int:
        """Bits each code takes on disk (3-bit codes travel in 4-bit containers)."""
        return {3: 4}.get(self.bits, self.bits)


def _int(bits: int, symmetric: bool, runtimes: set[str]) -> Tier:
    name = f"int{bits}" + ("" if symmetric else "-asym")
    return Tier(name, bits, "int", frozenset(runtimes), {8: 13, 4: 21, 3: 21, 2: 25}[bits], symmetric)


TIERS: dict[str, Tier] = {
    t.name: t
    for t in (
        Tier("fp32", 32, "float", frozenset({"ort", "trt"}), 1),
        Tier("bf16", 16, "float", frozenset({"ort", "trt"}), 13),
        Tier("fp16", 16, "float", frozenset({"ort", "trt"}), 1),
        Tier("fp8", 8, "fp8", frozenset({"ort", "trt"}), 19),
        _int(8, True, {"ort", "trt"}),
        _int(8, False, {"ort"}),
        _int(4, True, {"ort", "trt"}),
        _int(4, False, {"ort"}),
        _int(3, True, {"ort"}),
        _int(3, False, {"ort"}),
        _int(2, True, {"ort"}),
        _int(2, False, {"ort"}),
        Tier("int1", 1, "binary", frozenset({"ort"}), 18),
    )
}
"""Built-in tiers by name, from most to least precise."""

DEFAULT_TIERS = ("fp32", "bf16", "int8-asym", "int4-asym", "int2-asym")
"""The paper's five-tier ladder (FP32, BF16, INT8, INT4, INT2) on asymmetric grids, which beat
symmetric ones at 2-4 bits on every example (benchmarks/results/grids.md)."""

TRT_TIERS = ("fp32", "bf16", "int8", "int4")
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


def get_tiers(names: list[str] | tuple[str, ...], target: str = "ort", group_size: int | None = None) -> list[Tier]:
    """Resolve tier names, most precise first, checking the target runtime takes them."""
    tiers = []
    for name in names:
        key = name.strip().lower()
        if key not in TIERS:
            raise TierError(f"unknown tier '{name}'; known tiers: {', '.join(TIERS)}")
        tier = TIERS[key]
        if target not in tier.runtimes:
            raise TierError(f"tier '{tier.name}' cannot run on target '{target}' (it runs on: {', '.join(sorted(tier.runtimes))})")
        if target == "trt" and tier.name == "int4" and group_size not in TRT_BLOCK_SIZES:
            raise TierError(f"TensorRT runs INT4 weights only in blocks of {' or '.join(map(str, TRT_BLOCK_SIZES))}; pass --group-size 64 or 128")
        tiers.append(tier)
    if not tiers:
        raise TierError("no tiers given")
    order = list(TIERS)
    return sorted(dict.fromkeys(tiers), key=lambda t: (-t.bits, order.index(t.name)))
