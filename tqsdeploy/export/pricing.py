"""Prices: what each slot costs and loses at each tier, and the allocation they solve to.

`PriceList` measures and caches the rollouts behind the measured objective (one per slot and tier, in the run
folder's `measured.jsonl`, shared by every export of the run; a channel group's from its unit's rollout by its
share of the unit's layer-output error, `shares.GroupShares`, unless `--group-prices exact`). `TierPricing`
turns one tier set's prices into the knapsack's choices and allocates; an export keeps one for its tiers and
makes another when it also tries the tier below its lowest.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from typing import Callable

import numpy as np
from filelock import FileLock

import graph_ops
from tiers import TIERS, Tier
from tiers.solver_backend import solver_dtype
from tqsdeploy.encoding.slots import Slot
from tqsdeploy.export.allocate import Allocation, Choice, Knapsack
from tqsdeploy.export.fitting import Fitter
from tqsdeploy.export.job import ExportJob
from tqsdeploy.export.measuring import Measuring
from tqsdeploy.export.objectives import LAZY_BITS, OBJECTIVES
from tqsdeploy.export.roundings import Roundings
from tqsdeploy.export.shares import GroupShares
from tqsdeploy.export.sizing import Sizing
from tqsdeploy.sweep import Lanes, ResultLog, SweepRunner, Task, TaskResult


class PriceList:
    """The rollouts with one slot at one tier, keyed by what they feed, cached in the run folder; with shared group
    prices a channel group's is its unit's rollout times the group's share (`GroupShares`)."""

    def __init__(
        self,
        job: ExportJob,
        measuring: Measuring,
        roundings: Roundings,
        on_measuring: Callable[[int], None] | None = None,
    ):
        """`on_measuring(count)`: told how many rollouts a reported batch of prices is about to run."""
        self.job, self.measuring, self.roundings = job, measuring, roundings
        self.on_measuring = on_measuring
        self._identity = job.scored.price_identity()
        self._keys: dict[tuple[str, str], Task] = {}
        """(slot, tier) -> its entry in the price list: its codes are this export's, fixed once made."""
        self._measured: dict[str, TaskResult] | None = None
        self._counted: set[str] = set()
        """Price keys this export measured or counted as read from the run folder's list."""
        self.shares = GroupShares(job) if job.settings.group_prices == "shared" else None
        self._shared: dict[str, TaskResult] = {}
        """Group prices made from their unit's rollout, by `key`: made in memory, never in the run folder's list."""

    @staticmethod
    def drop(run_dir) -> None:
        """Remove the run folder's measured prices (`export --fresh`), waiting for an export pricing now."""
        with FileLock(str(run_dir / ".measured.lock")):
            (run_dir / "measured.jsonl").unlink(missing_ok=True)

    def probe(self, tier: Tier) -> str:
        """The label of a price at `tier`: the tier, its group size, its rounding and (narrowed) solver type."""
        group = f"/g{self.job.settings.group_size}" if self.job.settings.group_size else ""
        method = self.roundings.at(tier.name).label if tier.calibratable else "rtn"
        narrow = (
            f"/{solver_dtype()}" if tier.calibratable and method != "rtn" and solver_dtype() != "float64" else ""
        )  # its own prices
        return f"tier:{tier.name}{group}/{method}{narrow}"

    def task(self, slot: Slot, tier: Tier) -> Task:
        """The price list's entry of (slot, tier): its label and a digest of the values its rollout feeds (the slot's
        codes at the tier, dequantized), of the runtime and of the score run. A price is reused only for the same
        values: a label alone would let an older version's prices stand for today's codes."""
        key = (slot.name, tier.name)
        if key not in self._keys:
            digest = hashlib.blake2b(self._identity.encode(), digest_size=10)
            for name, encoded in sorted(self.job.encoder.slot(slot, tier, self.roundings.rounding).items()):
                values = np.ascontiguousarray(encoded.dequantize())
                digest.update(f"{name} {values.dtype} {values.shape}".encode())
                digest.update(values.tobytes())
            self.job.encoder.release_kept()  # every slot's codes are read here once; the rollouts read them again
            self._keys[key] = Task(slot.name, f"{self.probe(tier)}#{digest.hexdigest()}")
        return self._keys[key]

    def shared(self, slot: Slot) -> bool:
        """Whether the slot's price comes from its unit's rollout (a channel group, `--group-prices shared`)."""
        return self.shares is not None and slot.rows is not None

    def key(self, slot: Slot, tier: Tier) -> str:
        """Where the price of (slot, tier) is in what `measure` returns."""
        return self._shared_task(slot, tier).key if self.shared(slot) else self.task(slot, tier).key

    def _shared_task(self, slot: Slot, tier: Tier) -> Task:
        """A shared group price's entry: its own codes' label, marked as made from its unit's rollout."""
        task = self.task(slot, tier)
        return Task(task.unit, task.probe.replace("#", "#shared-", 1))

    def rolled(self, slot: Slot, tier: Tier) -> tuple[Slot, Tier]:
        """The (slot, tier) whose rollout prices (slot, tier): its whole unit's for a shared channel group."""
        if not self.shared(slot):
            return slot, tier
        return Slot(slot.unit, slot.unit, self.job.scored.units_by_name[slot.unit].params), tier

    def measure(self, tasks: list[tuple[Slot, Tier]], on_result=None) -> dict[str, TaskResult]:
        """The price of every (slot, tier) of `tasks` (by `key`), with whatever was measured before; what is not in
        the run folder's list yet is rolled out (`on_result(result)` after each) and added to it."""
        started = time.perf_counter()
        for tier in {
            tier.name: tier for _, tier in tasks if tier.calibratable
        }.values():  # each tier's pass first: the ETA is the rollouts'
            if any((slot.name, tier.name) not in self._keys for slot, t in tasks if t.name == tier.name):
                self.job.encoder.uniform(tier, self.roundings.at(tier.name))
        if self._measured is not None and all(self.key(slot, tier) in self._measured for slot, tier in tasks):
            return self._measured
        rolled = list({(s.name, t.name): (s, t) for s, t in (self.rolled(*task) for task in tasks)}.values())
        keys = {(slot.name, tier.name): self.task(slot, tier).key for slot, tier in rolled}
        log = ResultLog(self.job.scored.run_dir / "measured.jsonl")
        lock = FileLock(str(self.job.scored.run_dir / ".measured.lock"))
        lock.acquire()  # another export of this run prices the same slots: wait, then reuse what it measured
        try:
            # and before each price: none goes into a run that replaced this one
            self.job.scored.scores.check_unchanged()
            done = log.load()
            self._count_reused(keys.values(), done)
            pending = [(slot, tier) for slot, tier in rolled if keys[(slot.name, tier.name)] not in done]
            if on_result and pending and self.on_measuring:
                self.on_measuring(len(pending))
            self._roll_out(pending, done, log, on_result)
            own = [  # a group whose unit's rollout did not stay finite: priced by its own
                (s, t)
                for s, t in tasks
                if self.shared(s)
                and done[self.task(*self.rolled(s, t)).key].nonfinite
                and self.task(s, t).key not in done
            ]
            if on_result and own and self.on_measuring:
                self.on_measuring(len(own))
            self._roll_out(own, done, log, on_result)
        finally:
            log.close()
            lock.release()
        if pending or own:  # the rollouts made every weight's mapped pages resident; what follows reads none of them
            graph_ops.release_pages(self.job.scored.weights)
        self._share_out(tasks, done)
        self._measured = {**done, **self._shared}
        self.job.timings["pricing"] += time.perf_counter() - started
        return self._measured

    def _share_out(self, tasks: list[tuple[Slot, Tier]], done: dict[str, TaskResult]) -> None:
        """The shared channel groups' prices of `tasks`: their unit's rollout divergence times their share."""
        groups = [(s, t) for s, t in tasks if self.shared(s) and self.key(s, t) not in self._shared]
        if not groups:
            return
        self.shares.prepare(groups, self.roundings.rounding)
        for slot, tier in groups:
            whole = done[self.task(*self.rolled(slot, tier)).key]
            if whole.nonfinite:
                own = done[self.task(slot, tier).key]
                div_sq, nonfinite = own.div_sq, own.nonfinite
            else:
                share = self.shares.share(slot, tier)
                div_sq, nonfinite = [value * share for value in whole.div_sq], False
            task = self._shared_task(slot, tier)
            self._shared[task.key] = TaskResult(task.unit, task.probe, 0, 0.0, div_sq, nonfinite, 0.0)

    def _count_reused(self, keys, done: dict[str, TaskResult]) -> None:
        """Prices an earlier export measured, counted once as read from the run's cache (`export --verbose`)."""
        cache = self.job.cache
        for key in keys:
            if cache is not None and key in done and key not in self._counted:
                self._counted.add(key)
                cache.read["prices"] += 1

    def _roll_out(
        self, pending: list[tuple[Slot, Tier]], done: dict[str, TaskResult], log: ResultLog, on_result
    ) -> None:
        """Price `pending` on the measuring lanes (or on cut lanes, as the score swept), logging each result."""
        cut_lanes: list[SweepRunner] = []
        encoder, rounding = self.job.encoder, self.roundings.rounding if pending else None

        def price(lane: SweepRunner, item):
            for slot, tier in item:
                encoder.release_kept()  # the codes fed so far are not read again
                weights = encoder.slot_weights(slot, tier, rounding)
                tick = time.perf_counter()
                if cut_lanes:
                    div_sq, nonfinite = lane.unit_divergence(slot.unit, weights)
                else:
                    div_sq, nonfinite = lane.divergence(self.measuring.fed(weights), early_stop=False)
                yield TaskResult(
                    slot.name, self.task(slot, tier).probe, 0, 0.0, div_sq, nonfinite, time.perf_counter() - tick
                )

        try:
            if self.job.scored.prices_cut and pending:
                cut_lanes = self.measuring.cut_lanes()
            lanes = cut_lanes or self.measuring.lanes
            items = lanes[0].work_items(pending, lambda task: task[0].unit)
            with encoder.profile.section("measurement_rollouts"), Lanes(lanes, items, price) as results:
                for result in results:
                    self.job.scored.scores.check_unchanged()
                    log.append(result)
                    done[result.key] = result
                    self._counted.add(result.key)
                    if self.job.cache is not None:
                        self.job.cache.made["prices"] += 1
                    if on_result:
                        on_result(result)
        finally:
            for lane in reversed(cut_lanes):  # the lanes' own cut sessions, then the lead's
                lane.close()


