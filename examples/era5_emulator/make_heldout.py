"""Held-out windows for `tqsdeploy frontier --eval-contexts`: 16 test-week start
hours that are not scoring hours of contexts.npz, spread over the week and over
the hours of the day, so an allocation that overfits the scoring contexts shows.
numpy only (onnxruntime is used for the optional `--check` rollout).

    python examples/era5_emulator/make_heldout.py [--data PATH] [--check]
"""

import argparse
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATA = HERE.parents[2] / "shared" / "data" / "era5_t2m_uk_2019_03.npz"
N_TRAIN_H, N_HOURS, LEAD, STEPS, N_CTX, N = 504, 744, 6, 8, 6, 16


def rmse(a, b):
    return float(np.sqrt(((a - b) ** 2).mean()))


def check(contexts, truth, label):
    """Autoregressive onnxruntime rollout of model.onnx; per-step RMSE next to persistence."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(HERE / "model.onnx"), providers=["CPUExecutionProvider"])
    pred = np.empty_like(truth)
    for w in range(len(contexts)):
        s = contexts[w]
        for k in range(STEPS):
            s = sess.run(None, {"state": s})[0]
            pred[w, k] = s
    model = [rmse(pred[:, k], truth[:, k]) for k in range(STEPS)]
    persist = [rmse(contexts, truth[:, k]) for k in range(STEPS)]
    print(
        f"{label}: rollout RMSE per lead (model / persistence, K): "
        + ", ".join(f"{LEAD * (k + 1)}h {m:.2f}/{p:.2f}" for k, (m, p) in enumerate(zip(model, persist)))
        + f"; RMS over leads {np.sqrt(np.mean(np.square(model))):.3f}/{np.sqrt(np.mean(np.square(persist))):.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--check", action="store_true", help="roll model.onnx out on held-out and scoring windows")
    args = parser.parse_args()
    t2m = np.load(args.data)["t2m"].astype(np.float32)[:, None]  # (744, 1, 33, 49)
    last = N_HOURS - 1 - STEPS * LEAD  # 695: t + 48 h stays in the test week
    scoring = np.linspace(N_TRAIN_H, last, N_CTX).astype(int)  # as in train.py
    starts = np.round(np.linspace(N_TRAIN_H + 3, last - 2, N)).astype(int)
    starts = np.array([s + 1 if s in scoring else s for s in starts])
    assert not set(starts.tolist()) & set(scoring.tolist()) and starts.min() >= N_TRAIN_H and starts.max() <= last
    contexts = t2m[starts][:, None]  # (16, 1, 1, 33, 49)
    truth = np.stack([t2m[starts + k * LEAD] for k in range(1, STEPS + 1)], 1)[:, :, None]  # (16, 8, 1, 1, 33, 49)
    np.savez(HERE / "heldout.npz", state=contexts)
    np.savez(HERE / "heldout_truth.npz", next_state=truth)
    print(
        f"held-out start hours {starts.tolist()} (hour of day {(starts % 24).tolist()}); "
        f"scoring hours {scoring.tolist()}"
    )
    if args.check:
        check(contexts, truth, "held-out")
        ctx, tru = np.load(HERE / "contexts.npz")["state"], np.load(HERE / "truth.npz")["next_state"]
        check(ctx, tru, "scoring ")


if __name__ == "__main__":
    main()
