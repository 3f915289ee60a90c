"""Channel groups priced from their unit's rollout: each group's share of the unit's layer-output error.

Near a uniform size a unit is cut into many channel groups (`compare.slack_split`), and a rollout per group and
tier made pricing grow with the cut (issue 57: 1,392 pricing rollouts, 80% of a 34-minute export). With
`--group-prices shared` (the default) a group's price at a tier is its unit's price there (one rollout, the same
at every cut) times the group's share of the unit's layer-output error at that tier: Σ over the group's output
channels c of δw_c·H·δw_cᵀ, δw_c the channel's rounding error and H the second moment of the weight's
full-precision inputs on the calibration rollout (`input_moments`). For one linear layer whose outputs are the
trajectory these are the exact prices (output channels add); elsewhere they assume that a unit's channels reach
the trajectory alike (docs/design-notes/export.md, "Channel groups priced from their unit").
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

import graph_ops
from graph_ops.calibration import layer_inputs, sample_chunks
from tiers import Tier
from tqsdeploy.encoding import checkpoints, run_cache
from tqsdeploy.encoding.choices import AnyRounding
from tqsdeploy.encoding.slots import Slot
from tqsdeploy.export.job import ExportJob

SHARE_KIND = "share"
"""The run-cache kind of a unit's channel errors at a tier (a list of floats, exact through JSON)."""
FULL_ORDER = 1024
"""Inputs up to this width weigh the error by their full second moment H (K x K); wider ones by its diagonal only,
a vector per weight where a 4096-wide layer's H takes 128 MiB."""


def input_moments(calibrator, names: Iterable[str]) -> dict[str, list[np.ndarray] | None]:
    """Per weight of `names`: per row group, the mean X·Xᵀ of its full-precision inputs over the calibration rollout,
    merged over the nodes that read it (K x K, or its diagonal past `FULL_ORDER`); None for a weight calibration
    cannot feed (its inputs are not rebuilt, `Calibrator.first`)."""
    layouts = calibrator.layouts
    names = list(names)
    fed = [n for n in names if layouts[n].calibratable and n not in calibrator.first]
    uses = {u.key: (u, layouts[n].row_groups) for n in fed for u in layouts[n].uses}
    sums: dict[tuple, np.ndarray] = {}
    counts: dict[tuple, int] = {}
    for values in calibrator.full_inputs(sorted({u.x for u, _ in uses.values()})):
        for key, (use, groups) in uses.items():
            for chunk in sample_chunks(use, values[use.x]):
                for group, x in enumerate(layer_inputs(use, np.asarray(values[use.x])[chunk], groups)):
                    x = np.asarray(x, np.float64)
                    part = x.T @ x if x.shape[1] <= FULL_ORDER else np.einsum("ij,ij->j", x, x)
                    sums[(key, group)] = part + sums[(key, group)] if (key, group) in sums else part
                    counts[(key, group)] = counts.get((key, group), 0) + x.shape[0]
    moments: dict[str, list[np.ndarray] | None] = {}
    for name in names:
        keys = [u.key for u in layouts[name].uses] if name in fed else []
        groups = range(layouts[name].row_groups)
        if not keys or any((k, g) not in sums for k in keys for g in groups):
            moments[name] = None
            continue
        moments[name] = [sum(sums[(k, g)] for k in keys) / max(1, sum(counts[(k, g)] for k in keys)) for g in groups]
    return moments


def channel_errors(wt_original: np.ndarray, wt_encoded: np.ndarray, moments: list[np.ndarray] | None) -> np.ndarray:
    """Per output channel (row of Wt), δw·H·δwᵀ with δw = encoded − original in float64 and H its row group's moment
    (a diagonal: Σ δw²·h); without moments ‖δw‖². One float64 array of a row group at a time, squared in place
    (the original and the encoding stay in their own dtypes): the products, and so their bits, are those of
    whole-group copies."""
    groups = 1 if moments is None else len(moments)
    rows = wt_original.shape[0] // groups
    parts = []
    for group in range(groups):
        block = slice(group * rows, (group + 1) * rows)
        delta = np.asarray(wt_encoded[block], np.float64)
        delta -= wt_original[block]
        moment = None if moments is None else moments[group]
        if moment is None:
            parts.append(np.einsum("ij,ij->i", delta, delta))
        elif moment.ndim == 2:
            parts.append(np.einsum("ij,ij->i", delta @ moment, delta))
        else:
            parts.append(np.square(delta, out=delta) @ moment)
    return np.concatenate(parts)


