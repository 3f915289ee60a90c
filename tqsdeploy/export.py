"""`export`: from a score run to deployable mixed-precision ONNX models.

`Planner` opens a score run folder (which holds everything needed: model path
and hash, rollout spec, contexts, unit selection), prices every unit at every
tier, allocates for each requested compression, checks the result against
uniform allocations by measurement, and writes the model.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import polars as pl

import graph_ops
from graph_ops.qdq import write_storage
from runtimes import OrtRuntime
from tiers import DEFAULT_TIERS, TIERS, Layout, Stored, Tier, get_tiers
from tqsdeploy.allocate import OBJECTIVES, Allocation, Choice, allocate, paper_weights, uniform
from tqsdeploy.errors import InfeasibleError, InputError
from tqsdeploy.probes import tier_probe, tier_weights
from tqsdeploy.score import Prepared, ScoreTable, prepare
from tqsdeploy.scoring import ScoreSettings
from tqsdeploy.sweep import ResultLog, SweepRunner, Task, TaskResult
from tqsdeploy.units import Unit, UnitSelection


@dataclass(frozen=True)
class ExportSettings:
    """How to allocate and store."""

    tiers: tuple[str, ...] = DEFAULT_TIERS
    target: str = "ort"
    group_size: int | None = None
    objective: str = "measured"
    fp32_fraction: float = 0.10
    allocator: str = "mckp"
    fallback: bool = True
    refine: int = 0


@dataclass
class Outcome:
    """One exported model and how it was chosen."""

    allocation: Allocation
    path: Path
    file_bytes: int
    drift: float | None
    uniform_drifts: dict[str, float]
    fell_back_to: str | None
    table: pl.DataFrame


def find_run(model: Path | None, run: Path | None) -> Path:
    """The run folder: given, else tqs-runs/<model stem>, else the newest finished run."""
    if run is not None:
        return run
    if model is not None:
        return Path("tqs-runs") / model.stem
    runs = sorted(Path("tqs-runs").glob("*/run.json"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise InputError("no score run found in tqs-runs/", hint="run `tqsdeploy score MODEL` first or pass --run DIR")
    return runs[-1].parent


class Planner:
    """Everything needed to allocate and export for one score run."""

    def __init__(self, run_dir: Path, model: Path | None = None, settings: ExportSettings = ExportSettings(), runtime: OrtRuntime = OrtRuntime()):
        self.run_dir = Path(run_dir)
        self.scores = ScoreTable.load(self.run_dir)
        if not self.scores.complete:
            raise InputError(f"the score run in {self.run_dir} did not finish", hint="run the same score command again to resume it")
        meta = self.scores.meta
        model = Path(model) if model is not None else Path(meta["model"]["path"])
        self.settings = settings
        self.tiers: list[Tier] = get_tiers(list(settings.tiers), settings.target, settings.group_size)
        if settings.objective not in OBJECTIVES:
            raise InputError(f"unknown objective '{settings.objective}'; choose one of {', '.join(OBJECTIVES)}")
        selection = UnitSelection(**meta["selection"])
        probe = dict(meta["probe"])
        probe["horizons"] = tuple(probe["horizons"]) if probe.get("horizons") else None
        self.prepared: Prepared = prepare(
            model,
            self.run_dir / "contexts.npz",
            self.run_dir / "rollout.toml",
            selection=selection,
            settings=ScoreSettings(**probe),
            runtime=runtime,
            strategy=meta.get("strategy", "auto"),
        )
        if self.prepared.model.sha256 != meta["model"]["sha256"]:
            raise InputError(f"the score run in {self.run_dir} was made for a different model than {model} (hash mismatch)", hint="score this model first")
        self.model = self.prepared.model
        self.units: list[Unit] = self.prepared.units
        self.weights = self.prepared.job.weights
        self.steps = self.prepared.spec.steps
        self.frame = self.scores.frame
        self.gamma = dict(zip(self.frame["unit"], self.frame["gamma"]))
        self.dead = set(self.frame.filter(pl.col("dead"))["unit"])
        if set(self.gamma) != {u.name for u in self.units}:
            raise InputError(f"the score run in {self.run_dir} scored other units than this model has now")
        unit_tensors = {n for u in self.units for n in u.tensor_names}
        sizes = graph_ops.io.tensor_sizes(self.model.proto)
        self.reference_bits = sum(sizes.values())
        self.fixed_bits = sum(bits for name, bits in sizes.items() if name not in unit_tensors)
        self._runner: SweepRunner | None = None
        self._measured: dict[str, TaskResult] | None = None
        self._choices: dict[str, list[Choice]] = {}

    # -- pricing -----------------------------------------------------------

    def layout(self, tensor) -> Layout:
        return Layout(tensor.shape, tensor.channel_axis)

    @staticmethod
    def keeps(tier: Tier, tensor) -> bool:
        """A float tier at least as wide as the stored type leaves the tensor as it is."""
        return tier.family == "float" and tier.bits >= 8 * np.dtype(tensor.dtype).itemsize

    def cost(self, unit: Unit, tier: Tier) -> int:
        return sum(
            t.params * 8 * np.dtype(t.dtype).itemsize if self.keeps(tier, t) else tier.cost_bits(self.layout(t), self.settings.group_size)
            for t in unit.tensors
        )

    @property
    def runner(self) -> SweepRunner:
        if self._runner is None:
            self._runner = self.prepared.open_runner()
        return self._runner

    def measured(self, on_result=None) -> dict[str, TaskResult]:
        """Per unit and tier, the rollout divergence with only that unit at that tier.
        Cached in the run folder, so every C and every export reuses it."""
        if self._measured is not None:
            return self._measured
        log = ResultLog(self.run_dir / "measured.jsonl")
        done = log.load()
        tasks = [
            Task(u.name, tier_probe(t.name, self.settings.group_size))
            for u in self.units
            for t in self.tiers
            if t.name != "fp32"
        ]
        try:
            for task in tasks:
                if task.key in done:
                    continue
                result = self.runner.run(task)
                log.append(result)
                done[task.key] = result
                if on_result:
                    on_result(result)
        finally:
            log.close()
        self._measured = done
        return done

    def measured_tasks(self) -> int:
        return sum(1 for _ in self.units for t in self.tiers if t.name != "fp32")

    def choices(self, objective: str, on_result=None) -> list[Choice]:
        """Cost and loss of every unit at every tier; computed once per objective,
        so exporting many targets prices (and, for 'response', quantizes) once."""
        if objective not in self._choices:
            self._choices[objective] = self._price(objective, on_result)
        return self._choices[objective]

    def _price(self, objective: str, on_result=None) -> list[Choice]:
        weights = paper_weights(self.gamma, self.dead)
        measured = self.measured(on_result) if objective == "measured" else None
        choices = []
        for unit in self.units:
            cost = {t.name: self.cost(unit, t) for t in self.tiers}
            loss = {}
            for tier in self.tiers:
                if objective == "paper":
                    loss[tier.name] = weights[unit.name] * 2.0 ** (-tier.bits)
                elif objective == "response":
                    gamma = self.gamma[unit.name]
                    gain = 0.0 if unit.name in self.dead else math.exp(min(self.steps * gamma, 700.0))
                    quantized = tier_weights(unit, self.weights, tier.name, self.settings.group_size)
                    loss[tier.name] = gain * sum(float(np.sum(np.square(quantized[n].astype(np.float64) - self.weights[n]))) for n in quantized)
                else:
                    result = measured.get(Task(unit.name, tier_probe(tier.name, self.settings.group_size)).key)
                    loss[tier.name] = 0.0 if result is None else (math.inf if result.nonfinite else float(sum(result.div_sq)))
            choices.append(Choice(unit.name, unit.params, self.gamma.get(unit.name, 0.0), unit.name in self.dead, cost, loss))
        return choices

    def max_compression(self) -> float:
        """The largest compression reachable with these tiers (every unit at its cheapest)."""
        cheapest = sum(min(self.cost(u, t) for t in self.tiers) for u in self.units)
        return self.reference_bits / (self.fixed_bits + cheapest)

    def check_targets(self, targets: list[float]) -> None:
        """Fail before any work when a target cannot be met."""
        best = self.max_compression()
        for target in targets:
            if target > best:
                raise InfeasibleError(
                    f"compression {target:g} is out of reach with tiers {', '.join(t.name for t in self.tiers)}: the largest reachable is {best:.3g}",
                    hint="lower --C or add a cheaper tier",
                )

    # -- allocation ----------------------------------------------------------

    def fake_quantized(self, allocation: Allocation) -> dict[str, np.ndarray]:
        weights = {}
        for unit in self.units:
            weights.update(tier_weights(unit, self.weights, allocation.tiers[unit.name], self.settings.group_size))
        return weights

    def drift(self, allocation: Allocation) -> float:
        """Relative RMS trajectory drift of the allocation on the scoring contexts."""
        return self.runner.relative_drift(self.fake_quantized(allocation))

    def uniform(self, tier: str) -> Allocation:
        choices = [Choice(u.name, u.params, 0.0, False, {tier: self.cost(u, TIERS[tier])}, {tier: 0.0}) for u in self.units]
        return uniform(choices, tier, self.reference_bits, self.fixed_bits)

    def plan(self, target: float, on_result=None) -> tuple[Allocation, float | None, dict[str, float], str | None]:
        """Allocate for `target`, refine, and compare with the neighbouring uniform allocations."""
        choices = self.choices(self.settings.objective, on_result)
        allocation = allocate(
            choices,
            self.tiers,
            target,
            self.reference_bits,
            self.fixed_bits,
            objective=self.settings.objective,
            fp32_fraction=self.settings.fp32_fraction,
            solver=self.settings.allocator,
        )
        drift = None
        if self.settings.refine:
            allocation, drift = self.refine(allocation)
        if not self.settings.fallback and not self.settings.refine:
            return allocation, None, {}, None
        if drift is None:
            drift = self.drift(allocation)
        budget = self.reference_bits / target
        uniforms = sorted((self.uniform(t.name) for t in self.tiers), key=lambda a: a.total_bits)
        below = [a for a in uniforms if a.total_bits <= budget]
        above = [a for a in uniforms if a.total_bits > budget]
        neighbours = ([below[-1]] if below else []) + ([above[0]] if above else [])
        drifts = {a.tiers[self.units[0].name]: self.drift(a) for a in neighbours}
        fell_back = None
        if self.settings.fallback and below:
            best_uniform = below[-1]
            name = best_uniform.tiers[self.units[0].name]
            if drifts[name] < drift:
                allocation = best_uniform
                allocation.target = target
                allocation.solver = f"{self.settings.objective} allocation replaced by uniform {name}"
                allocation.notes.append(f"mixed allocation drifted {drift:.4g} vs uniform {name} {drifts[name]:.4g}: shipped uniform {name}")
                fell_back, drift = name, drifts[name]
        return allocation, drift, drifts, fell_back

    def refine(self, allocation: Allocation) -> tuple[Allocation, float]:
        """Spend up to `refine` joint rollouts promoting the unit whose measured
        single-unit divergence at its tier is largest, paying with the demotions
        that cost least divergence per bit; keep a move only if drift drops."""
        measured = {c.unit: c for c in self.choices("measured")}
        order = [t.name for t in self.tiers]
        budget = self.reference_bits / allocation.target
        best, best_drift = allocation, self.drift(allocation)
        tried: set[str] = set()
        for _ in range(self.settings.refine):
            tiers = dict(best.tiers)
            candidates = [u for u, t in tiers.items() if order.index(t) > 0 and u not in tried and u not in self.dead]
            if not candidates:
                break
            worst = max(candidates, key=lambda u: measured[u].loss[tiers[u]])
            tried.add(worst)
            tiers[worst] = order[order.index(tiers[worst]) - 1]
            cost = {u: measured[u].cost[t] for u, t in tiers.items()}
            while self.fixed_bits + sum(cost.values()) > budget:
                demotable = [u for u, t in tiers.items() if u != worst and order.index(t) < len(order) - 1]
                if not demotable:
                    break

                def price(u):  # divergence added per bit saved by demoting u one tier
                    t, lower = tiers[u], order[order.index(tiers[u]) + 1]
                    saved = cost[u] - measured[u].cost[lower]
                    return (measured[u].loss[lower] - measured[u].loss[t]) / max(saved, 1)

                victim = min(demotable, key=price)
                tiers[victim] = order[order.index(tiers[victim]) + 1]
                cost[victim] = measured[victim].cost[tiers[victim]]
            if self.fixed_bits + sum(cost.values()) > budget:
                continue
            candidate = Allocation(tiers, cost, best.reference_bits, best.fixed_bits, best.target, best.solver + "+refine", best.objective)
            candidate_drift = self.drift(candidate)
            if candidate_drift < best_drift:
                best, best_drift = candidate, candidate_drift
        return best, best_drift

    # -- writing ---------------------------------------------------------------

    def stored(self, allocation: Allocation) -> dict[str, Stored]:
        stored = {}
        for unit in self.units:
            tier = TIERS[allocation.tiers[unit.name]]
            for tensor in unit.tensors:
                if self.keeps(tier, tensor):
                    continue  # already stored at least this precisely
                stored[tensor.name] = tier.quantize(self.weights[tensor.name], self.layout(tensor), self.settings.group_size)
        return stored

    def table(self, allocation: Allocation) -> pl.DataFrame:
        rows = []
        for unit in self.units:
            tier = allocation.tiers[unit.name]
            rows.append(
                {
                    "unit": unit.name,
                    "tier": tier,
                    "bits": TIERS[tier].bits,
                    "params": unit.params,
                    "bytes": -(-allocation.cost_bits[unit.name] // 8),
                    "gamma": self.gamma.get(unit.name),
                    "dead": unit.name in self.dead,
                }
            )
        return pl.DataFrame(rows)

    def write(self, allocation: Allocation, path: Path, external_data: bool | None = None) -> int:
        """Write the model; large ones stream into external data. Returns bytes on disk."""
        path = write_storage(self.model.proto, self.stored(allocation), path, external_data=external_data)
        data = path.with_name(path.name + ".data")
        return path.stat().st_size + (data.stat().st_size if data.exists() else 0)

    def export(self, target: float | None, path: Path, uniform_tier: str | None = None, on_result=None) -> Outcome:
        started = time.perf_counter()
        if uniform_tier is not None:
            get_tiers([uniform_tier], self.settings.target, self.settings.group_size)
            allocation, drift, drifts, fell_back = self.uniform(uniform_tier), None, {}, None
        else:
            allocation, drift, drifts, fell_back = self.plan(target, on_result)
        size = self.write(allocation, path)
        table = self.table(allocation)
        summary = {
            "model": str(self.model.path),
            "run": str(self.run_dir),
            "output": str(path),
            "target_compression": target,
            "achieved_compression": allocation.compression,
            "reference_bytes": allocation.reference_bits / 8,
            "weight_bytes": allocation.total_bits / 8,
            "file_bytes": size,
            "objective": allocation.objective,
            "solver": allocation.solver,
            "settings": asdict(self.settings),
            "drift": drift,
            "uniform_drifts": drifts,
            "fell_back_to_uniform": fell_back,
            "notes": allocation.notes,
            "seconds": round(time.perf_counter() - started, 3),
            "tiers": table.rows(named=True),
        }
        stem = path.with_suffix("")
        table.write_parquet(f"{stem}.allocation.parquet")
        Path(f"{stem}.allocation.json").write_text(json.dumps(summary, indent=2, default=str))
        return Outcome(allocation, path, size, drift, drifts, fell_back, table)

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
