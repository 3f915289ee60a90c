"""Train a small depthwise-conv mixer with a weight-tied core on ETTh1 and export it to ONNX.

The shape of compact pretrained forecasters that are slow to export (issue 57): a 2048-hour history -> a
48-hour point forecast (`forecast` [batch, 48]), 18 weight tensors, depthwise convolutions, and a core block
applied 10 times with the same weights (5 tensors each read by 10 nodes per forward). Channel-independent:
each ETTh1 column is one batch row. Columns are standardised with the train split's mean/std (norm.json);
inside the model RevIN removes each window's mean/std and restores it at the output.

64 patches of 32 -> `embed` (32 -> 64) + learned positions -> 2 blocks with their own weights, then ONE core
block applied 10 times (its own LayerNorms and layer scales per pass). A block mixes tokens with two depthwise
Conv1d over the 64 patches (`dw1` kernel 17, `dw2` kernel 17 dilated 3, groups = 64) and a pointwise
`pw` (64 -> 64), then a feed-forward (`up` 64 -> 96, GELU, `down` 96 -> 64), each a residual. Every tied
weight is one initializer read by 10 nodes per forward (x @ W on the parameter itself, F.conv1d on the
same kernel). Head: LayerNorm -> `proj` (64 -> 16 per patch) -> `tokens` (64 patches -> 24) -> flatten
(384) -> `head` (384 -> 48), plus `level` (the last patch's 32 values -> 48).

Loss: MSE of the point forecast. Rollout (rollout.toml): 4 steps, each 48-hour forecast appended to the history.

Run from the repo root:  python examples/dwconv_mixer_etth1/train.py [--data PATH]
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
L, H, PATCH, D, FFN, KERNEL, DILATION = 2048, 48, 32, 64, 96, 17, 3
OWN_BLOCKS, REPEATS, HEAD_D, HEAD_T = 2, 10, 16, 24
STEPS, N_CTX = 4, 8
N_P = L // PATCH


class Tied(nn.Module):
    """x @ W + b with W stored [in, out]: every call is a MatMul on the same initializer."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) / d_in**0.5)
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class Depthwise(nn.Module):
    """A depthwise Conv1d over the patch axis (one kernel per feature): every call is a Conv on the same kernel."""

    def __init__(self, dilation=1):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, 1, KERNEL) / KERNEL**0.5)
        self.bias = nn.Parameter(torch.zeros(D))
        self.dilation = dilation

    def forward(self, x):  # [batch, D, patches]
        pad = self.dilation * (KERNEL // 2)
        return tf.conv1d(x, self.weight, self.bias, padding=pad, dilation=self.dilation, groups=D)


class Block(nn.Module):
    """Token mixing by two depthwise convs and a pointwise MatMul, then a feed-forward; the caller adds residuals."""

    def __init__(self):
        super().__init__()
        self.dw1, self.dw2, self.pw = Depthwise(), Depthwise(DILATION), Tied(D, D)
        self.up, self.down = Tied(D, FFN), Tied(FFN, D)

    def mix(self, a):
        a = self.dw2(tf.gelu(self.dw1(a.transpose(1, 2))))
        return self.pw(a.transpose(1, 2))

    def ffn(self, a):
        return self.down(tf.gelu(self.up(a)))


class Pass(nn.Module):
    """What one application of a block owns: its two LayerNorms and layer scales (never tied)."""

    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.s1, self.s2 = nn.Parameter(0.1 * torch.ones(D)), nn.Parameter(0.1 * torch.ones(D))

    def forward(self, h, block, drop):
        h = h + drop(self.s1 * block.mix(self.n1(h)))
        return h + drop(self.s2 * block.ffn(self.n2(h)))


class DwConvMixer(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.embed = Tied(PATCH, D)
        self.pos = nn.Parameter(0.02 * torch.randn(N_P, D))
        self.blocks = nn.ModuleList(Block() for _ in range(OWN_BLOCKS))
        self.core = Block()
        self.passes = nn.ModuleList(Pass() for _ in range(OWN_BLOCKS + REPEATS))
        self.ln = nn.LayerNorm(D)
        self.proj, self.tokens = Tied(D, HEAD_D), Tied(N_P, HEAD_T)
        self.head, self.level = nn.Linear(HEAD_D * HEAD_T, H), nn.Linear(PATCH, H)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)  # RevIN
        sd = ((x - mu) ** 2).mean(-1, keepdim=True).sqrt() + 1e-5
        z = ((x - mu) / sd).reshape(-1, N_P, PATCH)
        h = self.drop(self.embed(z) + self.pos)
        blocks = [*self.blocks, *[self.core] * REPEATS]  # the core's weights on every one of its passes
        for step, block in zip(self.passes, blocks):
            h = step(h, block, self.drop)
        t = self.tokens(self.proj(self.ln(h)).transpose(1, 2))  # [batch, HEAD_D, HEAD_T]
        point = self.head(t.reshape(-1, HEAD_D * HEAD_T)) + self.level(z[:, -1])
        return point * sd + mu


def windows(series, lo, hi, stride=1):
    """All (history, target) pairs whose targets lie in rows [lo, hi); history may reach back before lo."""
    starts = np.arange(lo - L, hi - L - H + 1, stride)
    w = series[starts[:, None] + np.arange(L + H)].transpose(0, 2, 1).reshape(-1, L + H)
    return torch.from_numpy(w[:, :L].copy()), torch.from_numpy(w[:, L:].copy())


def predict(model, x, bs=1024):
    with torch.no_grad():
        return torch.cat([model(x[i : i + bs]) for i in range(0, len(x), bs)])


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


def train(model, data, args, rng):
    train_rows = data[slice(*TRAIN)]
    xv, yv = windows(data, *VAL, stride=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    best, best_state, bad, it, t0 = float("inf"), None, 0, 0, time.time()
    for _ in range(args.max_rounds):
        if bad >= 5:
            break
        if time.time() - t0 > args.minutes * 60:
            print(f"wall-time cap of {args.minutes} min reached: training stopped early, results not reproducible")
            break
        model.train()
        for _ in range(100):  # random windows from the train split
            s, c = rng.integers(0, len(train_rows) - L - H + 1, 64), rng.integers(0, 7, 64)
            w = torch.from_numpy(train_rows[s[:, None] + np.arange(L + H), c[:, None]])
            loss = ((model(w[:, :L]) - w[:, L:]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            it += 1
        model.eval()
        val = float(((predict(model, xv) - yv) ** 2).mean())
        if val < best:
            best, best_state, bad = val, copy.deepcopy(model.state_dict()), 0
        else:
            bad += 1
        print(f"iter {it} train {loss.item():.3f} val MSE {val:.4f} ({time.time() - t0:.0f}s)", flush=True)
    model.load_state_dict(best_state)
    model.eval()


def export(model, example, path):
    torch.onnx.export(
        model,
        (example,),
        path,
        dynamo=False,
        opset_version=17,
        input_names=["x"],
        output_names=["forecast"],
        dynamic_axes={n: {0: "batch"} for n in ("x", "forecast")},
    )
    m = onnx.load(path)
    m.ir_version = min(m.ir_version, 10)
    onnx.checker.check_model(m)
    onnx.save(m, path)
    readers = {t.name: sum(1 for n in m.graph.node if t.name in n.input) for t in m.graph.initializer}
    big = {t.name: int(np.prod(t.dims)) for t in m.graph.initializer if np.prod(t.dims) >= 1024}
    print(f"{len(big)} initializers of >= 1024 weights; readers of the tied ones:")
    print({k: v for k, v in readers.items() if v > 1 and k in big})


def write_windows(data):
    """Scoring and held-out windows whose 4 x 48 forecast hours lie in the test split (histories reach back)."""
    starts = np.linspace(TEST[0] - L, TEST[1] - L - STEPS * H, N_CTX).astype(int)
    held = (starts[:-1] + np.diff(starts) // 2).tolist() + [int(starts[-1] - np.diff(starts)[-1] // 4)]
    for name, st in (("contexts", starts), ("heldout", held)):
        ctx = np.stack([data[s : s + L].T for s in st])  # (8, 7, 2048)
        truth = np.stack([[data[s + L + k * H : s + L + (k + 1) * H].T for k in range(STEPS)] for s in st])
        np.savez_compressed(HERE / f"{name}.npz", x=ctx)
        np.savez_compressed(
            HERE / ("truth.npz" if name == "contexts" else "heldout_truth.npz"), forecast=truth.astype(np.float32)
        )
        print(f"{name} window starts {list(map(int, st))}")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--max-rounds", type=int, default=12, help="rounds of 100 iterations (early stopping ends sooner)")
    ap.add_argument("--minutes", type=float, default=60.0, help="safety wall-time cap")
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
    model = DwConvMixer()
    train(model, data, args, rng)

    xt, yt = windows(data, *TEST, stride=4)
    point = predict(model, xt)
    naive = xt[:, -1:].expand_as(yt)
    print(
        f"test ({len(xt)} series-windows, stride 4, horizon {H}): model MSE {((point - yt) ** 2).mean():.4f} "
        f"MAE {(point - yt).abs().mean():.4f}; repeat-last MSE {((naive - yt) ** 2).mean():.4f} "
        f"MAE {(naive - yt).abs().mean():.4f}"
    )
    path = HERE / "model.onnx"
    export(model, xt[:7], path)
    write_windows(data)

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ctx = np.load(HERE / "contexts.npz")["x"]
    f_ort = sess.run(["forecast"], {"x": ctx[0]})[0]
    with torch.no_grad():
        f_pt = model(torch.from_numpy(ctx[0])).numpy()
    print(
        f"ORT vs torch max abs diff {np.abs(f_ort - f_pt).max():.2e}; "
        f"params {sum(p.numel() for p in model.parameters())}; size {path.stat().st_size} B"
    )
    check_rollout(sess, ctx, np.load(HERE / "truth.npz")["forecast"], "scoring ")
    check_rollout(sess, np.load(HERE / "heldout.npz")["x"], np.load(HERE / "heldout_truth.npz")["forecast"], "held-out")


if __name__ == "__main__":
    main()
