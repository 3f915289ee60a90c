"""Sequential calibration: the statistics GPTQ, GPTAQ and QEP need, wave by wave.

Calibration samples are the inputs of every step of the nominal rollout from the run's context windows (the
rollout the score measured). For each wave (`graph_ops.calibration.waves`: weights whose inputs depend only on
earlier waves) the statistics are collected with every earlier wave already quantized, then the wave is
quantized; weights whose inputs cannot be rebuilt go first, without statistics. One session of the calibration
graph (`CalibrationGraph`) gives the samples and the full-precision activations; each wave's quantized-prefix
activations come from a session of the graph cut down to that wave's inputs, every weight quantized so far rebuilt
from its fed codes (a byte per weight, not a float copy), starting from the activations the previous wave kept
(an activation is kept only while no weight upstream of it has been quantized since), so a pass runs the model
about once rather than once per wave.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from time import perf_counter
from typing import Callable, Mapping, NamedTuple

import numpy as np

import graph_ops
from graph_ops.calibration import waves
from graph_ops.fed_codes import fed_codes_model, needed_nodes
from graph_ops.layout import WeightLayout
from graph_ops.qdq import default_opset
from runtimes import DEFAULT_RUNTIME, Runtime, WithDefaults, release_freed_memory
from tiers import Encoded, Hessian
from tiers.hessian import is_thin
from tiers.solver_backend import shared_cores, solver_threads
from tqsdeploy.encoding.calibration_graph import CalibrationGraph
from tqsdeploy.encoding.checkpoints import digest
from tqsdeploy.encoding.logs import CalibrationLog
from tqsdeploy.encoding.profiling import Profile
from tqsdeploy.encoding.sessions import open_graph, original_nominal
from tqsdeploy.encoding.wave_statistics import WaveStatistics
from tqsdeploy.errors import TqsError
from tqsdeploy.rollout import RolloutSpec
from tqsdeploy.rollout.contexts import Contexts
from tqsdeploy.rollout.engine import Drift, Nominal, RolloutEngine

FULL_CACHE_SHARE = 0.25
"""Full-precision layer inputs are kept across waves and passes while they take at most this share of the
weights' bytes (or `FULL_CACHE_FLOOR`, whichever is more)."""
FULL_CACHE_FLOOR = 64 << 20
"""Bytes of full-precision layer inputs kept whatever the weights' size: a small model's activations outweigh its
weights, and without them every wave of every pass would run the original once per sample again
(docs/design-notes/encoding.md, "Activations kept")."""
FULL_INPUTS_FLOOR = 512 << 20
"""Bytes the full-precision layer inputs may take whatever the weights' size, more than `FULL_CACHE_FLOOR`: they are
the same in every wave of every pass, so without them each wave runs the original once per sample again (the
dwconv example's 2048-long contexts: 239 MiB of inputs, 72 runs of the original a pass;
docs/design-notes/encoding.md, "Activations kept")."""
KEPT_SHARE = FULL_CACHE_SHARE
"""Activations kept from one wave for the next (`Calibrator._kept`) take at most this share of the weights' bytes
(or `FULL_CACHE_FLOOR`); past it the pass runs each wave from the model input."""
TRIM_AFTER_BYTES = 64 << 20
"""A wave whose statistics took this many bytes or more hands the heap its solves freed back to the OS when it is
done: the column loops' block temporaries (MiBs each, under the size glibc maps on its own) otherwise stay in every
solver thread's arena, about 15 MB each, 0.2 GB on the 1 GB stack (docs/design-notes/encoding.md, "The heap after
a large wave"). Smaller waves keep theirs for the next, as the CLI's heap settings intend."""
EncodeFn = Callable[[str, "list[Hessian] | None"], Encoded]
"""(weight name, its statistics per row group or None) -> the weight's encoding."""


