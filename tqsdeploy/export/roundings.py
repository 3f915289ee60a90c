"""How each tier's codes are rounded in one export: the method and grids asked for, or chosen by measurement.

With `--rounding auto` or `--grids auto`, each calibratable tier's uniform model is built with every candidate
rounding and the one that drifts least on the scoring contexts is kept, once, before any slot is priced: a
slot's price, the mixed model and its calibration as itself then all use the same codes.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from tiers import Rounding, Tier, auto_methods
from tqsdeploy.encoding import run_cache
from tqsdeploy.encoding.choices import AnyRounding, TierRoundings, grid_options, plain_rounding, rounding_at
from tqsdeploy.export.candidates import UniformModels
from tqsdeploy.export.job import ExportJob
from tqsdeploy.sweep import Drift

AUTO_METHODS = auto_methods()
"""What `--rounding auto` chooses from on a calibratable tier (listed first wins a tie; `tiers.methods`)."""


class Roundings:
    """The export's rounding per tier, chosen the first time it is needed."""

    def __init__(self, job: ExportJob, uniforms: UniformModels):
        self.job, self.uniforms = job, uniforms
        settings = job.settings
        measures = settings.rounding == "auto" or any(
            len(grid_options(t, settings.rounding, settings.grids)) > 1 for t in job.tiers
        )
        self._rounding: AnyRounding | None = None if measures else plain_rounding(settings.rounding, settings.grids)
        self.choice: dict[str, dict[str, float]] = {}
        """Per calibratable tier measured to choose its rounding: each rounding's uniform drift (percent) on the
        scoring contexts, by its label ('qep', 'qep/min-max')."""
        self._grids: dict[tuple[str, str], Rounding] = {}
        """(tier, method) -> that method's rounding on the grids measured best there (`measured_rounding`)."""

    @property
    def rounding(self) -> AnyRounding:
        """The rounding every encoding of this export uses: the one asked for, or one per tier chosen by measurement."""
        if self._rounding is None:
            self._rounding = self._choose()
        return self._rounding

    def at(self, tier: str) -> Rounding:
        """The method that rounds `tier`'s codes in this export."""
        return rounding_at(self.rounding, tier)

    def measured_rounding(self, tier: Tier, method: str) -> Rounding:
        """`method`'s rounding at `tier` on the grids the export asks for; with 'auto', where the grids differ, the
        grid whose uniform model drifts less on the scoring contexts (measured once per export)."""
        options = grid_options(tier, method, self.job.settings.grids)
        if len(options) == 1:
            return options[0]
        key = (tier.name, method)
        if key not in self._grids:
            self._grids[key] = self._least_drifting(tier, options)
        return self._grids[key]

    def measured_already(self, tier: Tier, method: str) -> bool:
        """Whether `method`'s uniform model at `tier` (on its measured grids) was measured: free to compare."""
        options = grid_options(tier, method, self.job.settings.grids)
        rounding = options[0] if len(options) == 1 else self._grids.get((tier.name, method))
        return rounding is not None and self.uniforms.measured(tier, rounding)

    def _least_drifting(self, tier: Tier, options: list[Rounding]) -> Rounding:
        """The rounding of `options` whose uniform model at `tier` drifts least, every one recorded (`choice`); a
        large model keeps only the chosen one's codes (a byte per weight each). The choice and the drifts behind it
        are kept in the run's cache: a later export of the run reads them instead of loading every option's codes."""
        name = self._cache_key(tier, options)
        kept = self.job.cache.value("choice", name) if name is not None else None
        if kept is not None:
            measured = {rounding: Drift(**drift) for rounding, drift in zip(options, kept["drifts"])}
            for rounding, drift in measured.items():
                self.uniforms.remember(tier, rounding, drift)  # measured, as far as the comparison asks
            chosen = options[kept["chosen"]]
        else:
            chosen, measured = self.job.encoder.least_drifting(
                tier,
                options,
                lambda rounding: self.uniforms.candidate(tier, rounding, None).drift,
                forget=self.job.scored.one_session,
            )
            if name is not None:
                value = {"chosen": options.index(chosen), "drifts": [asdict(measured[r]) for r in options]}
                self.job.cache.keep("choice", name, f"{tier.name}: {chosen.label} of {len(options)}", value)
        self.choice.setdefault(tier.name, {}).update(
            {rounding.label: drift.worst_pct for rounding, drift in measured.items()}
        )
        return chosen

    def _cache_key(self, tier: Tier, options: list[Rounding]) -> str | None:
        """What a choice among `options` at `tier` depends on: every option's codes (the export's identity, the
        group size, the tier and the rounding) and what their drifts are measured on."""
        if self.job.cache is None:
            return None
        scored, settings = self.job.scored, self.job.settings
        return run_cache.key(
            scored.measure_identity(settings),
            f"group size {settings.group_size}",
            f"{tier.name}: {tier.family} {tier.bits} bits, {'symmetric' if tier.symmetric else 'asymmetric'}",
            *(repr(rounding) for rounding in options),
        )

    def _choose(self) -> TierRoundings:
        """Per calibratable tier, the rounding whose uniform model drifts least: among `AUTO_METHODS` with
        `--rounding auto`, and among the grids each method takes there with `--grids auto`."""
        started = time.perf_counter()
        settings = self.job.settings
        asked = settings.rounding
        methods = AUTO_METHODS if asked == "auto" else (asked,)
        chosen = []
        for tier in self.job.tiers:
            if not tier.calibratable or (asked != "auto" and len(grid_options(tier, asked, settings.grids)) == 1):
                continue  # one rounding to take: nothing to measure
            chosen.append(
                (tier.name, self._least_drifting(tier, [self.measured_rounding(tier, method) for method in methods]))
            )
        self.job.timings["rounding"] += time.perf_counter() - started
        default = plain_rounding("qep" if asked == "auto" else asked, settings.grids)
        return TierRoundings(tuple(chosen), default, asked)
