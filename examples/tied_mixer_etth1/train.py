"""Train a small weight-tied patch mixer on ETTh1 and export it to ONNX.

The structure of real compact forecasters that reuse one block's weights at
several nodes per forward: a 2048-hour history -> a 48-hour point forecast
(`forecast` [batch, 48]) and its nine deciles (`quantiles` [batch, 48, 9]).
Channel-independent: each ETTh1 column is one batch row. Columns are
standardised with the train split's mean/std (norm.json); inside the model
RevIN removes each window's mean/std and restores it at the outputs.

32 patches of 64 -> Linear(64, 48) + learned positions -> ONE mixer block
applied 6 times (weight-tied; its own LayerNorms per pass): a token-mixing
MLP across the 32 patches (`core.block.tok`, 32 -> 32) and a pointwise one
(`core.block.pw`, 48 -> 48), then a feed-forward (`ffn.up` 48 -> 96,
`ffn.down` 96 -> 48). Every tied weight is one initializer read by 6 MatMul
nodes per forward (x @ W on the parameter itself, so the exporter cannot fold
a transposed copy per use). Head: per-patch Linear(48, 8) -> flatten (256) ->
Linear(256, 48) for the point forecast and Linear(256, 32), SiLU,
Linear(32, 432) for non-crossing deciles around it.

Loss: MSE of the point forecast + pinball loss of the deciles.
Rollout (rollout.toml): 4 steps, each 48-hour forecast appended to the history.

Run from the repo root:  python examples/tied_mixer_etth1/train.py [--data PATH]
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
from torch import nn
from torch.nn import functional as tf

HERE = Path(__file__).resolve().parent
DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "ETTh1.csv"
COLS = ["HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT"]
TRAIN, VAL, TEST = (0, 8640), (8640, 11520), (11520, 14400)
L, H, PATCH, D, FFN, REPEATS, HEAD_D, Q_HID = 2048, 48, 64, 48, 96, 6, 8, 32
STEPS, N_CTX = 4, 8
N_P, N_Q = L // PATCH, 9
QS = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])


class Tied(nn.Module):
    """x @ W + b with W stored [in, out]: every call is a MatMul on the same initializer."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) / d_in**0.5)
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class Block(nn.Module):
    """Token mixing across patches, then pointwise mixing across features."""

    def __init__(self):
        super().__init__()
        self.tok, self.pw = Tied(N_P, N_P), Tied(D, D)

    def forward(self, a):
        a = tf.gelu(self.tok(a.transpose(1, 2))).transpose(1, 2)
        return self.pw(a)


class Core(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = Tied(D, FFN), Tied(FFN, D)

    def forward(self, a):
        return self.down(tf.gelu(self.up(a)))


class TiedMixer(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.embed = Tied(PATCH, D)
        self.pos = nn.Parameter(0.02 * torch.randn(N_P, D))
        self.core, self.ffn = Core(), FeedForward()
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(2 * REPEATS))  # per pass: not shared
        self.ln = nn.LayerNorm(D)
        self.proj = Tied(D, HEAD_D)
        self.head = nn.Linear(N_P * HEAD_D, H)
        self.q_head = nn.Sequential(nn.Linear(N_P * HEAD_D, Q_HID), nn.SiLU(), nn.Linear(Q_HID, H * N_Q))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)  # RevIN
        sd = ((x - mu) ** 2).mean(-1, keepdim=True).sqrt() + 1e-5
        z = ((x - mu) / sd).reshape(-1, N_P, PATCH)
        h = self.drop(self.embed(z) + self.pos)
        for r in range(REPEATS):  # the same weights on every pass
            h = h + self.drop(self.core.block(self.norms[2 * r](h)))
            h = h + self.drop(self.ffn(self.norms[2 * r + 1](h)))
        flat = self.proj(self.ln(h)).reshape(-1, N_P * HEAD_D)
        point = self.head(flat)
        raw = self.q_head(flat).reshape(-1, H, N_Q)  # deciles: median offset +/- cumulative softplus gaps
        gaps = tf.softplus(raw)
        below = gaps[..., :4].sum(-1, keepdim=True) - gaps[..., :4].cumsum(-1) + gaps[..., :4]
        mid = raw[..., 4:5]
        quant = point.unsqueeze(-1) + torch.cat([mid - below, mid, mid + gaps[..., 5:].cumsum(-1)], -1)
        return point * sd + mu, quant * sd.unsqueeze(-1) + mu.unsqueeze(-1)


def losses(model, x, y):
    point, quant = model(x)
    err = y.unsqueeze(-1) - quant
    return ((point - y) ** 2).mean(), torch.maximum(QS * err, (QS - 1) * err).mean()


def windows(series, lo, hi, stride=1):
    """All (history, target) pairs whose targets lie in rows [lo, hi); history may reach back before lo."""
    starts = np.arange(lo - L, hi - L - H + 1, stride)
    w = series[starts[:, None] + np.arange(L + H)].transpose(0, 2, 1).reshape(-1, L + H)
    return torch.from_numpy(w[:, :L].copy()), torch.from_numpy(w[:, L:].copy())


def predict(model, x, bs=2048):
    with torch.no_grad():
        out = [model(x[i : i + bs]) for i in range(0, len(x), bs)]
    return torch.cat([p for p, _ in out]), torch.cat([q for _, q in out])


def rollout(sess, x):
    """The rollout.toml semantics: each forecast appended to the history, the oldest 48 hours dropped."""
    out = []
    for _ in range(STEPS):
        f = sess.run(["forecast"], {"x": x})[0]
        out.append(f)
        x = np.concatenate([x[:, H:], f], -1)
    return np.stack(out)  # (STEPS, 7, 48)


