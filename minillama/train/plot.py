"""The loss plot of a training run: ``loss.png`` in ``--out``, redrawn at every checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

PLOT_NAME = "loss.png"


def plot_losses(history: dict[str, list], path, title: str = "") -> Path:
    """Draw the training loss (raw and smoothed) and the validation loss against the step
    into a PNG, atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    tr = np.asarray(history.get("train") or np.zeros((0, 2)), dtype=np.float64).reshape(-1, 2)
    va = np.asarray(history.get("val") or np.zeros((0, 2)), dtype=np.float64).reshape(-1, 2)
    if tr.size:
        ax.plot(tr[:, 0], tr[:, 1], color="tab:blue", alpha=0.25, lw=0.8, label="train (step)")
        k = max(1, len(tr) // 50)
        if k > 1:
            kern = np.ones(k) / k
            sm = np.convolve(tr[:, 1], kern, mode="valid")
            ax.plot(tr[k - 1:, 0], sm, color="tab:blue", lw=1.5, label=f"train ({k}-step mean)")
    if va.size:
        ax.plot(va[:, 0], va[:, 1], "o-", color="tab:red", ms=3, lw=1.5, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return path

