"""Writing the shipped candidate: the ONNX file, its allocation record, and the notes a user should read.

`Writer` writes what the comparison chose (or one uniform model) and reports the file's compression as the size
owner counts it (`tqsdeploy.size`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

import graph_ops
from graph_ops.qdq import Written, write_storage
from runtimes.ort_versions import oldest_release, version_text
from tiers import TIERS, Encoded, get_tiers
from tiers.solver_backend import array_module, solver_dtype
from tqsdeploy.encoding import checkpoints
from tqsdeploy.encoding.logs import thin_note
from tqsdeploy.errors import InputError
from tqsdeploy.export.allocate import Allocation
from tqsdeploy.export.bounds import slowdown_record
from tqsdeploy.export.candidates import MIXED, OTHER_METHOD_MARGIN, Candidate, explain, rank
from tqsdeploy.export.deployed import DeployedMemory, timed_against_original
from tqsdeploy.export.job import ExportJob
from tqsdeploy.export.roundings import Roundings
from tqsdeploy.export.validation import Validation
from tqsdeploy.files import write_json, write_table
from tqsdeploy.sweep import Drift
from tqsdeploy.units import called, outside_hint

WARN_DRIFT_PCT = 5.0
"""Drift (percent, as `eval` reports it) above which export warns that the model it wrote may be damaged."""
BASIS_GAP = 1.5
"""Export notes when the units are compressed more than this many times as much as the file (`Writer.basis_note`)."""


@dataclass
class Outcome:
    """One exported model and how it was chosen."""

    allocation: Allocation
    path: Path
    file_bytes: int
    compression: float
    """Reference stored-tensor bits / exported stored-tensor bits, counted on the file (what eval and gate report)."""
    unit_compression: float
    """The same over the scored units only (the paper's C)."""
    drift: Drift | None
    shipped: str
    compared: list[dict]
    table: pl.DataFrame
    encodings: dict[str, Encoded] = field(default_factory=dict)
    """What the file stores per unit tensor."""
    notes: list[str] = field(default_factory=list)
    files: tuple[Path, ...] = ()
    """What was written: the model, then its external-data file when it has one (ship them together)."""
    refused: str | None = None
    """Why nothing was written (the drift exceeded `max_drift_pct`); None when the model was written."""
    layout: str = "fused"
    """The runtime layout written (`ExportSettings.layout`)."""
    memory_bytes: int | None = None
    """About the weight bytes a session holds after loading the file (`Writer.loaded_weight_bytes`)."""
    profile: dict[str, float] = field(default_factory=dict)
    """Seconds of this export by kind of work (`tqsdeploy.encoding.profiling`), as its allocation record keeps them."""
    rounding: dict[str, str] = field(default_factory=dict)
    """The rounding method of each calibratable tier the file stores."""
    opsets: tuple[int, int] = (0, 0)
    """(the model's, the file's) default-domain opset: a conversion can change a kernel's speed."""
    runs_as: dict[str, str] = field(default_factory=dict)
    """What ONNX Runtime runs for each unit tensor (`WeightForms.runs_as`)."""
    session_memory: dict | None = None
    """The session's peak and steady memory in a fresh process beside the original's (`DeployedMemory`)."""
    oldest_release: str | None = None
    """The oldest ONNX Runtime release that loads the file, in words (`runtimes.ort_versions.oldest_release`): "1.23
    or later (a Cast from 4-bit codes)"."""
    cache: dict | None = None
    """What this export read from the run's cache and added to it, by kind (`RunCache.since`); None: no cache."""
    chosen_on: dict | None = None
    """Which windows chose between the candidates (the allocation JSON's `chosen_on`)."""
    budget: dict | None = None
    """`export --max-drift` without --C: the search and what it tried (the allocation JSON's `budget`)."""
    bounds: dict | None = None
    """`export --max-memory`/`--max-slowdown`: asked, priced, measured, met (the allocation JSON's `bounds`)."""

    def fake_quantized(self) -> dict[str, np.ndarray]:
        """The weights the runtime computes from the file (exact dequantization)."""
        return {name: e.dequantize() for name, e in self.encodings.items()}

    @property
    def drift_pct(self) -> float | None:
        return None if self.drift is None else self.drift.worst_pct


def explained(windows: int, labels: list[str]) -> dict[str, str]:
    """What the allocation record's figures mean, for a reader of the JSON alone."""
    return {
        "compression": "the original's stored tensor bits over this file's (initializers and Constant values, scales "
        "and zero points included): what --C counts with --basis file",
        "unit_compression": "the same over the scored units alone (--basis units)",
        "disk_compression": "bytes on disk, the original's files over this file's (external data included): the "
        "graph and protobuf framing count here, so it differs from compression",
        "drift_pct": f"the worst output's mean |exported - original| as % of mean |original|, exact dequantization, "
        f"on the {windows} scoring windows: in-sample (the score and the calibration saw them); held-out windows "
        "usually drift more (tqsdeploy eval)",
        "slot": "what one tier is given to (a row of `tiers`): a whole unit, or a group of output channels of a unit "
        "holding a large share of the parameters (--split); `label` is what reports call it, `slot` and `unit` its "
        "ONNX names",
        "compared": explain(labels),
    }


class Writer:
    """Writes an export's chosen candidate and what to say about it."""

    def __init__(self, job: ExportJob, roundings: Roundings, deployed: DeployedMemory | None = None):
        """`deployed`: measures each written model's session memory (None: not measured)."""
        self.job, self.roundings, self.deployed = job, roundings, deployed
        self.scored, self.settings, self.encoder = job.scored, job.settings, job.encoder

    def close(self) -> None:
        if self.deployed is not None:
            self.deployed.close()

    def outputs_identity(self) -> str:
        """What an output file depends on: the calibration passes' identity and the settings."""
        return self.encoder.checkpoints[1] + json.dumps(asdict(self.settings), sort_keys=True, default=str)

    def write(self, encodings: dict[str, Encoded], path: Path, external_data: bool | None = None) -> Written:
        """Write the model atomically (large ones stream into external data)."""
        weights = self.scored.weights
        stored = {name: e for name, e in encodings.items() if not (e.form == "raw" and e.values is weights.get(name))}
        if external_data is None and self.settings.single_file:
            external_data = False
        with self.encoder.profile.section("write"):
            if (
                self.encoder.checkpoints is not None
            ):  # resumable: a rerun after an interruption may overwrite what this began
                checkpoints.record_output(self.scored.run_dir, self.outputs_identity(), path)
            return write_storage(
                self.scored.model.proto,
                stored,
                path,
                external_data=external_data,
                source=self.scored.prepared.data_dir,
                layout={name: self.job.forms.layout_of(e) for name, e in stored.items()},
                opset=self.scored.opset,
                native=self.job.forms.plans(stored),
            )

    def check_single_file(self, targets: list[float | None], uniform_tier: str | None = None) -> None:
        """With `single_file`, refuse before any work an output that cannot fit one file (protobuf's 2 GiB): its size
        estimated from the budget, or for a uniform tier from the tier's bits."""
        if not self.settings.single_file:
            return
        sizes = self.scored.sizes
        for target in targets:
            if target is None:
                tier = get_tiers([uniform_tier], self.settings.runtime, self.settings.group_size)[0]
                bits = sizes.outside_bits + sum(u.params for u in self.scored.units) * tier.bits
            else:
                bits = min(sizes.reference_bits, sizes.file_bits(target, self.settings.basis))
            if bits / 8 >= graph_ops.io.PROTOBUF_LIMIT:
                raise InputError(
                    f"--single-file: the model would hold about {bits / 8 / 2**30:.2f} GiB, past protobuf's 2 GiB "
                    "limit for one .onnx file",
                    hint="drop --single-file: the weights then go to an external-data file beside it",
                )

    def notes(
        self,
        chosen: Candidate,
        compared: list[Candidate],
        uniform_tier: str | None,
        overshoot: str | None,
        validation: Validation | None = None,
        folded: str | None = None,
    ) -> list[str]:
        """What the user should know about the shipped model, in the order the summary prints them; `folded`: how
        the folds of `export --select kfold` chose it (said instead of the scoring contexts' comparison)."""
        notes: list[str] = [folded] if folded is not None else []
        if not chosen.label.startswith(MIXED) and uniform_tier is None and folded is None:
            mixed = next(c for c in compared if c.label.startswith(MIXED))
            where, (own, other) = "scoring contexts", (chosen.drift.worst_pct, mixed.drift.worst_pct)
            if validation is not None and validation.known(chosen) and validation.known(mixed):
                where, (own, other) = "validation windows", (validation.known(chosen).pct, validation.known(mixed).pct)
            notes.append(
                f"shipped {chosen.label} instead of the mixed allocation: at this budget it drifts less on the "
                f"{where} "
                f"({own:.4g}% vs {other:.4g}% for the mixed one at "
                f"{mixed.allocation.compression:.3g}x); "
                "--no-fallback ships the mixed one"
            )
        if validation is not None and len(compared) > 1:
            notes.append(validation.note(chosen, compared))
        chosen_on_scoring = validation is None and folded is None and uniform_tier is None
        passed = [c for c in compared if rank(c) < rank(chosen)] if chosen_on_scoring else []
        if passed:  # ranked ahead on drift, kept behind by the margin (`candidates.preferred`)
            notes.append(
                f"{passed[0].label} drifted {passed[0].drift.worst_pct:.4g}% on the scoring contexts, less than the "
                f"shipped model's {chosen.drift.worst_pct:.4g}% but by under {OTHER_METHOD_MARGIN:.0%}: a uniform "
                "model of another rounding method than the export's ships only past that margin (fitted to the "
                "same windows, their order there is mostly calibration noise); --validate FILE chooses on windows "
                "neither saw"
            )
        if overshoot is not None:
            notes.append(overshoot)
        notes += self._untested_rows(chosen)
        side = [
            o.name for o in self.scored.model.proto.graph.output if o.name not in self.scored.prepared.spec.trajectory
        ]
        if side and self.scored.dead and uniform_tier is None:
            notes.append(
                f"{len(self.scored.dead)} unit(s) left the trajectory unchanged and went to the lowest tier; the "
                f"outputs outside it ({', '.join(side)}) "
                "were not measured and may read them: name those outputs in the rollout spec's `trajectory` to "
                "protect them "
                "(`tqsdeploy eval` reports their drift)"
            )
        # a uniform model's own rounding: asking the export's could measure every tier
        calibrated = chosen.cached[1].needs_stats if chosen.cached else self.roundings.rounding.needs_stats
        if calibrated:
            notes += [
                f"{self.called(name)} is rounded to nearest whatever the method: {reason}"
                for name, reason in sorted(self.encoder.log.rtn_only.items())
            ]
        thin = thin_note(
            self.encoder.log.thin,
            self.settings.rounding,
            "score with more context windows (or more --steps) to give it more, or export with --rounding rtn, which "
            "needs none",
            self.scored.prepared.contexts.count,
            {name: layout.display for name, layout in self.scored.layouts.items()},
        )
        if thin and calibrated:
            notes.append(thin)
        return notes

    def called(self, name: str) -> str:
        """A unit tensor as notes name it: its label, with its ONNX name where they differ (`units.called`)."""
        layout = self.scored.layouts.get(name)
        return called(name, layout.display if layout is not None else name)

    def _untested_rows(self, chosen: Candidate) -> list[str]:
        """A Gather table whose rows the scoring contexts read only in part: the rest is stored untested."""
        notes = []
        for name, touched in sorted(self.scored.prepared.job.rows.items()):
            tiers = sorted(
                {
                    chosen.allocation.tiers[s.name]
                    for s in self.job.cut.slots
                    if name in self.scored.units_by_name[s.unit].tensor_names
                }
            )
            notes.append(
                f"{self.called(name)}: the scoring contexts read {len(touched)} of its "
                f"{self.scored.weights[name].shape[0]} rows; it was scored and measured on those, "
                f"and the other rows, priced as its read rows on average, are stored untested ({', '.join(tiers)} in "
                "the table): rows a deployment "
                "reads that the contexts never did may be hurt more"
            )
        return notes

    def refused(
        self,
        chosen: Candidate,
        compared: list[Candidate],
        path: Path,
        notes: list[str],
        max_drift_pct: float,
        validation: Validation | None = None,
    ) -> Outcome:
        """Nothing written: the chosen model drifts more than `max_drift_pct` (on the validation windows when given,
        else on the scoring contexts)."""
        measured = validation.known(chosen) if validation is not None else None
        if measured is not None:
            judged = "the upper end of its 95% interval" if validation.on == "upper" else "the estimate"
            how = f"{measured.text()} on the {validation.windows} validation windows ({judged} judged)"
        else:
            how = f"{chosen.drift.worst_pct:.4g}% on the scoring contexts"
        refused = f"{path} not written: it drifts {how} from the original, above --max-drift {max_drift_pct:g}%"
        return Outcome(
            chosen.allocation,
            path,
            0,
            math.nan,
            math.nan,
            chosen.drift,
            chosen.label,
            [c.record() for c in compared],
            self.table(chosen.allocation),
            chosen.encodings,
            notes,
            refused=refused,
        )

    def ship(
        self,
        chosen: Candidate,
        compared: list[Candidate],
        target: float | None,
        path: Path,
        notes: list[str],
        uniform_tier: str | None,
        clock: tuple[float, dict, dict | None],
        extra: dict | None = None,
    ) -> Outcome:
        """Write `chosen` to `path` with its allocation record (.parquet and .json, `extra`'s fields added) beside
        it; `clock`: when the export of this target began, and the encoder's profile and the cache's counts
        then."""
        stem = path.with_suffix("")
        for record in (Path(f"{stem}.allocation.json"), Path(f"{stem}.allocation.parquet")):
            record.unlink(
                missing_ok=True
            )  # a kill before the new record lands leaves a model without one, never a mismatched pair
        written = self.write(chosen.encodings, path)
        unit_bits = sum(self.job.forms.bits(name, e) for name, e in chosen.encodings.items())
        record = self.scored.sizes.record(written, unit_bits, self.settings.layout)
        compression, unit_compression = record["compression"], record["unit_compression"]
        if (
            target is not None
            and uniform_tier is None
            and self.settings.basis == "file"
            and unit_compression > BASIS_GAP * compression
        ):
            notes.insert(0, self.basis_note(target, compression, unit_compression, chosen.allocation))
        table = self.table(chosen.allocation)
        rounding = self.rounding_by_tier(chosen)
        loads_on, why = oldest_release(graph_ops.load_model(path, load_external=False).proto)
        runs_as = {name: self.job.forms.runs_as(name, e) for name, e in sorted(chosen.encodings.items())}
        summary = self._summary(chosen, compared, target, record, written, notes, uniform_tier, clock) | {
            "rounding_by_tier": rounding,
            "runs_as": runs_as,
            "oldest_onnxruntime": {"release": version_text(loads_on), "because": why},
            "session_memory": self.deployed.measure(path) if self.deployed is not None else None,
            **(extra or {}),
        }
        summary["bounds"] = self.bounds(chosen, path, summary["session_memory"])
        summary["tiers"] = table.rows(named=True)
        write_table(table, f"{stem}.allocation.parquet")
        write_json(f"{stem}.allocation.json", summary)
        return Outcome(
            chosen.allocation,
            path,
            written.bytes,
            compression,
            unit_compression,
            chosen.drift,
            chosen.label,
            [c.record() for c in compared],
            table,
            chosen.encodings,
            notes,
            written.files,
            layout=self.settings.layout,
            memory_bytes=summary["weights_in_memory_bytes"],
            profile=summary["profile_s"],
            cache=summary["cache"],
            rounding=rounding,
            opsets=(self.scored.model_opset, written.opset),
            runs_as=runs_as,
            oldest_release=f"{version_text(loads_on)} or later" + (f" ({'; '.join(why)})" if why else ""),
            session_memory=summary["session_memory"],
            chosen_on=summary.get("chosen_on"),
            budget=summary.get("budget"),
            bounds=summary["bounds"],
        )

    def bounds(self, chosen: Candidate, path: Path, session_memory: dict | None) -> dict | None:
        """The allocation JSON's `bounds` (`export.bounds`): each bound asked, as priced and as measured, and whether
        it was met; None when none was asked."""
        found = {}
        if self.job.memory is not None:
            slot_bytes = self.loaded_weight_bytes(chosen.encodings) - self.scored.sizes.outside_bits // 8
            peak = session_memory["peak_bytes"] if session_memory else None
            found["memory"] = self.job.memory.record(slot_bytes, peak)
        if self.settings.max_slowdown is not None:
            found["slowdown"] = slowdown_record(self.settings.max_slowdown, timed_against_original(self.scored, path))
        return found or None

    def _summary(
        self,
        chosen: Candidate,
        compared: list[Candidate],
        target: float | None,
        record: dict,
        written: Written,
        notes: list[str],
        uniform_tier: str | None,
        clock: tuple[float, dict, dict | None],
    ) -> dict:
        """The allocation record's fields, in the order the JSON keeps them."""
        started, profiled, _ = clock
        drift = chosen.drift
        return {
            "model": str(self.scored.model.path),
            "run": str(self.scored.run_dir),
            "target_compression": target,
            "basis": self.settings.basis,
            **record,
            "reference_file_bytes": self.scored.model.file_bytes,
            "disk_compression": self.scored.model.file_bytes / max(written.bytes, 1),
            "target": self.settings.target,
            "weights_in_memory_bytes": self.loaded_weight_bytes(chosen.encodings),
            "opset": {"model": self.scored.model_opset, "file": written.opset},
            "objective": chosen.allocation.objective,
            "rounding": chosen.label.split()[-1] if uniform_tier is not None else self.roundings.rounding.method,
            "rounding_by_tier": None,
            "rounding_choice": self.roundings.choice,
            "solver": chosen.allocation.solver,
            "shipped": chosen.label,
            "settings": asdict(self.settings),
            "drift_pct": drift.worst_pct if drift else None,
            "drift_pct_by_output": drift.pct if drift else None,
            "relative_rms_drift": drift.relative_rms if drift else None,
            "drift_windows": self.scored.prepared.contexts.count,
            "units": len(self.scored.units),
            "slots": len(self.job.cut.slots),
            "explained": explained(self.scored.prepared.contexts.count, [c.label for c in compared]),
            "compared": [c.record() for c in compared],
            "notes": notes,
            "cache": self.job.cache.since(clock[2]) if self.job.cache is not None else None,
            "timings_s": {
                **{k: round(v, 3) for k, v in self.job.timings.items()},
                "calibration": round(self.encoder.log.calibration_s, 3),
                "total": round(time.perf_counter() - started, 3),
            },
            "profile_s": self.encoder.profile.split(profiled, time.perf_counter() - started),
            "solver_arrays": array_module().__name__,
            "solver_dtype": solver_dtype(),
            "tiers": None,
        }

    def basis_note(self, target: float, compression: float, unit_compression: float, allocation: Allocation) -> str:
        """Why C of the file pushed the units much further: the tensors that are not units stay at full size and take
        the budget; what they cost and what `--basis units` gives at the same C."""
        scored = self.scored
        names = {n for u in scored.units for n in u.tensor_names}
        others = [n for n in graph_ops.io.tensor_sizes(scored.model.proto) if n not in names]
        fixed = scored.sizes.outside_bits
        min_params = scored.scores.selection.min_params
        lowest = min(allocation.tiers.values(), key=lambda tier: TIERS[tier].bits)
        count = sum(t == lowest for t in allocation.tiers.values())
        units_file = scored.sizes.file_compression(scored.sizes.file_bits(target, "units"))
        large = outside_hint(scored.model.proto, names, scored.scores.selection)
        which = "" if large else f" smaller than --min-params {min_params} or not weight operands"
        return (
            f"compression {compression:.3g}x of the file took the units to {unit_compression:.3g}x ({lowest} on "
            f"{count} of {len(allocation.tiers)} slots): "
            f"{fixed / scored.reference_bits:.1%} of the stored bits ({fixed / 8:,.0f} bytes in {len(others)} "
            f"tensors{which}) are not units "
            f"and stay at full size; --basis units --C {target:g} compresses the units {target:g}x and the file "
            f"about {units_file:.3g}x "
            "(check the drift of both), or "
            + (large if large else "score with a lower --min-params (or --include) to quantize those tensors")
        )

    def table(self, allocation: Allocation) -> pl.DataFrame:
        rows = []
        for slot in self.job.cut.slots:
            tier = allocation.tiers[slot.name]
            rows.append(
                {
                    "slot": slot.name,
                    "label": slot.display,
                    "unit": slot.unit,
                    "channels": None if slot.rows is None else f"{slot.rows[0]}:{slot.rows[1]}",
                    "tier": tier,
                    "bits": TIERS[tier].bits,
                    "params": slot.params,
                    "bytes": -(-allocation.cost_bits[slot.name] // 8),
                    "gamma": self.scored.gamma.get(slot.unit),
                    "dead": slot.unit in self.scored.dead,
                }
            )
        return pl.DataFrame(rows)

    def rounding_by_tier(self, chosen: Candidate) -> dict[str, str]:
        """The method that rounded each calibratable tier of the shipped candidate: a uniform one's own, else the "
        "export's."""
        if chosen.cached is not None:
            tier, rounding = chosen.cached
            return {tier: rounding.label} if TIERS[tier].calibratable else {}
        return {
            tier: self.roundings.at(tier).label
            for tier in sorted(set(chosen.allocation.tiers.values()))
            if TIERS[tier].calibratable
        }

    def loaded_weight_bytes(self, encodings: dict[str, Encoded]) -> int:
        """About how many bytes of weights an ONNX Runtime session of the written model holds after load: the
        tensors outside the units as stored, each unit tensor as `WeightForms.resident_bytes` prices it."""
        forms = self.job.forms
        return self.scored.sizes.outside_bits // 8 + sum(forms.resident_bytes(n, e) for n, e in encodings.items())
