"""Regenerate docs/simulator.md and its figures from the library's cost model.

    python sims/simulator.py

Tables: the inference-optimal V against B for each builtin device; the lifecycle V* over
B in {1, 4, 16, 64, 256} and lambda in {0, 1, 10, 100, 1000}; break-even lambda per V; the
KV-cache batch gain from 32k to 262k. Each in both cost modes where the mode matters.
"""

from __future__ import annotations

import _common  # noqa: F401  (puts the checkout on sys.path)
import numpy as np
from _common import figure_path, write_doc

from vocabjax.costmodel import CostModel, Settings
from vocabjax.hardware import BUILTIN_DEVICES, load_device
from vocabjax.lifecycle import (
    DEFAULT_BATCH,
    DEFAULT_LAM,
    DEFAULT_TOLERANCE,
    DEFAULT_VOCAB,
    FINE_PER_OCTAVE,
    N_DRAWS,
    Grid,
    break_even_rows,
    share_of_v_star,
    sweep,
    sweep_rows,
)
from vocabjax.plots import _pyplot, plot_sweep, save_figure
from vocabjax.render import human_size, markdown, pivot, v_star_cell
from vocabjax.shapes import load_shape

MODES = ("weights-only", "full")
PAPER_MODELS = ("paper-100m", "paper-1.5b", "paper-2.3b")
BATCH_LADDER = tuple(2**i for i in range(11))  # 1 .. 1024
WIDE_VOCAB = DEFAULT_VOCAB + (1048576,)


def hs(v) -> str:
    return "-" if not v else human_size(v)  # None or NO_VOCAB (0): no V


