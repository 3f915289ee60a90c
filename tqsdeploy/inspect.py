"""`inspect`: what a score run would see, without running a sweep."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import graph_ops
from runtimes import OrtRuntime
from tqsdeploy.errors import RolloutError
from tqsdeploy.rollout import RolloutSpec
from tqsdeploy.score import resolve_spec
from tqsdeploy.units import UnitSelection, select_units


def _io(specs) -> list[dict]:
    return [{"name": s.name, "shape": [d if d is not None else "?" for d in s.shape], "dtype": str(s.dtype)} for s in specs]


def inspect_model(
    model: str | Path,
    spec: RolloutSpec | str | Path | None = None,
    steps: int | None = None,
    selection: UnitSelection = UnitSelection(),
) -> dict:
    """Signature, op census, quantizable units and the rollout, as plain data."""
    loaded = graph_ops.load_model(model)
    tensors = graph_ops.find_weight_tensors(loaded.proto)
    units = select_units(tensors, selection)
    session = OrtRuntime().open(graph_ops.model_bytes(graph_ops.io.runtime_compatible(loaded.proto)))
    try:
        rollout = resolve_spec(spec, steps, session.inputs, session.outputs).to_dict()
    except RolloutError as exc:
        rollout = {"error": str(exc)}
    unit_params = sum(u.params for u in units)
    float_params = sum(t.params for t in tensors)
    return {
        "model": str(loaded.path),
        "sha256": loaded.sha256,
        "bytes": loaded.file_bytes,
        "ir_version": loaded.proto.ir_version,
        "opsets": {o.domain or "ai.onnx": o.version for o in loaded.proto.opset_import},
        "inputs": _io(session.inputs),
        "outputs": _io(session.outputs),
        "ops": dict(Counter(n.op_type for n in loaded.proto.graph.node).most_common()),
        "float_tensors": len(tensors),
        "float_params": float_params,
        "units": [
            {"unit": u.name, "shape": u.shape, "params": u.params, "op_types": list(u.op_types), "nodes": list(u.nodes), "tensors": u.tensor_names}
            for u in units
        ],
        "unit_params": unit_params,
        "unit_share": unit_params / float_params if float_params else 0.0,
        "rollout": rollout,
    }
