"""What an encoding pass did, for allocation records and the notes a user reads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from tiers.hessian import THIN_ROWS_PER_INPUT
from tqsdeploy.units import called


@dataclass
class EncoderLog:
    """What the encoder did, for allocation records."""

    calibration_s: float = 0.0
    encode_s: float = 0.0
    passes: list[str] = field(default_factory=list)
    rtn_only: dict[str, str] = field(default_factory=dict)
    """Weights rounded to nearest whatever the method, and why."""
    thin: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Weights calibrated on too few rows: (rows, input width) (`calibrate.thin_note`)."""
    errors: dict[str, float] = field(default_factory=dict)
    """‖X̂W − X̂Q‖_F per calibrated weight (with `track_errors`)."""
    rtn_errors: dict[str, float] = field(default_factory=dict)
    """The same for round to nearest on the same grid."""
    reused: int = 0
    """Weights of calibrated passes read from checkpoints instead of encoded (a resumed export)."""


@dataclass
class CalibrationLog:
    """What a calibration pass did, for reports."""

    seconds: float = 0.0
    rows: dict[str, int] = field(default_factory=dict)
    """Calibration rows (samples) behind each weight's statistics."""
    thin: dict[str, int] = field(default_factory=dict)
    """Weights that saw fewer rows than twice their input width (rank-deficient Hessians), with that width."""


def thin_note(
    thin: Mapping[str, tuple[int, int]],
    method: str,
    remedy: str,
    windows: int | None = None,
    labels: Mapping[str, str] | None = None,
) -> str | None:
    """Weights that saw too few calibration rows (`EncoderLog.thin`: name -> (rows, input width)) in a
    newcomer's words: what the rows are, how few, and what to do (`remedy`); None when there are none. With the
    number of context `windows` the rows came from, also how many windows would give the thinnest weight the rows it
    needs (twice its input width, at the rows each window gave it). `labels`: what reports call each weight."""
    if not thin:
        return None
    name, (rows, width) = min(thin.items(), key=lambda item: item[1][0] / item[1][1])
    enough = ""
    if windows and rows:
        needed = math.ceil(THIN_ROWS_PER_INPUT * width * windows / rows)
        enough = (
            f"; at the {rows / windows:.3g} vectors each window gave it, about {needed:,} windows (now {windows:,}) "
            f"would give it the {THIN_ROWS_PER_INPUT * width:,} it needs and remove this note"
        )
    return (
        f"{len(thin)} weight(s) had too little calibration data for {method}: it fits each weight's rounding to the "
        "inputs "
        "the weight saw (one vector per window, step and position of the contexts), and these saw fewer vectors "
        "than twice "
        f"their input size (fewest: {called(name, (labels or {}).get(name, name))}, {rows} for {width} inputs), "
        "so their statistics were shrunk toward rounding to nearest, the further the fewer the vectors (codes "
        f"fitted to a few windows alone drift more on others){enough}; {remedy}"
    )
