"""Held-out windows for `tqsdeploy frontier --eval-contexts`: 16 FRESH Lorenz-96
trajectories (seed 3; train.py uses seed 1 for training and seed 2 for the test
trajectories behind contexts.npz), with the same RK4 integrator, constants and
spin-up as train.py. numpy only (onnxruntime is used for the optional `--check`).

    python examples/lorenz96/make_heldout.py [--check]
"""

import argparse
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
N, F, DT_INT, SUB = 40, 8.0, 0.01, 5  # as in train.py: DT = SUB * DT_INT = 0.05
SPINUP, STEPS, SEED, N_WIN, S0 = 1000, 40, 3, 16, 100


def l96_tendency(x):
    """dx_i/dt = (x_{i+1} - x_{i-2}) x_{i-1} - x_i + F, periodic in i."""
    return (np.roll(x, -1, -1) - np.roll(x, 2, -1)) * np.roll(x, 1, -1) - x + F


def simulate(n_traj, n_rec, seed):
    """RK4 trajectories from random ICs, spun up onto the attractor; returns (n_traj, n_rec, N). Same as train.py."""
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


def check(contexts, truth, label):
    """Autoregressive onnxruntime rollout of model.onnx; per-step RMSE next to persistence."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(HERE / "model.onnx"), providers=["CPUExecutionProvider"])
    pred = np.empty_like(truth)
    for w in range(len(contexts)):
        x = contexts[w]
        for k in range(STEPS):
            x = sess.run(None, {"x": x})[0]
            pred[w, k] = x
    err = np.sqrt(((pred - truth) ** 2).mean(axis=(0, 2, 3)))
    per = np.sqrt(((contexts[:, None] - truth) ** 2).mean(axis=(0, 2, 3)))
    print(
        f"{label}: rollout RMSE (model / persistence) "
        + ", ".join(f"step {k + 1} {err[k]:.3f}/{per[k]:.2f}" for k in (0, 4, 9, 19, 29, 39))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="roll model.onnx out on held-out and scoring windows")
    args = parser.parse_args()
    traj = simulate(N_WIN, S0 + 1 + STEPS, seed=SEED)
    contexts = traj[:, S0].astype(np.float32)[:, None, :]  # (16, 1, 40)
    truth = traj[:, S0 + 1 : S0 + 1 + STEPS].astype(np.float32)[:, :, None]  # (16, 40, 1, 40)
    np.savez(HERE / "heldout.npz", x=contexts)
    np.savez(HERE / "heldout_truth.npz", x_next=truth)
    print(f"held-out: {N_WIN} fresh trajectories (seed {SEED}), state {S0} after spin-up, {STEPS} steps of truth")
    if args.check:
        check(contexts, truth, "held-out")
        check(np.load(HERE / "contexts.npz")["x"], np.load(HERE / "truth.npz")["x_next"], "scoring ")


if __name__ == "__main__":
    main()
