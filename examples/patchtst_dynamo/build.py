"""Train a PatchTST-like forecaster briefly on ETTh1 and export it as a user would: torch's default exporter.

The walk-through of docs/your-own-model.md ("A model from torch.onnx.export(dynamo=True)"): a model written and
trained outside this repository, exported with `torch.onnx.export(..., dynamo=True, external_data=True)`, whose
weights therefore carry the exporter's generated names (`val_33`) where a Linear's weight was transposed for a
MatMul, with the module scopes kept in the nodes' metadata (`pkg.torch.onnx.name_scopes`).

Channel-independent, like PatchTST: one univariate series per batch row, 336 hours in, 24 hours out
(x [batch, 336] -> forecast [batch, 24]). RevIN removes each window's mean and standard deviation and restores
them at the output, so the model takes raw values (trained on standardised columns; the CSVs here hold raw `OT`).
Patches of 16 (21 tokens) -> `embed` Linear(16, 64) + learned positions -> 2 pre-norm layers (`attn.q/k/v/o`
64 -> 64, 4 heads; `ff.up` 64 -> 96, GELU, `ff.down` 96 -> 64) -> LayerNorm -> flatten -> `head` Linear(1344, 24).

Needs torch (2.13: `pip install torch==2.13.0 onnxscript`) and onnxruntime; the toolkit itself never imports torch.
Run from the repo root:  python examples/patchtst_dynamo/build.py [--data PATH] [--steps 1500]
"""

import argparse
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "ETTh1.csv"
COLUMNS = ["HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT"]
TRAIN = (0, 8640)
"""The standard ETT split's train rows (the scoring and held-out rows below come after them)."""
SCORE_ROWS = (10560, 11520)
"""The last 960 rows of the validation split: `score.csv`, the windows `score` cuts."""
HELDOUT_ROWS = (11520, 13440)
"""The first 1,920 rows of the test split: `heldout.csv`, the windows and truth `eval` and `gate` read."""
TEST = (11520, 14400)
"""The standard split's test rows: the README's metrics."""
L, H, PATCH, D, HEADS, FFN = 336, 24, 16, 64, 4, 96


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, h):
        n, dh = h.shape[1], D // HEADS
        q, k, v = (f(h).reshape(-1, n, HEADS, dh).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = torch.softmax(q @ k.transpose(-1, -2) / dh**0.5, dim=-1)
        return self.o((att @ v).transpose(1, 2).reshape(-1, n, D))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, FFN), nn.Linear(FFN, D)

    def forward(self, h):
        return self.down(nn.functional.gelu(self.up(h)))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.ff = nn.LayerNorm(D), Attention(), nn.LayerNorm(D), FeedForward()

    def forward(self, h):
        h = h + self.attn(self.ln1(h))
        return h + self.ff(self.ln2(h))


class PatchTST(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(PATCH, D)
        self.pos = nn.Parameter(0.02 * torch.randn(L // PATCH, D))
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(L // PATCH * D, H)

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        sd = ((x - mu) ** 2).mean(-1, keepdim=True).sqrt() + 1e-5
        h = self.embed(((x - mu) / sd).reshape(-1, L // PATCH, PATCH)) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.head(self.ln(h).reshape(-1, L // PATCH * D)) * sd + mu


def train(series: np.ndarray, steps: int) -> PatchTST:
    """`steps` batches of 128 random (336 + 24)-hour windows of the train rows, one standardised column each, MSE
    (seeded, one thread: the same model each time)."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = PatchTST()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    data = series[slice(*TRAIN)]
    data = ((data - data.mean(0)) / data.std(0)).astype(np.float32)
    started = time.time()
    for step in range(1, steps + 1):
        starts, cols = rng.integers(0, len(data) - L - H, 128), rng.integers(0, data.shape[1], 128)
        window = torch.from_numpy(data[starts[:, None] + np.arange(L + H), cols[:, None]])
        loss = ((model(window[:, :L]) - window[:, L:]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(f"step {step}: train MSE {loss.item():.3f} ({time.time() - started:.0f} s)", flush=True)
    return model.eval()


def write_csv(path: Path, lines: list[str], rows: tuple[int, int]) -> None:
    """Rows `rows` of ETTh1's `date` and `OT` columns (its first and last), the values as the file has them."""
    path.write_text(
        "date,OT\n" + "".join(f"{line.split(',')[0]},{line.split(',')[-1]}\n" for line in lines[slice(*rows)])
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--steps", type=int, default=1500, help="training batches (about 3 min on one CPU thread)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    header, *lines = args.data.read_text().splitlines()
    assert header.split(",") == ["date", *COLUMNS], header
    raw = np.array([[float(v) for v in line.split(",")[1:]] for line in lines], dtype=np.float32)
    model = train(raw, args.steps)

    path = HERE / "model.onnx"
    for stale in (path, HERE / "model.onnx.data"):
        stale.unlink(missing_ok=True)
    torch.onnx.export(
        model,
        (torch.from_numpy(raw[:2, -1].repeat(L).reshape(2, L)),),
        str(path),
        dynamo=True,
        external_data=True,
        input_names=["x"],
        output_names=["forecast"],
        dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
    )
    write_csv(HERE / "score.csv", lines, SCORE_ROWS)
    write_csv(HERE / "heldout.csv", lines, HELDOUT_ROWS)

    proto = onnx.load(str(path), load_external_data=False)
    names = [t.name for t in proto.graph.initializer if len(t.dims) == 2 and np.prod(t.dims) >= 1024]
    print(f"IR {proto.ir_version}, opset {proto.opset_import[0].version}; 2-D weights: {', '.join(names)}")
    print(f"params {sum(p.numel() for p in model.parameters()):,}")
    report(model, path, raw)


def report(model: PatchTST, path: Path, raw: np.ndarray) -> None:
    """The README's test metrics, from the exported file as onnxruntime runs it (and its match with torch)."""
    train = raw[slice(*TRAIN)]
    z = (raw - train.mean(0)) / train.std(0)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for label, columns in (("all 7 columns", slice(None)), ("OT alone", slice(6, 7))):
        starts = range(TEST[0] - L, TEST[1] - L - H + 1, 24)
        windows = np.stack([z[s : s + L + H, columns] for s in starts]).transpose(0, 2, 1).reshape(-1, L + H)
        windows = windows.astype(np.float32)
        got = session.run(None, {"x": windows[:, :L]})[0]
        with torch.no_grad():
            assert np.abs(got - model(torch.from_numpy(windows[:, :L])).numpy()).max() < 1e-3
        truth, last = windows[:, L:], windows[:, L - 1 : L]
        print(
            f"test, {label}: {len(windows)} windows, MSE {((got - truth) ** 2).mean():.3f} MAE "
            f"{np.abs(got - truth).mean():.3f} (repeat last value {((last - truth) ** 2).mean():.3f} / "
            f"{np.abs(last - truth).mean():.3f})"
        )


if __name__ == "__main__":
    main()
