"""Train a small TimesFM-shaped forecaster on ETTh1 and export it to ONNX.

Same graph signature as Google's TimesFM export: `inputs` [batch, 512] and
`masks` [batch, 512] (1.0 = padded/missing, 0.0 = observed) -> `forecast`
[batch, 128] (point forecast) and `quantiles` [batch, 128, 9] (deciles 0.1..0.9).
Channel-independent: each ETTh1 column is one univariate series, i.e. one batch
row, so a window with all 7 columns is a batch of 7. Columns are standardised
with the train split's mean/std (norm.json).

Inside the model: padded positions are zeroed; RevIN statistics (mean, std) are
taken over observed positions only; 16 patches of 32 -> residual MLP embedding of
[patch values, patch mask] (64 -> 128 -> 64, SiLU, linear skip) + learned
positions -> 2 pre-norm transformer layers (d_model 64, 4 heads, FFN 128) whose
attention ignores fully padded patches -> LayerNorm, padded tokens zeroed,
flatten (1024) -> point head Linear(1024, 128) and a separate quantile head
(1024 -> 32 -> 128 x 9: a median offset and softplus gaps, cumulated outwards so
the deciles never cross, added to the point forecast) -> de-normalised.
Loss: MSE of the point forecast + pinball loss of the 9 quantiles. 30 % of the
training windows get a random-length padded prefix (value 0, mask 1).

Run from the repo root:  python examples/timesfm_etth1/train.py [--data PATH]
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
from torch.nn import functional as tf

HERE = Path(__file__).resolve().parent
DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "ETTh1.csv"
COLS = ["HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT"]
TRAIN, VAL, TEST = (0, 8640), (8640, 11520), (11520, 14400)
L, H, PATCH, D, HEADS, FFN, N_LAYERS, Q_HID = 512, 128, 32, 64, 4, 128, 2, 32
STEPS, N_CTX, PAD_CTX, PAD_P, MAX_PAD = 4, 8, 64, 0.3, 448
PADDED_CTX = (2, 5)  # the scoring windows whose first 64 positions are padded
QS = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
N_P, N_Q = L // PATCH, 9


class ResidualBlock(nn.Module):
    """TimesFM's residual MLP: Linear -> SiLU -> Linear, plus a linear skip."""

    def __init__(self, d_in, d_hid, d_out):
        super().__init__()
        self.hidden, self.output, self.residual = (
            nn.Linear(d_in, d_hid),
            nn.Linear(d_hid, d_out),
            nn.Linear(d_in, d_out),
        )
        self.act = nn.SiLU()

    def forward(self, x):
        return self.output(self.act(self.hidden(x))) + self.residual(x)


