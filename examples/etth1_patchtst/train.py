"""Train a small PatchTST-style forecaster on ETTh1 and export it to ONNX.

Channel-independent: each of the 7 columns is its own univariate series, so
the model maps one 512-hour history to the next 96 hours (x [batch, 512] ->
y [batch, 96]) and a window with all channels is simply a batch of 7.
Columns are standardised with the train split's mean/std (norm.json); inside
the model RevIN removes each window's mean/std and restores it at the output.
Patches of 16 (stride 16, 32 tokens) -> Linear(16, 64) + learned positions ->
2 pre-norm transformer layers (4 heads, FFN 128) -> flatten -> Linear(2048, 96).
Attention is written out with plain Linear/MatMul so the ONNX graph has
ordinary MatMul weights as initializers.

Run from the repo root:  python examples/etth1_patchtst/train.py [--data PATH]
"""

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper
from torch import nn

HERE = Path(__file__).resolve().parent
DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "ETTh1.csv"
COLS = ["HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT"]
TRAIN, VAL, TEST = (0, 8640), (8640, 11520), (11520, 14400)
L, H, PATCH, D, HEADS, FFN, STEPS, N_CTX = 512, 96, 16, 64, 4, 128, 8, 8


class EncoderLayer(nn.Module):
    """Pre-norm transformer layer with explicit multi-head attention."""

    def __init__(self, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.ff = nn.Sequential(nn.Linear(D, FFN), nn.GELU(), nn.Dropout(dropout), nn.Linear(FFN, D))
        self.drop = nn.Dropout(dropout)

    def forward(self, h):
        n, dh = L // PATCH, D // HEADS
        a = self.ln1(h)
        q, k, v = (f(a).reshape(-1, n, HEADS, dh).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = torch.softmax(q @ k.transpose(-1, -2) / dh**0.5, dim=-1)
        h = h + self.drop(self.o((self.drop(att) @ v).transpose(1, 2).reshape(-1, n, D)))
        return h + self.drop(self.ff(self.ln2(h)))


class PatchTST(nn.Module):
    def __init__(self, n_layers=2, dropout=0.2):
        super().__init__()
        n = L // PATCH
        self.embed = nn.Linear(PATCH, D)
        self.pos = nn.Parameter(0.02 * torch.randn(n, D))
        self.layers = nn.ModuleList(EncoderLayer(dropout) for _ in range(n_layers))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(n * D, H)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)  # RevIN: per-window statistics
        sd = ((x - mu) ** 2).mean(-1, keepdim=True).sqrt() + 1e-5
        z = ((x - mu) / sd).reshape(-1, L // PATCH, PATCH)
        h = self.drop(self.embed(z) + self.pos)
        for layer in self.layers:
            h = layer(h)
        y = self.head(self.ln(h).reshape(-1, L // PATCH * D))
        return y * sd + mu


def windows(series, lo, hi, stride=1):
    """All (history, target) pairs whose targets lie in rows [lo, hi); history may reach back before lo."""
    starts = np.arange(lo - L, hi - L - H + 1, stride)
    idx = starts[:, None] + np.arange(L + H)
    w = series[idx].transpose(0, 2, 1).reshape(-1, L + H)  # (n_starts * 7, L + H)
    return torch.from_numpy(w[:, :L].copy()), torch.from_numpy(w[:, L:].copy())


def evaluate(model, x, y, bs=4096):
    with torch.no_grad():
        p = torch.cat([model(x[i : i + bs]) for i in range(0, len(x), bs)])
    return ((p - y) ** 2).mean().item(), (p - y).abs().mean().item()


def name_initializers(m, model):
    """The exporter stores Linear weights applied to 3-D tensors as pre-transposed
    MatMul constants named onnx::MatMul_N; give them back their parameter names."""
    params = {k: v.detach().numpy().T for k, v in model.state_dict().items() if v.ndim == 2}
    renames = {}
    for t in m.graph.initializer:
        if t.name.startswith("onnx::"):
            arr = numpy_helper.to_array(t)
            hit = [k for k, v in params.items() if v.shape == arr.shape and np.array_equal(v, arr)]
            if len(hit) == 1:
                renames[t.name] = t.name = hit[0] + "_T"
    for node in m.graph.node:
        node.input[:] = [renames.get(i, i) for i in node.input]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--minutes", type=float, default=3.5, help="training wall-time cap")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)

    raw = np.loadtxt(args.data, delimiter=",", skiprows=1, usecols=range(1, 8), dtype=np.float64)
    mean, std = raw[slice(*TRAIN)].mean(0), raw[slice(*TRAIN)].std(0)
    data = ((raw - mean) / std).astype(np.float32)
    (HERE / "norm.json").write_text(
        json.dumps({"columns": COLS, "mean": mean.tolist(), "std": std.tolist(), "fit_rows": list(TRAIN)}, indent=1)
        + "\n"
    )

    train = data[slice(*TRAIN)]
    xv, yv = windows(data, *VAL, stride=4)
    model = PatchTST()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=1e-4)
    best, best_state, bad, it, t0 = float("inf"), None, 0, 0, time.time()
    while bad < 6 and time.time() - t0 < args.minutes * 60:
        model.train()
        for _ in range(100):  # random windows from the train split
            s, c = rng.integers(0, len(train) - L - H + 1, 128), rng.integers(0, 7, 128)
            w = torch.from_numpy(train[s[:, None] + np.arange(L + H), c[:, None]])
            loss = ((model(w[:, :L]) - w[:, L:]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            it += 1
        model.eval()
        val_mse, _ = evaluate(model, xv, yv)
        if val_mse < best:
            best, best_state, bad = val_mse, copy.deepcopy(model.state_dict()), 0
        else:
            bad += 1
        print(f"iter {it} train {loss.item():.3f} val MSE {val_mse:.4f} ({time.time() - t0:.0f}s)", flush=True)
    model.load_state_dict(best_state)
    model.eval()

    xt, yt = windows(data, *TEST)
    mse, mae = evaluate(model, xt, yt)
    naive = xt[:, -1:].expand_as(yt)
    print(
        f"test ({len(xt)} series-windows): model MSE {mse:.4f} MAE {mae:.4f}; "
        f"repeat-last MSE {((naive - yt) ** 2).mean():.4f} MAE {(naive - yt).abs().mean():.4f}"
    )

    path = HERE / "model.onnx"
    torch.onnx.export(
        model,
        (xt[:7],),
        path,
        dynamo=False,
        opset_version=17,
        input_names=["x"],
        output_names=["y"],
        dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
    )
    m = onnx.load(path)
    m.ir_version = min(m.ir_version, 10)
    name_initializers(m, model)
    onnx.checker.check_model(m)
    onnx.save(m, path)
    starts = np.linspace(TEST[0], TEST[1] - L - STEPS * H, N_CTX).astype(int)
    ctx = np.stack([data[s : s + L].T for s in starts])  # (8, 7, 512)
    truth = np.stack([[data[s + L + k * H : s + L + (k + 1) * H].T for k in range(STEPS)] for s in starts])
    np.savez(HERE / "contexts.npz", x=ctx)
    np.savez(HERE / "truth.npz", y=truth.astype(np.float32))  # (8, 8, 7, 96)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    y_ort = sess.run(None, {"x": ctx[0]})[0]
    with torch.no_grad():
        y_pt = model(torch.from_numpy(ctx[0])).numpy()
    print(
        f"context rows {starts.tolist()}; ORT vs torch max abs diff {np.abs(y_ort - y_pt).max():.2e}; "
        f"params {sum(p.numel() for p in model.parameters())}; size {path.stat().st_size} B"
    )


if __name__ == "__main__":
    main()
