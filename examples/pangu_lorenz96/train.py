"""Train a Pangu-shaped emulator of the two-scale Lorenz-96 system and export it to ONNX.

Two-scale Lorenz-96 (Lorenz 1996), K = 8 slow X_k, J = 16 fast Y_{j,k} per X_k:
    dX_k/dt     = X_{k-1} (X_{k+1} - X_{k-2}) - X_k + F - (h c / b) sum_j Y_{j,k}
    dY_{j,k}/dt = -c b Y_{j+1,k} (Y_{j+2,k} - Y_{j-1,k}) - c Y_{j,k} + (h c / b) X_k
with Y periodic over the flattened index j + J k, and F = 10, h = 1, b = 10, c = 10
(Wilks 2005). Integrated with RK4 (dt = 0.001) in numpy, sampled every DT = 0.01.

The ONNX graph mimics Pangu-Weather's export: two inputs with STATIC shapes and
no batch axis, `input` [8, 16] (Y as [K, J]) and `input_surface` [8] (X), and
two outputs `output` [8, 16] and `output_surface` [8], the states DT later.
Residual form: next = current + inc_std * net(normalised state), normalisation
constants in the graph. net: the 8 sectors are a periodic ring, so each sector's
16 Y values + its X are 17 channels of a circular Conv1d stack over k
(17 -> 128 -> 128 -> 128 -> 128 -> 17, kernel 3, GELU).

Run from the repo root:  python examples/pangu_lorenz96/train.py
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
K, J, F, HC, B, C = 8, 16, 10.0, 1.0, 10.0, 10.0  # HC is the coupling h
DT_INT, SUB = 0.001, 10  # emulator step DT = SUB * DT_INT = 0.01
DT = DT_INT * SUB
SPINUP, STEPS = 3000, 8  # spin-up 3 time units
N_TRAIN, N_TEST, N_HELD, N_REC = 64, 16, 8, 600
SEEDS = {"train": 1, "test": 2, "heldout": 3}
S0 = 100  # context index inside a test/held-out trajectory


def tendency(x, y):
    """x (..., K), y (..., K * J) flattened with j fastest."""
    dx = (
        np.roll(x, 1, -1) * (np.roll(x, -1, -1) - np.roll(x, 2, -1))
        - x
        + F
        - HC * C / B * y.reshape(*y.shape[:-1], K, J).sum(-1)
    )
    dy = (
        -C * B * np.roll(y, -1, -1) * (np.roll(y, -2, -1) - np.roll(y, 1, -1))
        - C * y
        + HC * C / B * np.repeat(x, J, -1)
    )
    return dx, dy


def simulate(n_traj, n_rec, seed):
    """RK4 from random ICs, spun up onto the attractor; returns X (n, n_rec, K) and Y (n, n_rec, K, J)."""
    rng = np.random.default_rng(seed)
    x = F * rng.random((n_traj, K))
    y = 0.1 * rng.standard_normal((n_traj, K * J))
    xs, ys = np.empty((n_traj, n_rec, K)), np.empty((n_traj, n_rec, K * J))
    for i in range(SPINUP + n_rec * SUB):
        a1, b1 = tendency(x, y)
        a2, b2 = tendency(x + 0.5 * DT_INT * a1, y + 0.5 * DT_INT * b1)
        a3, b3 = tendency(x + 0.5 * DT_INT * a2, y + 0.5 * DT_INT * b2)
        a4, b4 = tendency(x + DT_INT * a3, y + DT_INT * b3)
        x = x + DT_INT / 6 * (a1 + 2 * a2 + 2 * a3 + a4)
        y = y + DT_INT / 6 * (b1 + 2 * b2 + 2 * b3 + b4)
        j = i - SPINUP + 1
        if j > 0 and j % SUB == 0:
            xs[:, j // SUB - 1], ys[:, j // SUB - 1] = x, y
    return xs, ys.reshape(n_traj, n_rec, K, J)


class Emulator(nn.Module):
    """Residual circular-conv emulator; `step` works on batches, `forward` on one unbatched state (the export)."""

    def __init__(self, stats, width=128, depth=4, k=3):
        super().__init__()
        for name, value in stats.items():
            self.register_buffer(name, torch.tensor(value, dtype=torch.float32))
        chans = [J + 1] + [width] * depth
        self.convs = nn.ModuleList(
            nn.Conv1d(a, b, k, padding=k // 2, padding_mode="circular") for a, b in zip(chans, chans[1:])
        )
        self.out = nn.Conv1d(width, J + 1, 1)
        self.act = nn.GELU()

    def step(self, y, x):
        """y (batch, K, J), x (batch, K) -> the same, DT later."""
        h = torch.cat([(y - self.y_mean) / self.y_std, ((x - self.x_mean) / self.x_std).unsqueeze(-1)], -1)
        h = h.transpose(1, 2)  # (batch, J + 1 channels, K sectors)
        for conv in self.convs:
            h = self.act(conv(h))
        inc = self.out(h).transpose(1, 2)  # (batch, K, J + 1)
        return y + self.y_inc * inc[..., :J], x + self.x_inc * inc[..., J]

    def forward(self, input, input_surface):
        y, x = self.step(input.unsqueeze(0), input_surface.unsqueeze(0))
        return y.squeeze(0), x.squeeze(0)


def rmse(a, b, axis=None):
    return np.sqrt(((a - b) ** 2).mean(axis=axis))


def windows(xs, ys, s0):
    """Context at index s0 of each trajectory, truth at s0 + 1 .. s0 + STEPS (float32)."""
    ctx = {"input": ys[:, s0].astype(np.float32), "input_surface": xs[:, s0].astype(np.float32)}
    truth = {
        "output": ys[:, s0 + 1 : s0 + 1 + STEPS].astype(np.float32),
        "output_surface": xs[:, s0 + 1 : s0 + 1 + STEPS].astype(np.float32),
    }
    return ctx, truth


def check_rollout(sess, ctx, truth, label):
    """Window by window, no batch axis: output -> input, output_surface -> input_surface."""
    n = len(ctx["input"])
    py, px = np.empty_like(truth["output"]), np.empty_like(truth["output_surface"])
    for w in range(n):
        feed = {"input": ctx["input"][w], "input_surface": ctx["input_surface"][w]}
        for k in range(STEPS):
            y, x = sess.run(["output", "output_surface"], feed)
            py[w, k], px[w, k] = y, x
            feed = {"input": y, "input_surface": x}
    ex, ey = rmse(px, truth["output_surface"], (0, 2)), rmse(py, truth["output"], (0, 2, 3))
    px0 = rmse(ctx["input_surface"][:, None], truth["output_surface"], (0, 2))
    py0 = rmse(ctx["input"][:, None], truth["output"], (0, 2, 3))
    print(f"{label}: rollout RMSE per step, model / persistence")
    print("  X: " + ", ".join(f"{a:.4f}/{b:.3f}" for a, b in zip(ex, px0)))
    print("  Y: " + ", ".join(f"{a:.4f}/{b:.3f}" for a, b in zip(ey, py0)))
    return ex, ey, px0, py0


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=6000)
    ap.add_argument("--minutes", type=float, default=9.0, help="safety wall-time cap")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    t0 = time.time()
    tx, ty = simulate(N_TRAIN, N_REC, SEEDS["train"])
    sx, sy = simulate(N_TEST, N_REC, SEEDS["test"])
    hx, hy = simulate(N_HELD, S0 + 1 + STEPS, SEEDS["heldout"])
    print(
        f"simulated {N_TRAIN} + {N_TEST} + {N_HELD} trajectories ({time.time() - t0:.0f}s); "
        f"X mean {tx.mean():.3f} std {tx.std():.3f}, Y mean {ty.mean():.4f} std {ty.std():.4f}"
    )
    stats = {
        "x_mean": tx.mean(),
        "x_std": tx.std(),
        "y_mean": ty.mean(),
        "y_std": ty.std(),
        "x_inc": (tx[:, 1:] - tx[:, :-1]).std(),
        "y_inc": (ty[:, 1:] - ty[:, :-1]).std(),
    }
    stats = {k: float(v) for k, v in stats.items()}

    def pairs(xs, ys):
        def f(a):
            return torch.tensor(a.reshape(-1, *a.shape[2:]), dtype=torch.float32)

        return f(ys[:, :-1]), f(xs[:, :-1]), f(ys[:, 1:]), f(xs[:, 1:])

    y_in, x_in, y_out, x_out = pairs(tx, ty)
    ty_in, tx_in, ty_out, tx_out = pairs(sx, sy)

    model = Emulator(stats)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.iters, eta_min=1e-5)
    bs, t0 = 256, time.time()
    for it in range(1, args.iters + 1):
        idx = torch.randint(0, len(y_in), (bs,))
        py, px = model.step(y_in[idx], x_in[idx])
        loss = (((py - y_out[idx]) / stats["y_inc"]) ** 2).mean() + (((px - x_out[idx]) / stats["x_inc"]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if it % 1000 == 0:
            print(f"iter {it} loss {loss.item():.2e} ({time.time() - t0:.0f}s)", flush=True)
        if time.time() - t0 > args.minutes * 60:
            print(f"wall-time cap of {args.minutes} min reached at iter {it}: results not reproducible")
            break
    model.eval()

    with torch.no_grad():
        py, px = model.step(ty_in, tx_in)
    print(
        f"test one-step RMSE: X {rmse(px.numpy(), tx_out.numpy()):.2e} (persistence "
        f"{rmse(tx_in.numpy(), tx_out.numpy()):.3f}), Y {rmse(py.numpy(), ty_out.numpy()):.2e} "
        f"(persistence {rmse(ty_in.numpy(), ty_out.numpy()):.3f})"
    )
    # 8-step rollout from many test starts
    starts = np.arange(0, N_REC - STEPS - 1, 25)
    y, x = (torch.tensor(np.concatenate(a[:, starts]), dtype=torch.float32) for a in (sy, sx))
    ey, ex = [], []
    with torch.no_grad():
        for k in range(1, STEPS + 1):
            y, x = model.step(y, x)
            ey.append(rmse(y.numpy(), np.concatenate(sy[:, starts + k])))
            ex.append(rmse(x.numpy(), np.concatenate(sx[:, starts + k])))
    print(
        f"test {STEPS}-step rollout RMSE over {len(y)} starts: X "
        + ", ".join(f"{e:.4f}" for e in ex)
        + "; Y "
        + ", ".join(f"{e:.4f}" for e in ey)
    )

    path = HERE / "model.onnx"
    torch.onnx.export(
        model,
        (ty_in[0], tx_in[0]),
        path,
        dynamo=False,
        opset_version=17,
        input_names=["input", "input_surface"],
        output_names=["output", "output_surface"],
    )
    m = onnx.load(path)
    m.ir_version = min(m.ir_version, 10)
    onnx.checker.check_model(m)
    onnx.save(m, path)

    ctx, truth = windows(sx[: N_TEST // 2], sy[: N_TEST // 2], S0)  # 8 windows, one per test trajectory
    np.savez(HERE / "contexts.npz", **ctx)
    np.savez(HERE / "truth.npz", **truth)
    hctx, htruth = windows(hx, hy, S0)  # 8 fresh trajectories (seed 3)
    np.savez(HERE / "heldout.npz", **hctx)
    np.savez(HERE / "heldout_truth.npz", **htruth)

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    y_ort, x_ort = sess.run(None, {"input": ctx["input"][0], "input_surface": ctx["input_surface"][0]})
    with torch.no_grad():
        y_pt, x_pt = model(torch.from_numpy(ctx["input"][0]), torch.from_numpy(ctx["input_surface"][0]))
    print(
        f"ORT vs torch max abs diff {max(np.abs(y_ort - y_pt.numpy()).max(), np.abs(x_ort - x_pt.numpy()).max()):.2e}; "
        f"params {sum(p.numel() for p in model.parameters())}; size {path.stat().st_size} B; stats {stats}"
    )
    check_rollout(sess, ctx, truth, "scoring ")
    check_rollout(sess, hctx, htruth, "held-out")


if __name__ == "__main__":
    main()