def check_rollout(sess, ctx, truth, label):
    pred = np.stack([rollout(sess, c) for c in ctx])
    last = ctx[:, :, -1][:, None, :, None]
    mae, per = np.abs(pred - truth).mean(axis=(0, 2, 3)), np.abs(last - truth).mean(axis=(0, 2, 3))
    print(
        f"{label}: rollout MAE per step (model / repeat-last): "
        + ", ".join(f"step {k + 1} {a:.3f}/{b:.3f}" for k, (a, b) in enumerate(zip(mae, per)))
        + f"; all {np.abs(pred - truth).mean():.3f}/{np.abs(last - truth).mean():.3f}"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--max-rounds", type=int, default=40, help="rounds of 100 iterations (early stopping ends sooner)")
    ap.add_argument("--minutes", type=float, default=8.0, help="safety wall-time cap")
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
    xv, yv = windows(data, *VAL, stride=8)
    model = TiedMixer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    best, best_state, bad, it, t0 = float("inf"), None, 0, 0, time.time()
    for _ in range(args.max_rounds):
        if bad >= 6:
            break
        if time.time() - t0 > args.minutes * 60:
            print(f"wall-time cap of {args.minutes} min reached: training stopped early, results not reproducible")
            break
        model.train()
        for _ in range(100):  # random windows from the train split
            s, c = rng.integers(0, len(train) - L - H + 1, 64), rng.integers(0, 7, 64)
            w = torch.from_numpy(train[s[:, None] + np.arange(L + H), c[:, None]])
            mse, pin = losses(model, w[:, :L], w[:, L:])
            loss = mse + pin
            opt.zero_grad()
            loss.backward()
            opt.step()
            it += 1
        model.eval()
        with torch.no_grad():
            parts = [losses(model, xv[i : i + 1024], yv[i : i + 1024]) for i in range(0, len(xv), 1024)]
        val = float(np.mean([a.item() + b.item() for a, b in parts]))
        if val < best:
            best, best_state, bad = val, copy.deepcopy(model.state_dict()), 0
        else:
            bad += 1
        print(f"iter {it} train {loss.item():.3f} val MSE+pinball {val:.4f} ({time.time() - t0:.0f}s)", flush=True)
    model.load_state_dict(best_state)
    model.eval()

    xt, yt = windows(data, *TEST, stride=4)
    point, quant = predict(model, xt)
    naive = xt[:, -1:].expand_as(yt)
    print(
        f"test ({len(xt)} series-windows, stride 4, horizon {H}): model MSE {((point - yt) ** 2).mean():.4f} "
        f"MAE {(point - yt).abs().mean():.4f}; repeat-last MSE {((naive - yt) ** 2).mean():.4f} "
        f"MAE {(naive - yt).abs().mean():.4f}"
    )
    cover = (yt.unsqueeze(-1) <= quant).float().mean((0, 1))
    print("test quantile coverage: " + ", ".join(f"q{q:.1f} {c:.3f}" for q, c in zip(QS.tolist(), cover.tolist())))

    path = HERE / "model.onnx"
    torch.onnx.export(
        model,
        (xt[:7],),
        path,
        dynamo=False,
        opset_version=17,
        input_names=["x"],
        output_names=["forecast", "quantiles"],
        dynamic_axes={n: {0: "batch"} for n in ("x", "forecast", "quantiles")},
    )
    m = onnx.load(path)
    m.ir_version = min(m.ir_version, 10)
    onnx.checker.check_model(m)
    onnx.save(m, path)
    readers = {
        t.name: sum(1 for n in m.graph.node if n.op_type == "MatMul" and t.name in n.input) for t in m.graph.initializer
    }
    print("MatMul nodes per tied weight:", {k: v for k, v in readers.items() if v > 1})

    # targets inside the test split; a 2048-hour history reaches back into the validation/train rows
    starts = np.linspace(TEST[0] - L, TEST[1] - L - STEPS * H, N_CTX).astype(int)
    held = (starts[:-1] + np.diff(starts) // 2).tolist() + [int(starts[-1] - np.diff(starts)[-1] // 4)]
    for name, st in (("contexts", starts), ("heldout", held)):
        ctx = np.stack([data[s : s + L].T for s in st])  # (8, 7, 2048)
        truth = np.stack([[data[s + L + k * H : s + L + (k + 1) * H].T for k in range(STEPS)] for s in st])
        np.savez(HERE / f"{name}.npz", x=ctx)
        np.savez(HERE / ("truth.npz" if name == "contexts" else "heldout_truth.npz"), forecast=truth.astype(np.float32))
        print(f"{name} window starts {list(map(int, st))}")

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ctx = np.load(HERE / "contexts.npz")["x"]
    f_ort = sess.run(["forecast"], {"x": ctx[0]})[0]
    with torch.no_grad():
        f_pt = model(torch.from_numpy(ctx[0]))[0].numpy()
    print(
        f"ORT vs torch max abs diff {np.abs(f_ort - f_pt).max():.2e}; "
        f"params {sum(p.numel() for p in model.parameters())}; size {path.stat().st_size} B"
    )
    check_rollout(sess, ctx, np.load(HERE / "truth.npz")["forecast"], "scoring ")
    check_rollout(sess, np.load(HERE / "heldout.npz")["x"], np.load(HERE / "heldout_truth.npz")["forecast"], "held-out")


if __name__ == "__main__":
    main()
