"""Build the small recurrent forecasters that bench_recurrent.py quantizes (about a minute on 2 CPU cores).

Three models, 2 layers of hidden size 64, one series in (z-scored ETTh1 OT, 96 hourly steps) and 24 steps out:
`lstm`, `gru` and `lstm_bidir` (a bidirectional LSTM). Each is trained briefly (150 Adam steps, batch 32, on rows
before 12000) and exported to ONNX (opset 17) twice with the same weights, because the two exporters lay the
recurrent weights out differently: torch's default (dynamo) exporter as NAME.onnx and the legacy TorchScript
exporter as NAME_ts.onnx. For every model it writes NAME.ctx.npz (scoring windows: 8 windows x 4 series from
row 3000), NAME.heldout.npz (held-out windows from row 12600, outside training) and *_truth.npz (the next
8 x 24 rows, for an 8-step rollout).

Needs torch (a CPU build: `pip install torch==2.13.0 onnx onnxscript`) in an environment of its own: tqsdeploy
itself does not use torch. Nothing is downloaded; the data is the repository's ../shared/data/ETTh1.csv.
Every model is seeded on its own (torch and numpy seed 0, one thread), so a rebuild gives the same weights
whichever models are asked for.

    python benchmarks/recurrent/build_models.py --out DIR [--data ETTh1.csv] [--only lstm,gru]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "ETTh1.csv"
CONTEXT, HORIZON = 96, 24
TRAIN_END = 12000
"""Rows the models train on (and the z-score is fitted on); the held-out windows start after it."""
WINDOW_STARTS = {"ctx": 3000, "heldout": 12600}


def load_series(path: Path) -> np.ndarray:
    """ETTh1's oil temperature, z-scored on the training rows."""
    with open(path) as handle:
        ot = np.array([float(row["OT"]) for row in csv.DictReader(handle)], dtype=np.float32)
    return (ot - ot[:TRAIN_END].mean()) / ot[:TRAIN_END].std()


class Forecaster(nn.Module):
    """A 2-layer LSTM or GRU read at its last step by a linear head: (batch, 96, 1) -> (batch, 24, 1)."""

    def __init__(self, cell: type[nn.Module], bidirectional: bool = False):
        super().__init__()
        self.rnn = cell(1, 64, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(64 * (2 if bidirectional else 1), HORIZON)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1]).unsqueeze(-1)


MODELS = {
    "lstm": lambda: Forecaster(nn.LSTM),
    "gru": lambda: Forecaster(nn.GRU),
    "lstm_bidir": lambda: Forecaster(nn.LSTM, bidirectional=True),
}


def train(model: nn.Module, series: np.ndarray, steps: int = 150, batch: int = 32) -> float:
    """A fixed number of steps (no time limit), so the weights do not depend on the machine's load."""
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    model.train()
    for _ in range(steps):
        starts = np.random.randint(0, TRAIN_END - CONTEXT - HORIZON, size=batch)
        x = torch.from_numpy(np.stack([series[i : i + CONTEXT] for i in starts])[..., None])
        y = torch.from_numpy(np.stack([series[i + CONTEXT : i + CONTEXT + HORIZON] for i in starts])[..., None])
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return float(loss)


def windows(
    series: np.ndarray, start: int, count: int = 8, batch: int = 4, steps: int = 8, stride: int = 211
) -> tuple[np.ndarray, np.ndarray]:
    """Contexts (count, batch, 96, 1) of consecutive series 7 rows apart, and truth (count, steps, batch, 24, 1)."""
    contexts, truth = [], []
    for w in range(count):
        offsets = [start + w * stride + b * 7 for b in range(batch)]
        contexts.append(np.stack([series[i : i + CONTEXT] for i in offsets]))
        ahead = [
            np.stack([series[i + CONTEXT + k * HORIZON : i + CONTEXT + (k + 1) * HORIZON] for k in range(steps)])
            for i in offsets
        ]
        truth.append(np.stack(ahead, axis=1))
    return np.stack(contexts)[..., None].astype(np.float32), np.stack(truth)[..., None].astype(np.float32)


def export_both(model: nn.Module, name: str, out: Path) -> None:
    """NAME.onnx from torch's default (dynamo) exporter, NAME_ts.onnx from the legacy TorchScript one."""
    sample = (torch.randn(2, CONTEXT, 1),)
    names = {"input_names": ["x"], "output_names": ["y"], "opset_version": 17}
    batch = torch.export.Dim("batch", min=1, max=1024)
    torch.onnx.export(
        model,
        sample,
        str(out / f"{name}.onnx"),
        dynamo=True,
        external_data=False,
        dynamic_shapes=({0: batch},),
        **names,
    )
    torch.onnx.export(
        model, sample, str(out / f"{name}_ts.onnx"), dynamo=False, dynamic_axes={"x": [0], "y": [0]}, **names
    )


def build(name: str, series: np.ndarray, out: Path) -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    model = MODELS[name]()
    loss = train(model, series)
    export_both(model, name, out)
    for tag, start in WINDOW_STARTS.items():
        contexts, truth = windows(series, start)
        for stem in (name, f"{name}_ts"):
            np.savez(out / f"{stem}.{tag}.npz", x=contexts)
            np.savez(out / f"{stem}.{tag}_truth.npz", y=truth)
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, last training loss {loss:.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the models and their windows")
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help="ETTh1.csv (default: the repository's ../shared/data)"
    )
    parser.add_argument("--only", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    series = load_series(args.data)
    for name in args.only.split(","):
        build(name, series, args.out)


if __name__ == "__main__":
    main()
