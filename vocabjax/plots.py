"""Figures (matplotlib, the ``plot`` extra): V* heat maps and cost-per-byte curves."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from vocabjax import outputs
from vocabjax.costmodel import CostModel
from vocabjax.errors import UserError
from vocabjax.lifecycle import SweepResult
from vocabjax.outputs import check_file_target
from vocabjax.render import approx_size, human_size


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plots need matplotlib: pip install -e '.[plot]'") from None
    return plt


def check_plot_path(path: str | os.PathLike) -> Path:
    """Fail early, before any work, on a figure name matplotlib or the file system refuses."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UserError(f"plot file {str(path)!r} must end in .png, .svg or .pdf")
    _pyplot()
    return check_file_target(path, what="plot file")


def save_figure(fig, path: str | os.PathLike) -> Path:
    """Save through a uniquely named temporary file and rename, like every other output."""
    return outputs.save_figure(fig, check_plot_path(path))


def plot_sweep(
    runs: Sequence[tuple[CostModel, SweepResult]], path: str | os.PathLike, *, caption: str = ""
) -> Path:
    """Per (device, model): V* over (B, lambda), and c_infer against V for each B (log axes)."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 4.2 * len(runs)), squeeze=False)
    for (model, res), (ax_map, ax_cost) in zip(runs, axes, strict=True):
        g = res.grid
        v_star = np.where(res.found, res.v_star, np.nan)
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
        ax_map.set_title(
            f"V* [band within {100 * res.tolerance:g}% of its J] on {model.device.name}, "
            f"{model.shape.name} ({model.settings.mode})",
            fontsize=10,
        )
        if len(g.lam) * len(g.batch) <= 400:
            for bi in range(len(g.batch)):
                for li in range(len(g.lam)):
                    light = res.found[bi, li] and im.norm(np.log2(v_star[bi, li])) > 0.7
                    ax_map.text(li, bi, _cell_label(res, bi, li), ha="center", va="center",
                                color="k" if light else "w", fontsize=7)  # fmt: skip
        cbar = fig.colorbar(im, ax=ax_map)
        cbar.set_label("log2 V*")
        fits = np.isfinite(res.c_infer)  # inf: that batch does not fit at that V
        for bi, b in enumerate(g.batch):
            if fits[:, bi].any():
                ax_cost.plot(g.vocab, np.where(fits[:, bi], res.c_infer[:, bi], np.nan),
                             marker="o", ms=3, label=f"B={b}")  # fmt: skip
        ax_cost.set_xscale("log", base=2)
        ax_cost.set_xlabel("vocabulary size V")
        ax_cost.set_ylabel("inference cost, s per served byte")
        ax_cost.set_title("c_infer(V, B)")
        if fits.any():
            ax_cost.set_yscale("log")
            ax_cost.legend(fontsize=8)
        else:
            ax_cost.set_xlim(g.vocab[0] / 2, g.vocab[-1] * 2)
            ax_cost.text(0.5, 0.5, "no batch fits in device memory at any V",
                         ha="center", va="center", transform=ax_cost.transAxes)  # fmt: skip
        ax_cost.grid(True, which="both", alpha=0.3)
    return _finish(fig, path, caption)


def _cell_label(res: SweepResult, bi: int, li: int) -> str:
    """V* over its band (``64k`` / ``45.2k-123k``), * where the batch was capped."""
    if not res.found[bi, li]:
        return "-"
    vi = res.index(int(res.v_star[bi, li]))
    mark = "*" if res.batch_capped[vi, bi] else "" if res.fits[vi, bi] else "!"
    low, high = approx_size(int(res.v_low[bi, li])), approx_size(int(res.v_high[bi, li]))
    return f"{human_size(int(res.v_star[bi, li]))}{mark}\n{low}-{high}"


def plot_serve(result, path: str | os.PathLike, *, caption: str = "") -> Path:
    """A served trace (``vocabjax.serving.ServeResult``): the head of each batch over the
    virtual clock (marker size ~ B; the controller's moves as vertical lines), and each
    request's prompt bits per byte with the controller's windowed value and thresholds."""
    plt = _pyplot()
    fig, (ax_head, ax_bpb) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    starts = [b.start_s for b in result.batches]
    heads = [math.log2(b.head) for b in result.batches]
    ax_head.step(starts, heads, where="post", color="0.6", lw=1)
    ax_head.scatter(
        starts, heads, s=[8 + 2 * b.batch for b in result.batches], c="C0", zorder=3,
        label="a batch (size ~ B)",
    )  # fmt: skip
    ax_head.set_yticks([math.log2(h) for h in result.heads], [human_size(h) for h in result.heads])
    ax_head.set_ylabel("head (vocabulary V)")
    ax_head.set_title("served head per batch")
    for ax in (ax_head, ax_bpb):
        for i, s in enumerate(w for w in result.switches if w.by == "controller"):
            ax.axvline(s.time_s, color="C3", ls=":", lw=1, label=None if i else "controller move")
    ax_head.legend(fontsize=8, loc="upper left")
    finish = [r.finish_s for r in result.requests]
    scored = [(f, r.prompt_bpb) for f, r in zip(finish, result.requests, strict=True)
              if r.prompt_bpb is not None]  # fmt: skip
    if scored:  # none where the prompts were not scored
        ax_bpb.scatter(*zip(*scored, strict=True), s=6, c="0.6", label="prompt BPB (per request)")
    counted: list[tuple[float, float]] = []
    offset = None
    for r in result.requests:
        if r.window_bpb is None:
            continue
        if offset is not None and r.offset != offset:
            counted.append((r.finish_s, math.nan))  # a move cleared the window: break the line
        counted.append((r.finish_s, r.window_bpb))
        offset = r.offset
    if counted:
        ax_bpb.plot(*zip(*counted, strict=True), color="C0", marker=".", ms=3, lw=1,
                    label="windowed BPB (controller)")  # fmt: skip
    if result.thresholds is not None:
        for value, name, color in ((result.thresholds.high, "high", "C3"),
                                   (result.thresholds.low, "low", "C2")):  # fmt: skip
            ax_bpb.axhline(value, color=color, ls="--", lw=1, label=f"{name} {value:.3f}")
    ax_bpb.set_xlabel("virtual clock, s")
    ax_bpb.set_ylabel("bits per byte")
    ax_bpb.legend(fontsize=8, loc="upper left")
    ax_bpb.grid(True, alpha=0.3)
    return _finish(fig, path, caption)


def _finish(fig, path: str | os.PathLike, caption: str) -> Path:
    """Caption (monospace, under the axes), lay out, save atomically and close the figure."""
    plt = _pyplot()
    if caption:
        fig.text(0.01, -0.01, caption, fontsize=8, family="monospace")
    fig.tight_layout()
    out = save_figure(fig, path)
    plt.close(fig)
    return out