class TierPricing:
    """One tier set's choices (cost and loss of every slot at every tier) and the allocation they solve to."""

    def __init__(self, job: ExportJob, tiers: list[Tier], prices: PriceList, sizing: Sizing):
        self.job, self.tiers, self.prices, self.sizing = job, tiers, prices, sizing
        self.fitter = Fitter(job, sizing, tiers)
        self._choices: dict[str, list[Choice]] = {}
        self.unpriced: set[tuple[str, str]] = set()
        """(slot, tier) pairs the measured prices bound by 0, not measured yet (`allocate`)."""

    # what an objective reads (`objectives.PricingView`)
    @property
    def gamma(self) -> dict[str, float]:
        return self.job.scored.gamma

    @property
    def dead(self) -> set[str]:
        return self.job.scored.dead

    @property
    def steps(self) -> int:
        return self.job.scored.steps

    def probe(self, tier: Tier) -> str:
        return self.prices.probe(tier)

    def price_key(self, slot: Slot, tier: Tier) -> str:
        return self.prices.key(slot, tier)

    def weight_error_sq(self, slot: Slot, tier: Tier) -> float:
        """||Q(θ) − θ||² of the slot at `tier`, over the rows the contexts read (a Gather table's), else all of it."""
        change = self.job.encoder.slot(slot, tier, self.prices.roundings.rounding)
        return sum(
            self._read_sq(n, slot, e.dequantize().astype(np.float64) - self._original(n, slot))
            for n, e in change.items()
        )

    def _read_sq(self, name: str, slot: Slot, error: np.ndarray) -> float:
        rows = self.job.scored.prepared.job.rows.get(name)
        if rows is not None and slot.rows is None:
            error = error[rows]
        return float(np.sum(np.square(error)))

    def _original(self, name: str, slot: Slot) -> np.ndarray:
        weight = np.asarray(self.job.scored.weights[name], np.float64)
        if slot.rows is None:
            return weight
        return self.job.encoder.layouts[name].take_rows(weight, *slot.rows)

    # the tasks and choices
    def measured_tasks(self) -> list[tuple[Slot, Tier]]:
        """(slot, tier) pairs the measured objective rolls out: live slots at every tier that changes the weight."""
        return [(s, t) for s in self.job.cut.slots if s.unit not in self.dead for t in self.tiers if t.name != "fp32"]

    def eager_tasks(self) -> list[tuple[Slot, Tier]]:
        """The (slot, tier) pairs priced before the first allocation: all but float copies (`LAZY_BITS`)."""
        return [(s, t) for s, t in self.measured_tasks() if t.bits < LAZY_BITS]

    def measured(self, on_result=None, tasks: list[tuple[Slot, Tier]] | None = None):
        """Per slot and tier, the rollout divergence with only that slot at that tier (default: every measured task)."""
        return self.prices.measure(self.measured_tasks() if tasks is None else tasks, on_result)

    def reset(self) -> None:
        """The slots were cut anew: choices are priced again (what was measured stays cached by slot name)."""
        self._choices = {}
        self.unpriced = set()

    def choices(self, objective: str | None = None, on_result=None) -> list[Choice]:
        """Cost and loss of every slot at every tier; computed once per objective."""
        objective = objective or self.job.settings.objective
        if objective not in self._choices:
            self._choices[objective] = self._price(objective, on_result)
        return self._choices[objective]

    def _price(self, name: str, on_result=None) -> list[Choice]:
        objective = OBJECTIVES[name]
        measured = self.measured(on_result, self.eager_tasks()) if objective.measures else None
        costs = self.sizing.costs(self.tiers)
        residents = self.sizing.residents(self.tiers) if self.job.memory is not None else {}
        loss_of, unpriced = objective.losses(self, measured)
        if objective.measures:
            self.unpriced = unpriced
        choices = []
        for slot in self.job.cut.slots:
            loss = {tier.name: loss_of(slot, tier) for tier in self.tiers}
            choices.append(
                Choice(
                    slot.name,
                    slot.params,
                    self.gamma.get(slot.unit, 0.0),
                    slot.unit in self.dead,
                    costs[slot.name],
                    loss,
                    residents.get(slot.name, {}),
                )
            )
        return self._unread_as_read(choices) if objective.unread_rows_as_read else choices

    def _unread_as_read(self, choices: list[Choice]) -> list[Choice]:
        """A Gather table's slots holding only rows the scoring contexts never read change no rollout, so they would
        price at 0 and go to the lowest tier for free: they take the price per parameter of the table's read slots."""
        by_slot = {c.unit: c for c in choices}
        for unit, slots in self.job.cut.slots_of.items():
            names = self.job.scored.units_by_name[unit].tensor_names
            touched = self.job.scored.prepared.job.rows.get(names[0]) if len(names) == 1 else None
            if touched is None:
                continue
            touched = set(np.asarray(touched).tolist())
            unread = [s for s in slots if s.rows is not None and not touched.intersection(range(*s.rows))]
            read = [s for s in slots if s not in unread]
            params = sum(s.params for s in read)
            for slot in unread if read and params else ():
                choice = by_slot[slot.name]
                by_slot[slot.name] = replace(
                    choice,
                    loss={t: sum(by_slot[r.name].loss[t] for r in read) * slot.params / params for t in choice.loss},
                )
        return [by_slot[c.unit] for c in choices]

    def allocate(self, target: float, on_result=None) -> Allocation:
        """Algorithm 1 on the additive prices, priced as written and meeting `target` (`Fitter.fitted`).

        Float copies (bf16, fp16) are priced lazily: solved with a loss of 0 (a lower bound) where not yet measured;
        when the allocation picks one, that one is measured and the allocation solved again. An allocation that picks
        none is optimal for the true losses too."""
        settings = self.job.settings
        objective = settings.objective
        problem = Knapsack(
            self.tiers,
            target,
            self.sizing.budget(self.tiers),
            objective,
            settings.fp32_share,
            settings.allocator,
            self.job.knapsack_memory(),
        )
        while True:
            choices = self.choices(objective, on_result)
            allocation = self.fitter.fitted(problem, choices)
            picked = [
                (slot, TIERS[allocation.tiers[slot.name]])
                for slot in self.job.cut.slots
                if (slot.name, allocation.tiers[slot.name]) in self.unpriced
            ]
            if not OBJECTIVES[objective].measures or not picked:
                return allocation
            self.measured(None, picked)
            del self._choices[objective]
