"""Sessions of the graphs encoding and measuring run: the original's rollout at its own opset, and a graph opened
with its external data found."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

import graph_ops
from runtimes import Runtime, WithDefaults
from tqsdeploy.errors import InputError
from tqsdeploy.rollout.engine import Nominal, RolloutEngine


def original_nominal(
    proto,
    names,
    weights: Mapping[str, np.ndarray],
    rollout: tuple,
    runtime: Runtime,
    workdir: Path | None,
    data_dir: Path | None,
) -> Nominal:
    """The original's rollout (`rollout`: contexts, spec, max batch) at its own opset, on a session fed its
    weights `names` as measuring sessions are fed theirs: what a drift is measured from when those run the model
    converted to the opset the file is written at (the original as the user runs it, and `eval` compares with)."""
    graph = graph_ops.weights_as_graph_inputs(proto, list(names))
    session = WithDefaults(
        open_graph(runtime, graph_ops.io.session_source(graph, workdir), data_dir, "the original model"), weights
    )
    del graph
    try:
        return RolloutEngine(session, *rollout).nominal()
    finally:
        session.close()


def open_graph(runtime: Runtime, source: bytes | Path, data_dir: Path | None, what: str):
    """A session of a graph made here (`graph_ops.io.session_source`); `data_dir`: the folder of the data
    files its tensors point into (a streamed model's own), else a written copy's folder."""
    try:
        return runtime.open(
            source,
            external_data_dir=data_dir
            if data_dir is not None
            else None
            if isinstance(source, bytes)
            else source.parent,
        )
    except Exception as exc:
        raise InputError(f"ONNX Runtime cannot load {what}: {str(exc).splitlines()[0]}") from None
