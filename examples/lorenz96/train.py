"""Train a Lorenz-96 emulator (N=40, F=8) and export it to ONNX.

The true system is integrated with RK4 (dt=0.01) in numpy and sampled every
DT=0.05. The emulator maps x(t) -> x(t+DT). It is a periodic 1-D conv net:
L96 is translation-invariant around the ring, so weight sharing along the ring
learns the local stencil far more accurately than a dense MLP for the same
budget. Normalisation (climatological mean/std) lives inside the graph so the
ONNX model takes and returns raw states.

Run from the repo root:  python examples/lorenz96/train.py
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
N, F, DT_INT, SUB = 40, 8.0, 0.01, 5  # DT = SUB * DT_INT = 0.05
DT = DT_INT * SUB
N_TRAIN, N_TEST, N_REC, SPINUP = 48, 16, 2000, 1000
STEPS = 40


def l96_tendency(x):
    """dx_i/dt = (x_{i+1} - x_{i-2}) x_{i-1} - x_i + F, periodic in i."""
    return (np.roll(x, -1, -1) - np.roll(x, 2, -1)) * np.roll(x, 1, -1) - x + F


def simulate(n_traj, n_rec, seed):
    """RK4 trajectories from random ICs, spun up onto the attractor; returns (n_traj, n_rec, N)."""
    rng = np.random.default_rng(seed)
    x = F + rng.standard_normal((n_traj, N))
    out = np.empty((n_traj, n_rec, N))
    for k in range(SPINUP + n_rec * SUB):
        k1 = l96_tendency(x)
        k2 = l96_tendency(x + 0.5 * DT_INT * k1)
        k3 = l96_tendency(x + 0.5 * DT_INT * k2)
        k4 = l96_tendency(x + DT_INT * k3)
        x = x + DT_INT / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        j = k - SPINUP + 1
        if j > 0 and j % SUB == 0:
            out[:, j // SUB - 1] = x
    return out


class Emulator(nn.Module):
    """x_next = x + inc_std * net((x - mean) / std), net = periodic conv stack."""

    def __init__(self, mean, std, inc_std, width=64, depth=4, k=5):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))
        self.register_buffer("inc_std", torch.tensor(inc_std, dtype=torch.float32))
        chans = [1] + [width] * depth
        self.convs = nn.ModuleList(
            nn.Conv1d(a, b, k, padding=k // 2, padding_mode="circular") for a, b in zip(chans, chans[1:])
        )
        self.out = nn.Conv1d(width, 1, 1)
        self.act = nn.GELU()

    def forward(self, x):
        h = ((x - self.mean) / self.std).unsqueeze(1)
        for conv in self.convs:
            h = self.act(conv(h))
        return x + self.inc_std * self.out(h).squeeze(1)


def rollout(model, x0, steps):
    xs, x = [], x0
    with torch.no_grad():
        for _ in range(steps):
            x = model(x)
            xs.append(x)
    return torch.stack(xs, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--minutes", type=float, default=4.0, help="training wall-time cap (normally finishes first)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    train = simulate(N_TRAIN, N_REC, seed=1)
    test = simulate(N_TEST, N_REC, seed=2)
    mean, std = float(train.mean()), float(train.std())
    inc_std = float((train[:, 1:] - train[:, :-1]).std())
    x_in = torch.tensor(train[:, :-1].reshape(-1, N), dtype=torch.float32)
    x_out = torch.tensor(train[:, 1:].reshape(-1, N), dtype=torch.float32)
    t_in = torch.tensor(test[:, :-1].reshape(-1, N), dtype=torch.float32)
    t_out = torch.tensor(test[:, 1:].reshape(-1, N), dtype=torch.float32)

    model = Emulator(mean, std, inc_std)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    budget, t0, it, bs = args.minutes * 60, time.time(), 0, 256
    total_iters = 3000  # cosine schedule length (~2.5 min on one CPU thread)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total_iters, eta_min=1e-5)
    while it < total_iters and time.time() - t0 < budget:
        idx = torch.randint(0, len(x_in), (bs,))
        loss = ((model(x_in[idx]) - x_out[idx]) ** 2).mean() / inc_std**2
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        it += 1
        if it % 500 == 0:
            print(f"iter {it} loss {loss.item():.2e} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()

    with torch.no_grad():
        one_rmse = ((model(t_in[:20000]) - t_out[:20000]) ** 2).mean().sqrt().item()
    persist = ((t_in - t_out) ** 2).mean().sqrt().item()
    # valid prediction time: first lead where RMSE / climate std exceeds 0.5, 64 ICs
    starts = np.arange(0, N_REC - 201, 150)[:4]
    x0 = torch.tensor(test[:, starts].reshape(-1, N), dtype=torch.float32)
    true = np.stack([test[:, s + 1 : s + 201] for s in starts], 1).reshape(-1, 200, N)
    err = np.sqrt(((rollout(model, x0, 200).numpy() - true) ** 2).mean(-1)) / std
    vpt = float(np.median(np.argmax(np.concatenate([err, np.full((len(err), 1), 9)], 1) > 0.5, 1) + 1) * DT)
    print(
        f"one-step RMSE {one_rmse:.4e} ({one_rmse / std:.2e} of clim std {std:.3f}); "
        f"persistence {persist:.4e}; median VPT {vpt:.2f} time units ({vpt * 1.7:.2f} Lyapunov times)"
    )

    # export: batch axis dynamic; contexts = one start per held-out trajectory
    path = HERE / "model.onnx"
    torch.onnx.export(
        model,
        (t_in[:2],),
        path,
        dynamo=False,
        opset_version=17,
        input_names=["x"],
        output_names=["x_next"],
        dynamic_axes={"x": {0: "batch"}, "x_next": {0: "batch"}},
    )
    m = onnx.load(path)
    m.ir_version = min(m.ir_version, 10)
    onnx.checker.check_model(m)
    onnx.save(m, path)
    s0 = 100
    ctx = test[:, s0].astype(np.float32)[:, None, :]  # (16, 1, 40)
    truth = test[:, s0 + 1 : s0 + 1 + STEPS].astype(np.float32)[:, :, None]  # (16, 40, 1, 40)
    np.savez(HERE / "contexts.npz", x=ctx)
    np.savez(HERE / "truth.npz", x_next=truth)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    y_ort = sess.run(None, {"x": ctx[:, 0]})[0]
    with torch.no_grad():
        y_pt = model(torch.from_numpy(ctx[:, 0])).numpy()
    print(
        f"ORT vs torch max abs diff {np.abs(y_ort - y_pt).max():.2e}; "
        f"params {sum(p.numel() for p in model.parameters())}; size {path.stat().st_size} B"
    )


if __name__ == "__main__":
    main()