class EncoderLayer(nn.Module):
    """Pre-norm transformer layer, explicit multi-head attention with an additive key mask."""

    def __init__(self, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.ff = nn.Sequential(nn.Linear(D, FFN), nn.GELU(), nn.Dropout(dropout), nn.Linear(FFN, D))
        self.drop = nn.Dropout(dropout)

    def forward(self, h, bias):
        dh = D // HEADS
        a = self.ln1(h)
        q, k, v = (f(a).reshape(-1, N_P, HEADS, dh).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = torch.softmax(q @ k.transpose(-1, -2) / dh**0.5 + bias, dim=-1)
        h = h + self.drop(self.o((self.drop(att) @ v).transpose(1, 2).reshape(-1, N_P, D)))
        return h + self.drop(self.ff(self.ln2(h)))


class TimesFMLike(nn.Module):
    def __init__(self, dropout=0.2):
        super().__init__()
        self.embed = ResidualBlock(2 * PATCH, 2 * D, D)
        self.pos = nn.Parameter(0.02 * torch.randn(N_P, D))
        self.layers = nn.ModuleList(EncoderLayer(dropout) for _ in range(N_LAYERS))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(N_P * D, H)
        self.q_head = nn.Sequential(nn.Linear(N_P * D, Q_HID), nn.SiLU(), nn.Linear(Q_HID, H * N_Q))
        self.drop = nn.Dropout(dropout)

    def forward(self, inputs, masks):
        obs = 1.0 - masks
        x = inputs * obs  # padded positions -> 0
        n = obs.sum(-1, keepdim=True).clamp(min=1.0)
        mu = x.sum(-1, keepdim=True) / n  # masked RevIN statistics
        sd = ((((x - mu) * obs) ** 2).sum(-1, keepdim=True) / n + 1e-8).sqrt() + 1e-5
        z = ((x - mu) / sd * obs).reshape(-1, N_P, PATCH)
        mp = masks.reshape(-1, N_P, PATCH)
        padded = mp.amin(-1)  # 1 where the whole patch is padded
        h = self.drop(self.embed(torch.cat([z, mp], -1)) + self.pos)
        bias = (padded * -1e4).reshape(-1, 1, 1, N_P)  # attention ignores padded patches
        for layer in self.layers:
            h = layer(h, bias)
        flat = (self.ln(h) * (1.0 - padded).unsqueeze(-1)).reshape(-1, N_P * D)
        point = self.head(flat)
        raw = self.q_head(flat).reshape(-1, H, N_Q)  # non-crossing quantiles around the median:
        gaps = tf.softplus(raw)  # q_i = q_5 -/+ cumulative positive gaps
        below = gaps[..., :4].sum(-1, keepdim=True) - gaps[..., :4].cumsum(-1) + gaps[..., :4]
        mid = raw[..., 4:5]
        quant = point.unsqueeze(-1) + torch.cat([mid - below, mid, mid + gaps[..., 5:].cumsum(-1)], -1)
        return point * sd + mu, quant * sd.unsqueeze(-1) + mu.unsqueeze(-1)


def losses(model, x, m, y):
    point, quant = model(x, m)
    err = y.unsqueeze(-1) - quant
    pinball = torch.maximum(QS * err, (QS - 1) * err).mean()
    return ((point - y) ** 2).mean(), pinball


def windows(series, lo, hi, stride=1):
    """All (history, target) pairs whose targets lie in rows [lo, hi); history may reach back before lo."""
    starts = np.arange(lo - L, hi - L - H + 1, stride)
    w = series[starts[:, None] + np.arange(L + H)].transpose(0, 2, 1).reshape(-1, L + H)  # (n_starts * 7, L + H)
    return torch.from_numpy(w[:, :L].copy()), torch.from_numpy(w[:, L:].copy())


def predict(model, x, m, bs=2048):
    with torch.no_grad():
        out = [model(x[i : i + bs], m[i : i + bs]) for i in range(0, len(x), bs)]
    return torch.cat([p for p, _ in out]), torch.cat([q for _, q in out])


def name_initializers(m, model):
    """Linear weights applied to 3-D tensors are exported as pre-transposed MatMul
    constants named onnx::MatMul_N; give them back their parameter names."""
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


def rollout(sess, inputs, masks):
    """The rollout.toml semantics: forecast shifted into inputs, masks shifted with 128 zeros appended."""
    out = []
    for _ in range(STEPS):
        f = sess.run(["forecast"], {"inputs": inputs, "masks": masks})[0]
        out.append(f)
        inputs = np.concatenate([inputs[:, H:], f], -1)
        masks = np.concatenate([masks[:, H:], np.zeros_like(masks[:, :H])], -1)
    return np.stack(out)  # (STEPS, 7, 128)


def check_rollout(sess, ctx, truth, label):
    pred = np.stack([rollout(sess, ctx["inputs"][w], ctx["masks"][w]) for w in range(len(truth))])
    # persistence: the last observed value of each series, held for the whole 512 h
    last = ctx["inputs"][:, :, -1][:, None, :, None]
    mae = np.abs(pred - truth).mean(axis=(0, 2, 3))
    per = np.abs(last - truth).mean(axis=(0, 2, 3))
    print(
        f"{label}: rollout MAE per step (model / repeat-last): "
        + ", ".join(f"step {k + 1} {a:.3f}/{b:.3f}" for k, (a, b) in enumerate(zip(mae, per)))
        + f"; all {np.abs(pred - truth).mean():.3f}/{np.abs(last - truth).mean():.3f}"
    )
    return mae, per


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--max-rounds", type=int, default=30, help="rounds of 100 iterations (early stopping ends sooner)")
    ap.add_argument("--minutes", type=float, default=9.0, help="safety wall-time cap")
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
    mv = torch.zeros_like(xv)
    model = TimesFMLike()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=1e-4)
    best, best_state, bad, it, t0 = float("inf"), None, 0, 0, time.time()
    for _ in range(args.max_rounds):
        if bad >= 6:
            break
        if time.time() - t0 > args.minutes * 60:
            print(f"wall-time cap of {args.minutes} min reached: training stopped early, results not reproducible")
            break
        model.train()
        for _ in range(100):  # random windows from the train split
            s, c = rng.integers(0, len(train) - L - H + 1, 128), rng.integers(0, 7, 128)
            w = torch.from_numpy(train[s[:, None] + np.arange(L + H), c[:, None]])
            x, y = w[:, :L].clone(), w[:, L:]
            pad = np.where(rng.random(128) < PAD_P, rng.integers(1, MAX_PAD + 1, 128), 0)
            m = torch.from_numpy((np.arange(L) < pad[:, None]).astype(np.float32))
            x = x * (1 - m)
            mse, pin = losses(model, x, m, y)
            loss = mse + pin
            opt.zero_grad()
            loss.backward()
            opt.step()
            it += 1
        model.eval()
        with torch.no_grad():
            parts = [
                losses(model, xv[i : i + 2048], mv[i : i + 2048], yv[i : i + 2048]) for i in range(0, len(xv), 2048)
            ]
        val_mse = float(np.mean([a.item() for a, _ in parts]))
        val_pin = float(np.mean([b.item() for _, b in parts]))
        val = val_mse + val_pin
        if val < best:
            best, best_state, bad = val, copy.deepcopy(model.state_dict()), 0
        else:
            bad += 1
        print(
            f"iter {it} train {loss.item():.3f} val MSE {val_mse:.4f} pinball {val_pin:.4f} ({time.time() - t0:.0f}s)",
            flush=True,
        )
    model.load_state_dict(best_state)
    model.eval()

    xt, yt = windows(data, *TEST)
    point, quant = predict(model, xt, torch.zeros_like(xt))
    naive = xt[:, -1:].expand_as(yt)
    print(
        f"test ({len(xt)} series-windows, horizon {H}): model MSE {((point - yt) ** 2).mean():.4f} "
        f"MAE {(point - yt).abs().mean():.4f}; repeat-last MSE {((naive - yt) ** 2).mean():.4f} "
        f"MAE {(naive - yt).abs().mean():.4f}"
    )
    cover = (yt.unsqueeze(-1) <= quant).float().mean((0, 1))
    print(
        "test quantile coverage (fraction of truth <= quantile): "
        + ", ".join(f"q{q:.1f} {c:.3f}" for q, c in zip(QS.tolist(), cover.tolist()))
    )
    mp = torch.zeros_like(xt)
    mp[:, :PAD_CTX] = 1.0
    point_p, _ = predict(model, xt * (1 - mp), mp)
    print(
        f"test with the first {PAD_CTX} positions padded: MSE {((point_p - yt) ** 2).mean():.4f} "
        f"MAE {(point_p - yt).abs().mean():.4f}"
    )

    path = HERE / "model.onnx"
    torch.onnx.export(
        model,
        (xt[:7], torch.zeros_like(xt[:7])),
        path,
        dynamo=False,
        opset_version=17,
        input_names=["inputs", "masks"],
        output_names=["forecast", "quantiles"],
        dynamic_axes={n: {0: "batch"} for n in ("inputs", "masks", "forecast", "quantiles")},
    )
    m = onnx.load(path)
    m.ir_version = min(m.ir_version, 10)
    name_initializers(m, model)
    onnx.checker.check_model(m)
    onnx.save(m, path)

    # scoring windows: evenly spaced so 512 history + 4 x 128 = 512 future rows stay inside the test split
    starts = np.linspace(TEST[0], TEST[1] - L - STEPS * H, N_CTX).astype(int)
    held = (starts[:-1] + np.diff(starts) // 2).tolist() + [int(starts[-1] - np.diff(starts)[-1] // 4)]
    for name, st, padded in (("contexts", starts, PADDED_CTX), ("heldout", held, ())):
        inputs = np.stack([data[s : s + L].T for s in st])  # (8, 7, 512)
        masks = np.zeros_like(inputs)
        for w in padded:
            masks[w, :, :PAD_CTX] = 1.0
        inputs = inputs * (1 - masks)
        truth = np.stack([[data[s + L + k * H : s + L + (k + 1) * H].T for k in range(STEPS)] for s in st])
        np.savez(HERE / f"{name}.npz", inputs=inputs, masks=masks)
        np.savez(
            HERE / ("truth.npz" if name == "contexts" else "heldout_truth.npz"), forecast=truth.astype(np.float32)
        )  # (8, 4, 7, 128)
        print(f"{name} window starts {list(map(int, st))}, padded windows {list(padded)}")

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ctx = dict(np.load(HERE / "contexts.npz"))
    f_ort, q_ort = sess.run(None, {"inputs": ctx["inputs"][2], "masks": ctx["masks"][2]})
    with torch.no_grad():
        f_pt, q_pt = model(torch.from_numpy(ctx["inputs"][2]), torch.from_numpy(ctx["masks"][2]))
    print(
        f"ORT vs torch max abs diff {max(np.abs(f_ort - f_pt.numpy()).max(), np.abs(q_ort - q_pt.numpy()).max()):.2e}; "
        f"params {sum(p.numel() for p in model.parameters())}; size {path.stat().st_size} B"
    )
    check_rollout(sess, ctx, np.load(HERE / "truth.npz")["forecast"], "scoring ")
    check_rollout(
        sess, dict(np.load(HERE / "heldout.npz")), np.load(HERE / "heldout_truth.npz")["forecast"], "held-out"
    )


if __name__ == "__main__":
    main()