def _statistics_bytes(parts: "list[Hessian] | None") -> int:
    """Bytes of one use's statistics (H, and G where kept), over its row groups."""
    return sum(p.H.nbytes + (0 if p.G is None else p.G.nbytes) for p in parts or ())


class CalibrationError(TqsError):
    """Calibration could not run (non-finite activations, an unusable graph)."""


class CalibrationRollout(NamedTuple):
    """The windows and rollout calibration statistics come from: the inputs of every step of the nominal rollout."""

    contexts: Contexts
    spec: RolloutSpec
    max_batch: int = 64


class Calibrator:
    """Collects statistics and quantizes weights in wave order; reusable across passes."""

    def __init__(
        self,
        proto,
        layouts: Mapping[str, WeightLayout],
        rollout: CalibrationRollout,
        runtime: Runtime = DEFAULT_RUNTIME,
        *,
        weights: Mapping[str, np.ndarray],
        opset: int = 1,
        workdir: Path | None = None,
        data_dir: Path | None = None,
    ):
        """`rollout`: the windows and steps the statistics come from. `workdir`: where session files of a model too
        large to pass as bytes go. `data_dir`: the folder of the data files a `proto` loaded without its external
        data points into.
        `weights`: the scored weights' values; they are plain inputs of the session, fed from there when
        a run does not feed its own, so the runtime holds no copy of the model's weights.
        `opset`: the opset the output is written at: the sessions run the model converted to it (`at_opset`)."""
        self.layouts = dict(layouts)
        self.opset = max(opset, default_opset(proto))
        self.weights = weights
        self.waves = waves(proto, self.layouts)
        calibrated = {n for wave in self.waves for n in wave}
        self.first = [n for n in self.layouts if n not in calibrated]
        self._group_of = {name: index for index, names in enumerate(self.groups) for name in names}
        self._open_args = (proto, runtime.yielding(), workdir, data_dir)  # runs alternate with BLAS-heavy statistics
        self._rollout = rollout
        self._graph = CalibrationGraph(proto, self.layouts, self.opset)
        self._kept_infos: dict = {}
        """Value infos of the kept activations (`CalibrationGraph.infos`)."""
        self._full_cache: list[dict[str, np.ndarray]] | None = None
        self._session = None
        self._samples: list | None = None
        self._nominal: Nominal | None = None
        """The original's calibration rollout, for `drift`."""
        self._engine: RolloutEngine | None = None
        self.keep_activations = True
        """Start each wave from the activations kept from the waves before (False: from the model input, every wave)."""
        self._kept: list[dict[str, np.ndarray]] | None = None
        """Per sample, the activations of this pass's last waves that later layers read (valid now)."""
        self._ran: set[int] = set()
        """Indices of the nodes this pass's wave sessions ran."""
        self._stats_cache: dict[tuple, list[Hessian]] = {}
        """Statistics by `_stats_key`, kept across passes (within `_budget`): a pass whose weights upstream of a
        use are encoded as an earlier pass's were collects the same rows (a first layer: every pass)."""
        self._stats_bytes = 0
        self.keep_statistics = True
        """Keep statistics across passes. False for a large model: its measuring session opens between passes, and
        statistics held beside it would be up to a quarter of the model more (`KEPT_SHARE`)."""
        self._digests: dict[str, bytes] = {}
        """This pass's encodings' digests (`tqsdeploy.encoding.checkpoints.digest`), by weight."""
        self.profile = Profile()
        """Where calibration's time goes (the encoder hands over its own)."""

    @property
    def groups(self) -> list[list[str]]:
        """The weights in the order they are encoded: the uncalibratable ones, then each wave."""
        return [self.first, *self.waves]

    @property
    def samples(self) -> list:
        """The inputs of every step of the nominal rollout: made by the first pass that collects
        statistics (a pass read whole from checkpoints opens no session)."""
        if self._samples is None:
            contexts, spec, max_batch = self._rollout
            with self.profile.section("calibration_rollouts"):
                self._samples = RolloutEngine(self.session, contexts, spec, max_batch).states() if self.waves else []
            graph_ops.release_pages(self.weights)  # the nominal rollout read every original weight
        return self._samples

    def drift(self, weights: Mapping[str, np.ndarray]) -> Drift:
        """How far the model with `weights` fed strays from the original over the calibration rollout (the
        windows and steps the statistics come from): a baseline's measure when it chooses between encodings
        (`baselines.quantize_baseline`, `--grids auto`). The original's rollout is made once, on this session."""
        if self._engine is None:  # its batching decision is a run: made once per session (`release` drops it)
            self._engine = RolloutEngine(self.session, *self._rollout)
        with self.profile.section("calibration_rollouts"):
            raised = self.opset > default_opset(self._open_args[0])
            if (
                self._nominal is None
            ):  # raised: the original at its own opset, what a rollout of the written file is compared with
                self._nominal = (
                    original_nominal(
                        self._open_args[0], self.layouts, self.weights, self._rollout, *self._open_args[1:]
                    )
                    if raised
                    else self._engine.nominal()
                )
            if raised:
                self._engine.assume(self._nominal.batched)
            return self._engine.drift(self._nominal, self._engine.steps(dict(weights)))

    def run(
        self,
        encode: EncodeFn,
        cross: bool,
        log: CalibrationLog | None = None,
        checkpoints=None,
        found: Mapping[str, tuple] | None = None,
        reused: Mapping[str, Encoded] | None = None,
    ) -> dict[str, Encoded]:
        """Encode every weight: uncalibratable ones first, then wave by wave on statistics
        collected with all earlier weights at their encodings. With `checkpoints`
        (`tqsdeploy.encoding.checkpoints.PassCheckpoints`) each finished weight is saved, and a weight saved
        before (in `found`, from its `resume`, or found now) is read instead; a wave's statistics
        are collected only for the weights it still has to encode. `reused`: encodings an earlier
        pass made that this one would make again (`Encoder._same`), taken as they are, not solved."""
        log = log if log is not None else CalibrationLog()
        started = perf_counter()
        encoded: dict[str, Encoded] = {}
        self._kept, self._ran = (
            ([] if self.keep_activations else None),
            set(),
        )  # another pass's activations are not this one's
        self._digests = {}
        found = dict(found or {})
        reused = dict(reused or {})
        for index, names in enumerate(self.groups):
            if checkpoints is not None:
                for name in names:
                    if name not in found and (loaded := checkpoints.load(name)) is not None:
                        found[name] = loaded
            missing = [n for n in names if n not in found and n not in reused]
            stats = self._collect(missing, encoded, cross, names) if index and missing else None
            with self.profile.section(
                "solver"
            ):  # the solves' own sections are in their threads when they run in parallel
                solved = self._solve(missing, stats, encode)
            solved.update({n: (reused.pop(n), None, None) for n in names if n in reused and n not in found})
            digests = {}
            for name in names:
                if name in found:
                    encoded[name], meta = found.pop(name)
                    rows, thin = meta.get("rows"), meta.get("thin")
                    digests[name] = meta["digest"]
                else:
                    encoded[name], rows, thin = solved.pop(name)
                    if checkpoints is not None:
                        digests[name] = checkpoints.save(name, encoded[name], rows, thin)
                if rows is not None:
                    log.rows[name] = rows
                if thin:
                    log.thin[name] = thin
            if checkpoints is not None:
                checkpoints.advance(digests)
            self._forget(names)
            large = sum(_statistics_bytes(parts) for parts in (stats or {}).values()) >= TRIM_AFTER_BYTES
            stats = None  # K x K float64 per use: gone before the next wave collects its own
            graph_ops.release_pages(self.weights)
            if large:
                release_freed_memory()
        log.seconds += perf_counter() - started
        self._kept = None
        return encoded

    def _solve(
        self, names: list[str], stats: dict | None, encode: EncodeFn
    ) -> dict[str, tuple[Encoded, int | None, int | None]]:
        """Encode the wave's weights (on `stats`, when collected): (encoding, rows, input width when thin) by
        name. Weights of a wave are independent, so they are solved side by side in threads (numpy and
        LAPACK release the GIL), the cores' BLAS threads split between them (`tiers.solver_backend.shared_cores`).
        A statistic's factorizations go as soon as the last weight reading it is done."""
        readers: dict[tuple, int] = {}
        for name in names:
            for use in {u.key for u in self.layouts[name].uses}:
                readers[use] = readers.get(use, 0) + 1
        done = threading.Lock()

        def one(name: str) -> tuple[Encoded, int | None, int | None]:
            merged = rows = thin = None
            layout = self.layouts[name]
            if stats is not None:
                merged = [Hessian.merge([stats[use.key][g] for use in layout.uses]) for g in range(layout.row_groups)]
                rows = merged[0].count
                thin = merged[0].H.shape[0] if any(is_thin(m) for m in merged) else None  # its input width
            # no rows at all (an RNN's R over one-step windows with no state fed): nothing to weigh, rounded to nearest
            result = encode(name, merged if merged is None or any(m.count for m in merged) else None)
            if stats is not None:
                with done:
                    for key in {u.key for u in layout.uses}:
                        readers[key] -= 1
                        if not readers[key]:
                            for part in stats[key]:
                                part.factors.clear()
            return result, rows, thin

        workers = min(len(names), solver_threads())
        if workers <= 1:
            return {name: one(name) for name in names}
        with shared_cores(workers), ThreadPoolExecutor(workers, thread_name_prefix="tqs-solve") as pool:
            return dict(zip(names, pool.map(one, names)))

    def _collect(
        self, wave: list[str], encoded: Mapping[str, Encoded], cross: bool, group: list[str] | None = None
    ) -> dict:
        """Statistics of the `wave`'s weights (of `group`, the weights quantized next): those an earlier pass
        collected on the same encodings of every weight upstream come from `_stats_cache`."""
        every = {u.key: (u, self.layouts[name].row_groups) for name in wave for u in self.layouts[name].uses}
        keys = {key: self._stats_key(use, groups, cross, encoded) for key, (use, groups) in every.items()}
        cached = {key: self._stats_cache[keys[key]] for key in every if keys[key] in self._stats_cache}
        uses = {key: value for key, value in every.items() if key not in cached}
        if not uses:
            return cached
        readers: dict[tuple, int] = {}
        for name in wave:
            for use in self.layouts[name].uses:
                readers[use.key] = max(readers.get(use.key, 0), len(self.layouts[name].uses))
        statistics = WaveStatistics(uses, cross, len(self.samples), readers)
        fetch = sorted({u.x for u, _ in uses.values()} - self._graph.inputs)
        if self._kept == []:
            self._kept = [{} for _ in self.samples]
        kept = self._kept  # what this wave's session reads, even if keeping stops during the wave
        compute = [name for name in fetch if not kept or name not in kept[0]]
        with self.profile.section("calibration_rollouts"):
            session, outputs = self._wave_session(compute, encoded, group or wave) if compute else (None, [])
        try:
            for index, feeds in enumerate(self.samples):
                quantized = self._run(session, {**feeds, **kept[index]} if kept else feeds, outputs, compute)
                if self._kept is not None:
                    self._keep(index, quantized, outputs)
                full = self._full(index, feeds, fetch) if cross and encoded else quantized
                with self.profile.section("statistics"):
                    statistics.add(quantized, None if full is quantized else full)
        finally:
            if session is not None:
                session.close()  # its arena holds activations, not weights: freed with it, no trim needed
        with self.profile.section("statistics"):
            stats = statistics.finish()  # the last rows folded in here, not inside a solve's timing
        for key, parts in stats.items():
            size = _statistics_bytes(parts)
            if parts and self.keep_statistics and self._stats_bytes + size <= self._budget():
                self._stats_cache[keys[key]] = parts
                self._stats_bytes += size
        return {**stats, **cached}

    def _stats_key(self, use, groups: int, cross: bool, encoded: Mapping[str, Encoded]) -> tuple:
        """What a use's statistics depend on: the use, and the encoding of every weight upstream of its
        input (None: still at full precision)."""
        upstream, _ = self._graph.tensors
        above = sorted(upstream.get(use.x, frozenset()))
        for name in above:
            if name in encoded and name not in self._digests:
                self._digests[name] = digest(
                    name, encoded[name], self.weights.get(name) if hasattr(self.weights, "get") else None
                )
        return (
            use.key,
            groups,
            cross,
            tuple((name, self._digests.get(name) if name in encoded else None) for name in above),
        )

    def _budget(self, share: float = KEPT_SHARE) -> float:
        """Bytes a cache may hold: `share` of the weights' bytes (default `KEPT_SHARE`: kept activations, and statistics
        kept across passes, each), at least `FULL_CACHE_FLOOR`."""
        return max(
            FULL_CACHE_FLOOR,
            share * sum(4 * int(np.prod(layout.shape, dtype=np.int64)) for layout in self.layouts.values()),
        )

    def _wave_session(self, fetch: list[str], encoded: Mapping[str, Encoded], group: list[str]):
        """A session computing only `fetch` from the model's inputs and the activations kept from earlier
        waves, every weight of `encoded` it reads rebuilt from fed codes (or fed dequantized, for forms kept
        as floats); the other weights fed as they are. Returns it and what it outputs: `fetch`, then the
        activations it computes that later nodes read and that `group` (quantized next) leaves valid."""
        given = {}
        outputs = list(fetch)
        if self._kept is not None:
            upstream, readers = self._graph.tensors
            kept = self._kept[0] if self._kept else {}
            given = {name: self._kept_infos[name] for name in kept if name in self._kept_infos}
            nodes = needed_nodes(self._graph.proto, fetch, given)
            inside, changed = set(nodes), set(group)
            made = [o for i in nodes for o in self._graph.proto.graph.node[i].output if o]
            outputs += [
                o
                for o in made
                if o not in set(fetch)
                and not readers.get(o, set()) <= inside
                and not upstream.get(o, frozenset()) & changed
            ]
            self._kept_infos.update(self._graph.infos(outputs, encoded))
            outputs = [
                o for o in outputs if o in set(fetch) or o in self._kept_infos
            ]  # a tensor whose type cannot be told is not kept
            self._ran |= inside
        proto, fed = fed_codes_model(
            self._graph.proto,
            encoded,
            outputs,
            {**given, **{o: self._kept_infos[o] for o in outputs if o in self._kept_infos}},
        )
        source = graph_ops.io.session_source(proto, self._open_args[2])
        del proto
        return WithDefaults(self._open_source(source), fed, self.weights), outputs

    def upstream(self, name: str) -> frozenset:
        """The weights whose encodings weight `name`'s statistics depend on: those upstream of its inputs."""
        return self._graph.upstream(name)

    def depends_on(self, name: str) -> frozenset:
        """The weights whose codes weight `name`'s codes depend on: those upstream of its inputs encoded before it
        (the rest, itself included, are at full precision when its statistics are collected)."""
        group = self._group_of[name]
        return frozenset(u for u in self._graph.upstream(name) if self._group_of.get(u, group) < group)

    def _keep(self, index: int, values: Mapping[str, np.ndarray], outputs: list[str]) -> None:
        """Keep sample `index`'s activations that later waves read (`outputs` past `fetch`, and `fetch`
        itself: the wave's weights read it when the next wave runs them), and drop those no node still to
        run reads; past `KEPT_SHARE` of the weights' bytes nothing is kept any more this pass."""
        _, readers = self._graph.tensors
        kept = self._kept[index]
        kept.update({name: values[name] for name in outputs})
        for name in [n for n in kept if readers.get(n, set()) <= self._ran]:
            del kept[name]
        if sum(v.nbytes for sample in self._kept for v in sample.values()) > self._budget():
            self._kept = None

    def _forget(self, names: list[str]) -> None:
        """Drop the kept activations computed with any of `names` (just quantized) upstream at full precision."""
        if not self._kept:
            return
        upstream, _ = self._graph.tensors
        changed = set(names)
        for kept in self._kept:
            for name in [n for n in kept if upstream.get(n, frozenset()) & changed]:
                del kept[name]

    def _full(self, index: int, feeds, fetch) -> dict[str, np.ndarray]:
        """Full-precision layer inputs of sample `index`. They are the same for every wave and every
        pass, so all of them come from one run per sample and are kept while they take at most
        `FULL_CACHE_SHARE` of the weights' bytes (or `FULL_INPUTS_FLOOR`); a run with nothing fed reads every
        original weight, which late in a pass would sit beside the quantized copies of most of them."""
        if self._full_cache is None:
            self._full_cache = self._cache_full()
        if self._full_cache:
            return self._full_cache[index]
        values = self._run(self.session, feeds, fetch)
        graph_ops.release_pages(
            self.weights
        )  # a run of the original reads every weight: not kept beside the wave's work
        return values

    def full_inputs(self, names: list[str]):
        """Per calibration sample, its model inputs and the full-precision layer inputs `names` (`_full`)."""
        fetch = sorted(set(names) - self._graph.inputs)
        for index, feeds in enumerate(self.samples):
            yield self._full(index, feeds, fetch)

    def _cache_full(self) -> list[dict[str, np.ndarray]]:
        every = sorted(
            {use.x for wave in self.waves for name in wave for use in self.layouts[name].uses} - self._graph.inputs
        )
        budget = max(FULL_INPUTS_FLOOR, self._budget(FULL_CACHE_SHARE))
        cached, size = [], 0
        for feeds in self.samples:
            values = self._run(self.session, feeds, every)
            graph_ops.release_pages(self.weights)
            size += sum(values[name].nbytes for name in every)
            if size > budget:
                return []
            cached.append(values)
        return cached

    def _run(self, session, feeds, outputs, fetch=None) -> dict[str, np.ndarray]:
        """`feeds` with what `session` makes of them (`outputs`); the layer inputs among them (`fetch`,
        default all) checked finite."""
        values = dict(feeds)
        if outputs:
            with self.profile.section("calibration_rollouts"):
                values.update(session.run({name: feeds[name] for name in self._inputs(session, feeds)}, outputs))
        for name in outputs if fetch is None else fetch:
            if np.issubdtype(values[name].dtype, np.floating) and not np.all(np.isfinite(values[name])):
                raise CalibrationError(f"layer input '{name}' is not finite on the calibration windows")
        return values

    @staticmethod
    def _inputs(session, feeds) -> list[str]:
        """The names of `feeds` that `session` takes (a wave's session takes only the kept activations it reads)."""
        taken = {spec.name for spec in session.inputs}
        return [name for name in feeds if name in taken]

    def _open(self):
        """A session of the model with every scored weight a plain input (fed from `weights` unless a
        run feeds its own) and every layer input an output."""
        source = graph_ops.io.session_source(self._graph.proto, self._open_args[2])
        return WithDefaults(self._open_source(source), self.weights)

    def _open_source(self, source):
        return open_graph(self._open_args[1], source, self._open_args[3], "the calibration graph")

    @property
    def session(self):
        """The calibration session, opened again if `release` closed it."""
        if self._session is None:
            self._session = self._open()
        return self._session

    def release(self) -> None:
        """Close the session (it holds a copy of the model) until the next pass needs it."""
        if self._session is not None:
            self._session.close()
            self._session = None
            self._engine = None
            release_freed_memory()

    def close(self) -> None:
        self.release()