class GroupShares:
    """Each channel group's share of its unit's layer-output error at a tier, for `PriceList`'s shared prices."""

    def __init__(self, job: ExportJob):
        self.job = job
        self._errors: dict[tuple[str, str], np.ndarray] = {}
        """(unit, tier) -> the unit's per-channel layer-output errors at the tier, as priced (the uniform codes)."""

    def share(self, slot: Slot, tier: Tier) -> float:
        """The group's share of its unit's error at `tier` (`prepare` made it); its share of the channels where
        the tier leaves the unit exact."""
        errors = self._errors[(slot.unit, tier.name)]
        start, stop = slot.rows
        total = float(errors.sum())
        return float(errors[start:stop].sum()) / total if total > 0 else (stop - start) / len(errors)

    def prepare(self, tasks: Iterable[tuple[Slot, Tier]], rounding: AnyRounding) -> None:
        """The errors of every (unit, tier) of the group slots in `tasks` not made yet: read from the run's cache
        where an earlier export of the run made them for the same codes, else from one pass over the calibration
        samples for the missing units' moments, dropped once their errors are made (and kept in the cache)."""
        wanted: dict[str, set[str]] = {}
        tiers: dict[str, Tier] = {}
        for slot, tier in tasks:
            if slot.rows is not None and (slot.unit, tier.name) not in self._errors:
                wanted.setdefault(slot.unit, set()).add(tier.name)
                tiers[tier.name] = tier
        if not wanted:
            return
        scored, encoder = self.job.scored, self.job.encoder
        names = {unit: scored.units_by_name[unit].tensor_names[0] for unit in wanted}
        missing: dict[str, dict[str, str | None]] = {}
        for unit, tier_names in wanted.items():
            for tier_name in sorted(tier_names):
                key = self._cache_key(names[unit], encoder.tensor(names[unit], tiers[tier_name], rounding))
                encoder.release_kept()  # each tier's codes are read here once (or twice, where the cache misses)
                kept = self.job.cache.value(SHARE_KIND, key) if key is not None else None
                if kept is None:
                    missing.setdefault(unit, {})[tier_name] = key
                else:
                    self._set(unit, tier_name, np.asarray(kept, np.float64))
        if not missing:
            return
        moments = self._moments([names[unit] for unit in missing])
        for unit, keys in missing.items():
            name = names[unit]
            layout = encoder.layouts[name]
            original = layout.to_wt(np.asarray(scored.weights[name]))  # cast a row group at a time (`channel_errors`)
            for tier_name, key in keys.items():
                encoded = encoder.tensor(name, tiers[tier_name], rounding).dequantize()
                errors = channel_errors(original, layout.to_wt(encoded), moments[name])
                if key is not None:
                    self.job.cache.keep(SHARE_KIND, key, f"{unit} at {tier_name}: channel errors", errors.tolist())
                self._set(unit, tier_name, errors)
                encoder.release_kept()
            graph_ops.release_pages(scored.weights, [name])  # and the weight: the whole model would end resident

    def _set(self, unit: str, tier_name: str, errors: np.ndarray) -> None:
        name = self.job.scored.units_by_name[unit].tensor_names[0]
        read = self._read_rows(name, self.job.encoder.layouts[name].channels)
        self._errors[(unit, tier_name)] = errors * read if read is not None else errors

    def _cache_key(self, name: str, encoded) -> str | None:
        """The run-cache key of weight `name`'s channel errors at `encoded`: its codes' digest, and what the moments
        depend on (the calibration rollout of the score run: the identity the encoder's checkpoints are kept under,
        `ScoredModel.checkpoint_identity`); None without a cache."""
        if self.job.encoder.checkpoints is None:
            return None
        identity = self.job.encoder.checkpoints[1]
        codes = checkpoints.digest(name, encoded, self.job.scored.weights.get(name)).hex()
        return run_cache.key(identity, "channel errors", f"moments up to {FULL_ORDER} wide", name, codes)

    def _moments(self, names: list[str]) -> Mapping[str, list[np.ndarray] | None]:
        calibrator = self.job.encoder.calibrator
        with self.job.encoder.profile.section("statistics"):
            moments = input_moments(calibrator, names)
        graph_ops.release_pages(self.job.scored.weights)  # the rollout read every weight; the errors read a few
        if self.job.scored.one_session:
            self.job.encoder.release_calibrator()  # a copy of the model: not held beside the measuring session
        return moments

    def _read_rows(self, name: str, channels: int) -> np.ndarray | None:
        """A Gather table's rows the scoring contexts read (1) and those they never read (0); None otherwise."""
        rows = self.job.scored.prepared.job.rows.get(name)
        if rows is None:
            return None
        read = np.zeros(channels)
        read[np.asarray(rows, np.int64)] = 1.0
        return read
