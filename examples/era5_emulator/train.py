"""Train a tiny 6-hour ERA5 2 m temperature emulator over the UK and export it to ONNX.

Data: ERA5 t2m, hourly, March 2019, 33x49 grid at 0.25 deg. Weeks 1-3 (hours
0..503) train, week 4 (hours 504..743) test. The model steps the field 6 h:
next_state = state + inc_std * CNN((state - mean) / std), with the train
mean/std and increment std baked into the graph, so the ONNX model reads and
writes Kelvin. Dilated 3x3 convs widen the receptive field (~10 cells, about
the 6 h advection distance) while staying small.

Run from the repo root:  python examples/era5_emulator/train.py [--data PATH]
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
DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "era5_t2m_uk_2019_03.npz"
LEAD, N_TRAIN_H, STEPS, N_CTX = 6, 504, 8, 6


class Emulator(nn.Module):
    """Residual CNN: 5 zero-padded 3x3 convs, 32 channels, GELU, dilations 1-2-4-2-1."""

    def __init__(self, mean, std, inc_std, width=32, dilations=(1, 2, 4, 2, 1)):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))
        self.register_buffer("inc_std", torch.tensor(inc_std, dtype=torch.float32))
        chans = [1] + [width] * (len(dilations) - 1) + [1]
        self.convs = nn.ModuleList(
            nn.Conv2d(a, b, 3, padding=d, dilation=d) for a, b, d in zip(chans, chans[1:], dilations)
        )
        self.act = nn.GELU()

    def forward(self, state):
        h = (state - self.mean) / self.std
        for i, conv in enumerate(self.convs):
            h = conv(h)
            if i < len(self.convs) - 1:
                h = self.act(h)
        return state + self.inc_std * h


def rmse(a, b):
    return float(np.sqrt(((a - b) ** 2).mean()))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--epochs", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    t2m = np.load(args.data)["t2m"].astype(np.float32)[:, None]  # (744, 1, 33, 49)
    train = t2m[:N_TRAIN_H]
    x, y = torch.from_numpy(train[:-LEAD]), torch.from_numpy(train[LEAD:])
    mean, std = float(train.mean()), float(train.std())
    inc_std = float((y - x).std())
    model = Emulator(mean, std, inc_std)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    bs = 16
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 2e-3, total_steps=args.epochs * ((len(x) + bs - 1) // bs))
    t0 = time.time()
    for ep in range(args.epochs):
        perm, tot = torch.randperm(len(x)), 0.0
        for i in range(0, len(x), bs):
            idx = perm[i : i + bs]
            loss = ((model(x[idx]) - y[idx]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            tot += loss.item() * len(idx)
        if ep % 5 == 4 or ep == args.epochs - 1:
            print(f"epoch {ep + 1} train RMSE {np.sqrt(tot / len(x)):.3f} K ({time.time() - t0:.0f}s)", flush=True)
    model.eval()

    # test: 6 h RMSE over all test pairs; 8-step (48 h) rollout from every valid start
    test = t2m[N_TRAIN_H:]
    with torch.no_grad():
        pred = model(torch.from_numpy(test[:-LEAD])).numpy()
        starts = np.arange(len(test) - STEPS * LEAD)
        s, per_lead = torch.from_numpy(test[starts]), []
        for k in range(1, STEPS + 1):
            s = model(s)
            per_lead.append((rmse(s.numpy(), test[starts + k * LEAD]), rmse(test[starts], test[starts + k * LEAD])))
    print(f"test 6 h RMSE: model {rmse(pred, test[LEAD:]):.3f} K, persistence {rmse(test[:-LEAD], test[LEAD:]):.3f} K")
    print(
        "rollout RMSE per lead (model / persistence, K): "
        + ", ".join(f"{6 * (k + 1)}h {m:.2f}/{p:.2f}" for k, (m, p) in enumerate(per_lead))
    )
    print(
        f"8-step mean: model {np.sqrt(np.mean([m**2 for m, _ in per_lead])):.3f} K, "
        f"persistence {np.sqrt(np.mean([p**2 for _, p in per_lead])):.3f} K"
    )

    path = HERE / "model.onnx"
    torch.onnx.export(
        model,
        (x[:2],),
        path,
        dynamo=False,
        opset_version=17,
        input_names=["state"],
        output_names=["next_state"],
        dynamic_axes={"state": {0: "batch"}, "next_state": {0: "batch"}},
    )
    m = onnx.load(path)
    m.ir_version = min(m.ir_version, 10)
    onnx.checker.check_model(m)
    onnx.save(m, path)
    t_ctx = np.linspace(N_TRAIN_H, len(t2m) - 1 - STEPS * LEAD, N_CTX).astype(int)  # absolute hours
    ctx = t2m[t_ctx][:, None]  # (6, 1, 1, 33, 49)
    truth = np.stack([t2m[t_ctx + k * LEAD] for k in range(1, STEPS + 1)], 1)[:, :, None]  # (6, 8, 1, 1, 33, 49)
    np.savez(HERE / "contexts.npz", state=ctx)
    np.savez(HERE / "truth.npz", next_state=truth)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    y_ort = sess.run(None, {"state": ctx[:, 0]})[0]
    with torch.no_grad():
        y_pt = model(torch.from_numpy(ctx[:, 0])).numpy()
    print(
        f"context hours {t_ctx.tolist()}; ORT vs torch max abs diff {np.abs(y_ort - y_pt).max():.2e} K; "
        f"params {sum(p.numel() for p in model.parameters())}; size {path.stat().st_size} B"
    )


if __name__ == "__main__":
    main()
