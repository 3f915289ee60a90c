"""Train a 3x downscaling model for ERA5 2 m temperature over the UK and export it to ONNX.

A single-step model (T = 1, nothing to feed back): given the coarse field (the
33x49 field averaged over 3x3 blocks -> 11x17; the last block column holds only
the easternmost grid column, as 49 = 16 * 3 + 1) and the hour of day, predict the
full-resolution field at the same time.

    fine = bilinear_x3(coarse)[:33, :49] + res_std * CNN([bilinear_x3(coarse_n), static], hour)

coarse_n is the coarse field standardised with the train mean/std; `static` is a
learned 4-channel 33x49 map (fine-scale geography the coarse field cannot carry);
the hour of day picks a row of an Embedding(24, 64) table whose two halves are
per-channel biases of the first two convs (32 channels each). Five 3x3 convs
(5 -> 32 -> 32 -> 32 -> 32 -> 1, GELU). Constants are in the graph: Kelvin in,
Kelvin out. Weeks 1-3 (hours 0..503) train, week 4 (hours 504..743) test.

Run from the repo root:  python examples/era5_downscale/train.py [--data PATH]
"""

import argparse
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn
from torch.nn import functional as tf

HERE = Path(__file__).resolve().parent
DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "era5_t2m_uk_2019_03.npz"
N_TRAIN_H, FACTOR, WIDTH, N_STATIC, N_WIN, PER_WIN, NY, NX = 504, 3, 32, 4, 8, 4, 33, 49


def coarsen(t2m):
    """(T, 33, 49) -> (T, 1, 11, 17) means over 3x3 blocks. 49 = 16 * 3 + 1, so the last block column
    holds only the easternmost grid column (the same as edge-padding the field to 33 x 51)."""
    t, ny, nx = t2m.shape
    padded = np.pad(t2m, ((0, 0), (0, -ny % FACTOR), (0, -nx % FACTOR)), mode="edge")
    return padded.reshape(t, -1, FACTOR, padded.shape[2] // FACTOR, FACTOR).mean((2, 4))[:, None]


def bilinear(coarse):
    """x3 bilinear upsampling (11 x 17 -> 33 x 51), cropped to the 33 x 49 grid."""
    return tf.interpolate(coarse, scale_factor=FACTOR, mode="bilinear", align_corners=False)[..., :NY, :NX]


class Downscaler(nn.Module):
    def __init__(self, mean, std, res_std, shape=(NY, NX)):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))
        self.register_buffer("res_std", torch.tensor(res_std, dtype=torch.float32))
        self.hour_embed = nn.Embedding(24, 2 * WIDTH)
        nn.init.normal_(self.hour_embed.weight, std=0.1)
        self.static = nn.Parameter(0.1 * torch.randn(1, N_STATIC, *shape))
        chans = [1 + N_STATIC, WIDTH, WIDTH, WIDTH, WIDTH, 1]
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 3, padding=1) for a, b in zip(chans, chans[1:]))
        self.act = nn.GELU()

    def forward(self, coarse, hour):
        up = bilinear((coarse - self.mean) / self.std)  # (batch, 1, 33, 49)
        bias = self.hour_embed(hour)[:, :, None, None]  # (batch, 64, 1, 1)
        h = torch.cat([up, self.static.expand(up.shape[0], -1, -1, -1)], 1)
        for i, conv in enumerate(self.convs):
            h = conv(h)
            if i < 2:
                h = h + bias[:, i * WIDTH : (i + 1) * WIDTH]
            if i < len(self.convs) - 1:
                h = self.act(h)
        return up * self.std + self.mean + self.res_std * h


