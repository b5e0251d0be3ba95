"""Figures (matplotlib, the ``plot`` extra): V* heat maps and cost-per-byte curves."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from vocabjax.costmodel import CostModel
from vocabjax.errors import UserError
from vocabjax.lifecycle import SweepResult
from vocabjax.render import human_size


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plots need matplotlib: pip install -e '.[plot]'") from None
    return plt


def check_plot_path(path: str | os.PathLike) -> Path:
    """Fail early, before any work, on a figure name matplotlib cannot write."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UserError(f"plot file {str(path)!r} must end in .png, .svg or .pdf")
    _pyplot()
    return path


def save_figure(fig, path: str | os.PathLike) -> Path:
    """Save through a temporary file and rename, like every other output."""
    path = check_plot_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    os.replace(tmp, path)
    return path


def plot_sweep(
    runs: Sequence[tuple[CostModel, SweepResult]], path: str | os.PathLike, *, caption: str = ""
) -> Path:
    """Per (device, model): V* over (B, lambda), and c_infer against V for each B (log axes)."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 4.2 * len(runs)), squeeze=False)
    for (model, res), (ax_map, ax_cost) in zip(runs, axes, strict=True):
        g = res.grid
        v_star = np.where(res.v_star >= 0, np.asarray(g.vocab)[np.maximum(res.v_star, 0)], np.nan)
        im = ax_map.imshow(
            np.log2(v_star),
            origin="lower",
            aspect="auto",
            cmap="viridis",
            vmin=math.log2(g.vocab[0]),
            vmax=math.log2(g.vocab[-1]) if len(g.vocab) > 1 else None,
        )
        ax_map.set_xticks(range(len(g.lam)), [f"{x:g}" for x in g.lam])
        ax_map.set_yticks(range(len(g.batch)), [str(b) for b in g.batch])
        ax_map.set_xlabel("lambda (bytes served / bytes trained)")
        ax_map.set_ylabel("serving batch B")
        ax_map.set_title(f"V* on {model.device.name}, {model.shape.name} ({model.settings.mode})")
        if len(g.lam) * len(g.batch) <= 400:
            for bi in range(len(g.batch)):
                for li in range(len(g.lam)):
                    v = v_star[bi, li]
                    label = "-" if math.isnan(v) else human_size(int(v))
                    ax_map.text(li, bi, label, ha="center", va="center", color="w", fontsize=8)
        cbar = fig.colorbar(im, ax=ax_map)
        cbar.set_label("log2 V*")
        for bi, b in enumerate(g.batch):
            ax_cost.plot(g.vocab, res.c_infer[:, bi], marker="o", ms=3, label=f"B={b}")
        ax_cost.set_xscale("log", base=2)
        ax_cost.set_yscale("log")
        ax_cost.set_xlabel("vocabulary size V")
        ax_cost.set_ylabel("inference cost, s per served byte")
        ax_cost.set_title("c_infer(V, B)")
        ax_cost.legend(fontsize=8)
        ax_cost.grid(True, which="both", alpha=0.3)
    if caption:
        fig.text(0.01, -0.01, caption, fontsize=8, family="monospace")
    fig.tight_layout()
    out = save_figure(fig, path)
    plt.close(fig)
    return out
