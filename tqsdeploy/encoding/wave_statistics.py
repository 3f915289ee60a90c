"""One calibration wave's statistics, gathered sample by sample (`Calibrator._collect`).

A Conv's rows (im2col) are its activation repeated once per kernel tap. While every sample's rows of one of its
statistics fit one fold (`tiers.hessian.STATS_BATCH_BYTES`) they all sat in the statistic's pending rows until it was
read: a tied depthwise conv of the dwconv example (10 uses, 2048-hour contexts) held 1.25 GB of them a wave, paging
that memory in cost more than building it, and each fold then cast and subtracted 64 strided blocks of 17 columns.
Such a use keeps its activations instead (a kernel's worth smaller) and, once its last sample is in, casts each
group's windows straight into the float64 rows a fold stacks, one use at a time: the same products of the same
values in the same order, so the same bits (tests/tqsdeploy/encoding/test_wave_statistics.py).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from graph_ops.calibration import grouped_windows, layer_inputs, sample_chunks
from tiers import Hessian
from tiers.hessian import ROWS_PER_INPUT, STATS_BATCH_BYTES


class WaveStatistics:
    """H (and G, with `cross`) of every use of a wave, from the samples `add` is given."""

    def __init__(
        self, uses: Mapping[tuple, tuple], cross: bool, samples: int, readers: Mapping[tuple, int] | None = None
    ):
        """`uses`: (use, row groups) by use key; `samples`: how many `add` calls there will be; `readers`: by use
        key, how many uses the weight reading it has (the most of the weights that do; 1 when not given), which
        share `ROWS_PER_INPUT` rows per input between them (`_thinned`)."""
        self.uses = dict(uses)
        self.cross = cross
        self.samples = samples
        self.readers = dict(readers or {})
        self.steps: dict[tuple, int] = {}
        """Every how many rows of a use's X enter its statistic (1: all), set by the first sample (`_thinned`)."""
        self.stats: dict[tuple, list[Hessian] | None] = {key: None for key in self.uses}
        self._held: dict[tuple, list[tuple[np.ndarray, np.ndarray | None]]] | None = None
        """Activations (quantized, full or None) of the uses whose rows wait for the last sample, by key."""

    def add(self, quantized: Mapping[str, np.ndarray], full: Mapping[str, np.ndarray] | None) -> None:
        """One sample's layer inputs, with the quantized prefix and at full precision (None: the same ones)."""
        if self._held is None:
            for key in self.uses:
                self._thinned(key, quantized)
            self._held = {key: [] for key in self.uses if self._waits(key, quantized)}
        for key, (use, groups) in self.uses.items():
            x_fp = None if full is None else full[use.x]
            if key in self._held:
                self._held[key].append((quantized[use.x], x_fp))
            else:
                self._rows(key, quantized[use.x], x_fp)

    def finish(self) -> dict[tuple, list[Hessian] | None]:
        """The statistics, every row folded in (the held uses' rows built here, one use at a time)."""
        for key, held in (self._held or {}).items():
            use, groups = self.uses[key]
            if held and all(_windowed(use, x, groups) for x, _ in held):
                self._fold_windows(
                    key, [(x[c], f if f is None else f[c]) for x, f in held for c in sample_chunks(use, x)]
                )
            else:
                for x, x_fp in held:
                    self._rows(key, x, x_fp)
            held.clear()
            for part in self.stats[key] or ():
                part.H  # folded now: its pending rows are freed before the next use's are built
        for parts in self.stats.values():
            for part in parts or ():
                part.H
        return self.stats

    def _thinned(self, key: tuple, quantized: Mapping[str, np.ndarray]) -> None:
        """Keep every r-th row of a use whose samples would give its weight more than `ROWS_PER_INPUT` rows per
        input and, over all its groups, more rows than one fold holds (`STATS_BATCH_BYTES` as float64); r from
        the first sample's rows, the same for every sample. Past that many, more rows of the same windows barely
        move H, and on long contexts and weights read many times a step their statistics were most of an export;
        fewer than a fold cost little, so all are kept (thinning them would save nothing and still move the
        codes). A Conv keeps every r-th position along its longest output axis (the rows of the same Conv strided
        r times more), other uses every r-th row of X; recurrent and transposed uses keep all. `ROWS_PER_INPUT` 0:
        every row."""
        use, groups = self.uses[key]
        self.steps[key] = 1
        if use.recurrent is not None or (use.conv is not None and use.conv.transposed):
            return
        value = np.asarray(quantized[use.x])
        if use.conv is not None:
            if value.ndim != 2 + len(use.conv.kernel) or value.shape[1] % groups:
                return
            shape = grouped_windows(value, use.conv, groups).shape
            rank = len(use.conv.kernel)
            rows, columns = int(np.prod(shape[1 : 2 + rank])), int(np.prod(shape[2 + rank :]))
            axis = int(np.argmax(shape[2 : 2 + rank]))  # the longest output axis
            blocks = groups
        else:
            parts = layer_inputs(use, value, groups)
            (rows, columns), blocks = parts[0].shape, len(parts)
        if rows * self.samples * columns * blocks * 8 <= STATS_BATCH_BYTES:
            return  # every group's rows together fit one fold's bytes: cheap, so all are kept
        wanted = ROWS_PER_INPUT * columns / max(self.readers.get(key, 1), 1)
        step = int(rows * self.samples // max(wanted, 1)) if ROWS_PER_INPUT else 1
        if step <= 1:
            return
        self.steps[key] = step
        if use.conv is not None:
            spatial = tuple(value.shape[2:])
            conv = dataclasses.replace(
                use.conv,
                strides=tuple(s * (step if i == axis else 1) for i, s in enumerate(use.conv.strides)),
                pads=use.conv.resolved_pads(spatial),
                auto_pad="NOTSET",
            )
            self.uses[key] = (dataclasses.replace(use, conv=conv), groups)

    def _waits(self, key: tuple, quantized: Mapping[str, np.ndarray]) -> bool:
        """Whether a Conv use's rows of all samples fit one fold of each of its statistics (estimated from this
        sample), so that keeping its activations until the last sample holds less than its pending rows would."""
        use, groups = self.uses[key]
        if use.conv is None:
            return False
        value = np.asarray(quantized[use.x])
        rows_bytes = value.size * int(np.prod(use.conv.kernel, dtype=np.int64)) * 8 // max(groups, 1)
        rows_bytes //= self.steps.get(key, 1)
        if use.conv.transposed:
            rows_bytes *= int(np.prod(use.conv.strides, dtype=np.int64))
        return rows_bytes * self.samples < STATS_BATCH_BYTES

    def _rows(self, key: tuple, value: np.ndarray, full: np.ndarray | None) -> None:
        use, groups = self.uses[key]
        step = 1 if use.conv is not None else self.steps.get(key, 1)  # a Conv's rows are thinned by its strides
        for samples in sample_chunks(use, value):
            xs = _every(layer_inputs(use, value[samples], groups), step)
            xf = (
                (xs if full is None else _every(layer_inputs(use, full[samples], groups), step))
                if self.cross
                else [None] * groups
            )
            if self.stats[key] is None:
                self.stats[key] = [Hessian(x.shape[1], self.cross) for x in xs]
            for part, x, x_fp in zip(self.stats[key], xs, xf):
                part.add(x, x_fp)  # x_fp is x before any weight is quantized: no cross term to add

    def _fold_windows(self, key: tuple, chunks: list[tuple[np.ndarray, np.ndarray | None]]) -> None:
        """Each group's rows of every chunk cast straight from the windows into the float64 rows a fold stacks (and
        X_fp − X̂ subtracted into place), in the batches `Hessian.add` would fold: the same products of the same
        values, without an im2col copy or a pending float32 row."""
        use, groups = self.uses[key]
        views = [
            (grouped_windows(x, use.conv, groups), None if f is None else grouped_windows(f, use.conv, groups))
            for x, f in chunks
        ]
        shapes = [view[0].shape for view, _ in views]
        rows = [int(np.prod(shape[: 1 + len(use.conv.kernel)], dtype=np.int64)) for shape in shapes]
        columns = int(np.prod(shapes[0][1 + len(use.conv.kernel) :], dtype=np.int64))
        if self.stats[key] is None:
            self.stats[key] = [Hessian(columns, self.cross) for _ in range(groups)]
        for batch in _batches(rows, columns):
            total = sum(rows[i] for i in batch)
            crossed = self.cross and any(views[i][1] is not None for i in batch)
            x = np.empty(
                (total, columns)
            )  # every group's rows in turn: fresh pages per group cost more than the copies
            delta = np.empty_like(x) if crossed else None
            for group, part in enumerate(self.stats[key]):
                start = 0
                for i in batch:
                    view, full = views[i]
                    into = x[start : start + rows[i]].reshape(shapes[i])
                    np.copyto(into, view[group])
                    if delta is not None:
                        difference = delta[start : start + rows[i]].reshape(shapes[i])
                        if full is None:
                            difference[...] = 0.0
                        else:
                            np.subtract(full[group], into, out=difference)
                    start += rows[i]
                part.fold_in(x, delta)


def _every(rows: list[np.ndarray], step: int) -> list[np.ndarray]:
    """Every `step`-th row of each group's rows."""
    return rows if step == 1 else [x.reshape(-1, x.shape[-1])[::step] for x in rows]


def _windowed(use, value: np.ndarray, groups: int) -> bool:
    """Whether `use`'s rows of `value` are its grouped windows (`graph_ops.calibration.grouped_windows`)."""
    conv = use.conv
    return not conv.transposed and value.ndim == 2 + len(conv.kernel) and value.shape[1] % groups == 0


def _batches(rows: list[int], columns: int) -> list[list[int]]:
    """The chunks (by index) each fold of `Hessian.add` takes: a fold once the pending rows reach
    `STATS_BATCH_BYTES`, the rest when the statistic is read; chunks with no rows are not added."""
    batches, pending, taken = [], [], 0
    for index, count in enumerate(rows):
        if not count:
            continue
        pending.append(index)
        taken += count
        if taken * columns * 8 >= STATS_BATCH_BYTES:
            batches.append(pending)
            pending, taken = [], 0
    return batches + ([pending] if pending else [])