def rmse(a, b):
    return float(np.sqrt(((a - b) ** 2).mean()))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--epochs", type=int, default=80)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    t2m = np.load(args.data)["t2m"].astype(np.float32)  # (744, 33, 49)
    coarse_all = torch.from_numpy(coarsen(t2m))  # (744, 1, 11, 17)
    fine_all = torch.from_numpy(t2m[:, None])  # (744, 1, 33, 49)
    hour_all = torch.from_numpy(np.arange(len(t2m)) % 24)  # the file starts at 00 UTC
    x, hr, y = coarse_all[:N_TRAIN_H], hour_all[:N_TRAIN_H], fine_all[:N_TRAIN_H]
    mean, std = float(x.mean()), float(x.std())
    res_std = float((y - bilinear(x)).std())
    model = Downscaler(mean, std, res_std)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    bs = 16
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 3e-3, total_steps=args.epochs * ((len(x) + bs - 1) // bs))
    t0 = time.time()
    for ep in range(args.epochs):
        perm, tot = torch.randperm(len(x)), 0.0
        for i in range(0, len(x), bs):
            idx = perm[i : i + bs]
            loss = ((model(x[idx], hr[idx]) - y[idx]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            tot += loss.item() * len(idx)
        if ep % 25 == 24 or ep == args.epochs - 1:
            print(f"epoch {ep + 1} train RMSE {np.sqrt(tot / len(x)):.3f} K ({time.time() - t0:.0f}s)", flush=True)
    model.eval()

    xt, ht, yt = coarse_all[N_TRAIN_H:], hour_all[N_TRAIN_H:], fine_all[N_TRAIN_H:]
    with torch.no_grad():
        pred, base = model(xt, ht).numpy(), bilinear(xt).numpy()
        near = tf.interpolate(xt, scale_factor=FACTOR, mode="nearest")[..., :NY, :NX].numpy()
    yt = yt.numpy()
    print(
        f"test ({len(yt)} hours) RMSE: model {rmse(pred, yt):.3f} K, bilinear {rmse(base, yt):.3f} K, "
        f"nearest {rmse(near, yt):.3f} K; train RMSE: model {rmse(model(x, hr).detach().numpy(), y.numpy()):.3f} K, "
        f"bilinear {rmse(bilinear(x).numpy(), y.numpy()):.3f} K"
    )
    by_hour = [
        (
            rmse(pred[ht.numpy() % 24 == h], yt[ht.numpy() % 24 == h]),
            rmse(base[ht.numpy() % 24 == h], yt[ht.numpy() % 24 == h]),
        )
        for h in range(0, 24, 6)
    ]
    print(
        "test RMSE by hour of day (model / bilinear, K): "
        + ", ".join(f"{h:02d}h {m:.2f}/{b:.2f}" for h, (m, b) in zip(range(0, 24, 6), by_hour))
    )

    path = HERE / "model.onnx"
    torch.onnx.export(
        model,
        (xt[:2], ht[:2]),
        path,
        dynamo=False,
        opset_version=17,
        input_names=["coarse", "hour"],
        output_names=["fine"],
        dynamic_axes={"coarse": {0: "batch"}, "hour": {0: "batch"}, "fine": {0: "batch"}},
    )
    m = onnx.load(path)
    m.ir_version = min(m.ir_version, 10)
    onnx.checker.check_model(m)
    onnx.save(m, path)

    # 8 scoring windows of 4 test-week times each (32 times spread over the week, every ~7.5 h, so all hours
    # of the day occur); held-out: 32 other times, each 3-4 h after a scoring time
    scoring = N_TRAIN_H + np.round(np.linspace(0, 239 - 4, N_WIN * PER_WIN)).astype(int)
    held = scoring + 3 + (np.arange(len(scoring)) % 2)
    assert not set(scoring.tolist()) & set(held.tolist()) and held.max() < len(t2m)
    coarse_np, hour_np = coarse_all.numpy(), hour_all.numpy().astype(np.int64)
    for name, times in (("contexts", scoring), ("heldout", held)):
        times = times.reshape(N_WIN, PER_WIN)
        np.savez(HERE / f"{name}.npz", coarse=coarse_np[times], hour=hour_np[times])  # (8, 4, 1, 11, 17), (8, 4)
        np.savez(
            HERE / ("truth.npz" if name == "contexts" else "heldout_truth.npz"), fine=t2m[times][:, None, :, None]
        )  # (8, 1, 4, 1, 33, 49)
        print(f"{name} times {times.tolist()}")

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for name, truth_name in (("contexts", "truth"), ("heldout", "heldout_truth")):
        ctx, truth = np.load(HERE / f"{name}.npz"), np.load(HERE / f"{truth_name}.npz")["fine"]
        outs = np.stack(
            [sess.run(None, {"coarse": ctx["coarse"][w], "hour": ctx["hour"][w]})[0] for w in range(N_WIN)]
        )[:, None]
        base = np.stack([bilinear(torch.from_numpy(ctx["coarse"][w])).numpy() for w in range(N_WIN)])[:, None]
        print(f"{name}: ORT RMSE {rmse(outs, truth):.3f} K, bilinear {rmse(base, truth):.3f} K")
    with torch.no_grad():
        y_pt = model(xt[:4], ht[:4]).numpy()
    y_ort = sess.run(None, {"coarse": xt[:4].numpy(), "hour": ht[:4].numpy()})[0]
    print(
        f"ORT vs torch max abs diff {np.abs(y_ort - y_pt).max():.2e} K; "
        f"params {sum(p.numel() for p in model.parameters())}; size {path.stat().st_size} B"
    )


if __name__ == "__main__":
    main()