def inference_optimal() -> tuple[str, object]:
    """argmin_V c_infer(V, B) per device, model and mode (lambda -> infinity)."""
    grid = Grid(vocab=WIDE_VOCAB, batch=BATCH_LADDER, lam=(1.0,))
    out, curves = [], {}
    for mode in MODES:
        rows = []
        for dev in BUILTIN_DEVICES:
            for model in PAPER_MODELS + ("llama-8b",):
                cm = CostModel(load_device(dev), load_shape(model), Settings(mode=mode))
                res = sweep(cm, grid)
                row = {"device": dev, "model": model}
                for i, b in enumerate(grid.batch):
                    v = int(res.v_infer[i])
                    capped = v and res.batch_capped[res.index(v), i]
                    row[f"B={b}"] = hs(v) + ("*" if capped else "")
                rows.append(row)
                curves[mode, dev, model] = [int(v) or None for v in res.v_infer]
        out.append(f"### {mode} cost model\n\n{markdown(rows)}\n")
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, mode in zip(axes, MODES):
        for dev in BUILTIN_DEVICES:
            ax.plot(BATCH_LADDER, curves[mode, dev, "paper-1.5b"], marker="o", ms=3, label=dev)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("serving batch B")
        ax.set_title(f"inference-optimal V, paper-1.5b, {mode}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("argmin_V c_infer(V, B)")
    axes[1].legend(fontsize=8)
    fig.text(0.01, -0.02, "python sims/simulator.py", fontsize=8, family="monospace")
    save_figure(fig, figure_path("inference_optimal_v.png"))
    plt.close(fig)
    return "\n".join(out), None


def lifecycle_tables() -> str:
    grid = Grid(vocab=DEFAULT_VOCAB, batch=DEFAULT_BATCH, lam=DEFAULT_LAM)
    parts = []
    for dev in ("a10g", "a100-paper", "h100-sxm"):
        for model in ("paper-100m", "paper-1.5b"):
            for mode in MODES:
                cm = CostModel(load_device(dev), load_shape(model), Settings(mode=mode))
                res = sweep(cm, grid)
                cells = {(r["batch"], r["lam"]): r for r in sweep_rows(cm, res)}
                rows = []
                for b in grid.batch:
                    row = {"B": b}
                    for x in grid.lam:
                        cell = cells[b, x]
                        row[f"lam={x:g}"] = v_star_cell(cell, share=share_of_v_star(cell))
                    rows.append(row)
                parts.append(f"### {dev}, {model}, {mode}\n\n{markdown(rows)}\n")
    return "\n".join(parts)


def break_even_tables() -> str:
    parts = []
    for dev, model in (("a10g", "paper-100m"), ("a100-paper", "paper-1.5b")):
        for mode in MODES:
            cm = CostModel(load_device(dev), load_shape(model), Settings(mode=mode))
            res = sweep(cm, Grid())
            table = pivot(
                break_even_rows(cm, res),
                index="vocab",
                columns="batch",
                value="break_even_lam",
                column_label=lambda b: f"B={b}",
                cell=lambda x: "never" if x is None else f"{x:.3g}",
            )
            for row in table:
                row["vocab"] = hs(row["vocab"])
            parts.append(
                f"### {dev}, {model}, {mode} (training optimum V_t = {hs(res.v_train)})\n\n"
                f"{markdown(table)}\n"
            )
    return "\n".join(parts)


def kv_gain() -> str:
    rows = []
    for dev in BUILTIN_DEVICES:
        for model in ("paper-1.5b", "paper-2.3b", "llama-1b", "llama-8b", "llama-70b"):
            cm = CostModel(load_device(dev), load_shape(model), Settings(mode="full"))
            res = sweep(cm, Grid(vocab=(32768, 262144), batch=(1,), lam=(1.0,)))
            b32, b262 = int(res.b_max[0]), int(res.b_max[1])
            rows.append(
                {
                    "device": dev,
                    "model": model,
                    "B_max 32k": b32,
                    "B_max 262k": b262,
                    "gain": f"{b262 / b32:.3f}" if b32 else "-",
                    "KV/seq 32k (MB)": f"{res.kv_bytes_per_seq[0] / 1e6:.1f}",
                    "KV/seq 262k (MB)": f"{res.kv_bytes_per_seq[1] / 1e6:.1f}",
                }
            )
    return markdown(rows)


def default_figure() -> None:
    """The figure `python cli.py sweep --plot` draws, for the default device and model."""
    runs = []
    for mode in MODES:
        cm = CostModel(load_device("a100-80gb"), load_shape("paper-1.5b"), Settings(mode=mode))
        runs.append((cm, sweep(cm, Grid())))
    plot_sweep(
        runs,
        figure_path("sweep_default.png"),
        caption="python sims/simulator.py "
        "(= python cli.py sweep --plot ..., once per --cost-model)",
    )


def main() -> None:
    s = Settings()
    default_figure()
    inf_md, _ = inference_optimal()
    body = f"""Every number below is computed by `vocabjax` from builtin device profiles
(`vocabjax/hardware.py`: datasheet ceilings at efficiency 1, except `a100-80gb` and `h100-sxm`,
calibrated on published per-op kernel timings as docs/gpu_calibration.md says, with their
datasheet ceilings beside them as `a100-80gb-datasheet` and `h100-sxm-datasheet`), builtin shapes (`vocabjax/shapes.py`) and the default compression curve
(Tao et al. 2024, SlimPajama); serving settings: prompt {s.prompt_bytes:g} bytes, output
{s.output_bytes:g} bytes, bf16 weights and KV cache, unfused logits. `weights-only` drops attention
and KV-cache terms (the simplification under which the paper's claims compare); `full` keeps them.
Measured profiles (`python cli.py autotune`, `tokenizer measure`) replace these inputs.

## The default sweep

`python cli.py sweep` on its defaults (a100-80gb, paper-1.5b), both cost modes: V* over
(B, lambda) and the inference cost per byte against V for each B.

![default sweep](sweep_default.png)

Every sweep here caps each batch at the largest one whose weights and KV cache fit on the card
(the default of `sweep` and `plan`; `--no-cap-batch` costs B however much memory it needs), and
marks with * a cell costed at such a smaller batch. The bracket after V* is its band: every V,
on a grid of {FINE_PER_OCTAVE} sizes per octave, whose J is within {100 * DEFAULT_TOLERANCE:g}%
of J at V* (`--tolerance`). For a calibrated profile (`h100-sxm` below) the percentage is the
share of {N_DRAWS} profiles drawn from the calibration's log residual spread (each op family's
time scaled by its own lognormal factor) whose V* is the V* shown; datasheet profiles have no
such spread, so no share.

## Inference-optimal V against B (lambda -> infinity)

![inference-optimal V](inference_optimal_v.png)

{inf_md}

## Lifecycle V* over (B, lambda)

{lifecycle_tables()}

## Break-even lambda of each V against the training optimum

lambda at which V's lifecycle cost drops below the training-optimal V's; "never" when V is no
cheaper to serve at that batch.

{break_even_tables()}

## KV-cache batch: the largest batch that fits, 32k against 262k

Full cost model; B_max = floor((M - w (N_nv + 2 V D)) / KV bytes per sequence), with
(prompt + output) / beta(V) tokens per sequence.

{kv_gain()}
"""
    write_doc("simulator.md", "Simulator tables", body)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
