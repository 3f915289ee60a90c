"""`inspect`: what a score run would see, without running a sweep."""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from pathlib import Path

import graph_ops
from runtimes import DEFAULT_RUNTIME
from tqsdeploy.errors import InputError, RolloutError
from tqsdeploy.files import write_text
from tqsdeploy.rollout import DEFAULT_STEPS, AmbiguousRollout, RolloutSpec, detect_rollout, resolve_spec
from tqsdeploy.rollout.contexts import npz_layout
from tqsdeploy.units import UnitSelection, index_rows, nonfinite_weights, select_units, selection_notes


def _io(specs) -> list[dict]:
    return [
        {"name": s.name, "shape": [d if d is not None else "?" for d in s.shape], "dtype": str(s.dtype)} for s in specs
    ]


def inspect_model(
    model: str | Path,
    spec: RolloutSpec | str | Path | None = None,
    steps: int | None = None,
    selection: UnitSelection = UnitSelection(),
) -> dict:
    """Signature, op census, quantizable units and the rollout, as plain data."""
    loaded = graph_ops.load_model(model, load_external=False)  # shapes and types only; the runtime reads the weights
    tensors, unfed = (
        graph_ops.find_weight_tensors(loaded.proto),
        graph_ops.layout.unfed_float_tensors(loaded.proto.graph),
    )
    units = select_units(tensors, selection, unfed)
    loaded, session = _open(model, loaded)
    rollout = _rollout(spec, steps, session.inputs, session.outputs)
    nonfinite = _nonfinite(loaded, units)
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
        "units": [_unit(u) for u in units],
        "unit_params": unit_params,
        "unit_share": unit_params / float_params if float_params else 0.0,
        "rollout": rollout,
        "notes": selection_notes(loaded, tensors, units, selection, unfed)
        + (
            [
                f"{len(nonfinite)} weight(s) hold NaN or Inf "
                f"({', '.join(nonfinite[:3])}{', ...' if len(nonfinite) > 3 else ''}): "
                "score, export and baseline refuse this model as it is"
            ]
            if nonfinite
            else []
        ),
        "nonfinite_weights": nonfinite,
        "contexts": {
            "npz": npz_layout(session.inputs),
            "dynamic_axes": sorted({d for s in session.inputs for d in s.shape[1:] if isinstance(d, str)}),
            "index_rows": index_rows(loaded.proto),
        },
    }


def _open(model: str | Path, loaded):
    """A session of the model, and the model as loaded for it (with its weights where the runtime needs a copy)."""
    runtime = DEFAULT_RUNTIME.for_model(loaded.proto)
    source = graph_ops.io.runnable_path(loaded)
    if source is None:  # IR too new: the runtime gets a clamped copy (in a temporary folder when over 2 GiB)
        loaded = graph_ops.load_model(model)
        with tempfile.TemporaryDirectory(prefix="tqs-inspect-") as folder:
            return loaded, runtime.open(
                graph_ops.io.session_source(graph_ops.io.runtime_compatible(loaded.proto), folder)
            )
    return loaded, runtime.open(source)


def _unit(u) -> dict:
    return {
        "unit": u.name,
        "label": u.label,
        "shape": u.shape,
        "params": u.params,
        "op_types": list(u.op_types),
        "nodes": list(u.nodes),
        "tensors": u.tensor_names,
    }


def _nonfinite(loaded, units) -> list[str]:
    """The units' weights holding NaN or Inf, which score refuses: said here, before anyone starts a sweep."""
    data_dir = loaded.path.parent.resolve() if graph_ops.io.has_external_data(loaded.proto) else None
    return nonfinite_weights(
        graph_ops.model_weights(loaded.proto, [n for u in units for n in u.tensor_names], data_dir)
    )


def _rollout(spec, steps, inputs, outputs) -> dict:
    """The rollout as plain data; a detected one also says why (reasons, unused outputs, constant inputs)."""
    if spec is not None:  # the user's spec is wrong: an input error (exit 2), not a detection report
        return resolve_spec(spec, steps, inputs, outputs).to_dict()
    try:
        found = detect_rollout(inputs, outputs, steps, DEFAULT_STEPS)
        found.spec.check(inputs, outputs)
    except AmbiguousRollout as exc:
        return {"error": str(exc).split("\n")[0], "candidates": [c.spec.to_toml(c.reasons) for c in exc.candidates]}
    except RolloutError as exc:
        return {"error": str(exc)}
    return {
        **found.spec.to_dict(),
        "toml": found.spec.to_toml(found.reasons),
        "reasons": found.reasons,
        "unused_outputs": list(found.unused_outputs),
        "constant_inputs": list(found.constant_inputs),
        "single_step": found.single_step,
    }


def emit_spec(info: dict, path: str | Path, force: bool = False) -> str:
    """Write the rollout `inspect` found to `path` for the user to edit; returns what was written.

    Ambiguous candidates are all written commented out: the user picks one.
    """
    path = Path(path)
    if path.exists() and os.path.samefile(path, info["model"]):
        raise InputError(
            f"--emit-spec {path} is the model file itself; the input is never overwritten", hint="name a .toml file"
        )
    if path.exists() and not force:
        raise InputError(f"{path} already exists; pass --force to overwrite it")
    rollout = info["rollout"]
    header = f"# rollout spec for {info['model']} (tqsdeploy inspect --emit-spec)\n"
    if "candidates" in rollout:
        header += "# AMBIGUOUS: these pairings fit equally well. Uncomment exactly one candidate, then pass --spec.\n"
        body = "\n".join(
            f"# --- candidate {i} ---\n" + "".join(f"# {line}\n" if line else "#\n" for line in toml.splitlines())
            for i, toml in enumerate(rollout["candidates"], 1)
        )
    elif "error" in rollout:
        raise RolloutError(f"no rollout spec to emit: {rollout['error']}")
    else:
        if rollout["origin"] == "detected":
            header += "# detected from the model's shapes and names; edit as needed (README 'Rollout specs')\n"
        if rollout.get("unused_outputs"):
            header += (
                f"# outputs that feed nothing and stay out of the trajectory: {', '.join(rollout['unused_outputs'])}\n"
            )
        if rollout.get("constant_inputs"):
            header += f"# inputs held constant: {', '.join(rollout['constant_inputs'])}\n"
        body = rollout.get("toml") or RolloutSpec.from_dict(rollout).to_toml()
    text = header + "\n" + body
    write_text(path, text)
    return text
