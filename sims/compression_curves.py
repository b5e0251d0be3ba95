"""Compression against vocabulary size: regenerates docs/compression.md and docs/compression.png.

For the builtin corpus and every --corpus given: one nested byte-level BPE training at the
largest size (levels the corpus cannot reach are dropped and said so), every level measured on
the held-out part (bytes per token with a 95% interval over documents), beside the builtin
default curve (Tao et al. 2024, SlimPajama: a different corpus). Where a corpus reaches
--prune-from, that level is pruned to --prune-to on the train part and measured next to the
level of the same size trained directly.

    python sims/compression_curves.py --corpus 'site-packages/**/*.py' --max-bytes 64m
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's vocabjax

import numpy as np  # noqa: E402

from vocabjax import render  # noqa: E402
from vocabjax.compression import DEFAULT_CURVE  # noqa: E402
from vocabjax.corpus import BUILTIN, open_corpus  # noqa: E402
from vocabjax.outputs import atomic_write_text, save_figure  # noqa: E402
from vocabjax.units import parse_size, parse_size_list  # noqa: E402
from vocabjax.vocab import (  # noqa: E402
    LoadedTokenizer,
    count_usage,
    curve_notes,
    measure,
    prune,
    train_nested,
)
from vocabjax.vocab.bpe import from_json  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs"
MIB = 2**20


def _loaded(data, label: str) -> LoadedTokenizer:
    return LoadedTokenizer(from_json(data, where=label), path=label, kind="hf")


def run_corpus(spec: str, max_bytes: int, sizes: list[int], prune_from: int, prune_to: int):
    corpus = open_corpus(spec, max_bytes=max_bytes)
    print(f"[{spec}] {corpus.describe('train')}", file=sys.stderr)
    train = list(corpus.texts("train"))
    start = time.perf_counter()
    nested = train_nested(train, sizes, stop_short=True)
    t_train = time.perf_counter() - start
    reached = len(nested.largest["model"]["vocab"])
    print(
        f"[{spec}] trained to {reached} in {t_train:.1f} s; unreached {nested.unreached}",
        file=sys.stderr,
    )
    levels = [_loaded(nested.level(v), f"nested {v}") for v in nested.vocab_sizes]
    extra = []
    prune_note = ""
    if prune_from in nested.vocab_sizes and prune_to < prune_from:
        source = nested.level(prune_from)
        counts = count_usage(from_json(source, where="source"), train)
        pruned = prune(source, counts, prune_to)
        extra.append(_loaded(pruned.data, f"pruned {prune_from}->{prune_to}"))
        start = time.perf_counter()
        direct = train_nested(train, [prune_to])
        t_direct = time.perf_counter() - start
        same = direct.level(prune_to)["model"] == nested.level(prune_to)["model"]
        extra.append(_loaded(direct.level(prune_to), f"direct {prune_to}"))
        prune_note = (
            f"pruned {prune_from} -> {prune_to} on the train part ({pruned.kept_by_use} tokens "
            f"kept by use, {pruned.kept_to_fill} filled in merge order); direct training at "
            f"{prune_to} took {t_direct:.1f} s and equals the nested cut: {same}"
        )
    else:
        prune_note = f"no prune comparison: the corpus does not reach {prune_from}"
    heldout = list(corpus.texts("heldout"))
    start = time.perf_counter()
    points = measure(levels + extra, heldout)
    t_measure = time.perf_counter() - start
    by_label = {p.tokenizer: p for p in points}
    return {
        "spec": spec,
        "label": corpus.label,
        "train_bytes": nested.stats.bytes,
        "train_documents": nested.stats.documents,
        "heldout_bytes": points[0].bytes,
        "heldout_documents": points[0].documents,
        "train_seconds": t_train,
        "measure_seconds": t_measure,
        "reached": reached,
        "unreached": nested.unreached,
        "levels": [by_label[t.path] for t in levels],
        "extra": [by_label[t.path] for t in extra],
        "prune_note": prune_note,
        "notes": curve_notes([by_label[t.path] for t in levels]),
    }


def _row(p, name):
    return {
        "tokenizer": name,
        "vocab": p.vocab,
        "bytes_per_token": round(p.bytes_per_token, 4),
        "ci95": f"{p.ci95[0]:.3f}-{p.ci95[1]:.3f}",
        "chars_per_token": round(p.chars_per_token, 4),
        "default_curve": round(float(DEFAULT_CURVE.beta(np.float64(p.vocab), xp=np)), 3),
    }


def write_doc(results, command: str, png: Path, md: Path) -> None:
    """docs/compression.md: the settings, the tables and their reading. Long for its prose, kept
    in one place so the document reads in order."""
    lines = [
        "# Compression against vocabulary size",
        "",
        f"Regenerate: `{command}` ({datetime.date.today().isoformat()}, {os.cpu_count()} CPU "
        "cores). Figure: [compression.png](compression.png).",
        "",
        "Bytes per token of nested byte-level BPE levels (one training at the largest size, "
        "each smaller level cut by token id), measured on each corpus's held-out part (10% of "
        "documents by content hash), with a 95% interval over documents. `default_curve` is the "
        f"simulator's builtin curve, {DEFAULT_CURVE.source}, interpolated in log V: a different, "
        "mostly English corpus, so it is shown for scale, not as a target.",
        "",
    ]
    for r in results:
        lines += [
            f"## {r['label']}",
            "",
            f"- train part: {r['train_bytes'] / MIB:.1f} MiB ({r['train_bytes']:,} bytes), "
            f"{r['train_documents']} documents; held-out part: {r['heldout_bytes'] / MIB:.2f} MiB, "
            f"{r['heldout_documents']} documents",
            f"- one training to {r['reached']:,} tokens in {r['train_seconds']:.1f} s; "
            f"measuring all tokenizers took {r['measure_seconds']:.1f} s",
        ]
        if r["unreached"]:
            lines.append(
                f"- not reached: {', '.join(map(str, r['unreached']))} (BPE ran out of pairs to "
                f"merge at {r['reached']:,} tokens on this much text)"
            )
        lines.append(f"- {r['prune_note']}")
        lines += [f"- note: {n}" for n in r["notes"]]
        if len(r["extra"]) == 2:
            pruned, direct = r["extra"]
            diff = pruned.bytes_per_token / direct.bytes_per_token - 1
            overlap = pruned.ci95[0] <= direct.ci95[1] and direct.ci95[0] <= pruned.ci95[1]
            lines.append(
                f"- {pruned.tokenizer}: {pruned.bytes_per_token:.4f} bytes per token against "
                f"{direct.bytes_per_token:.4f} for {direct.tokenizer}, {diff:+.2%} on the same "
                f"held-out documents (the intervals {'overlap' if overlap else 'do not overlap'})"
            )
        rows = [_row(p, "nested level") for p in r["levels"]]
        rows += [_row(p, p.tokenizer) for p in r["extra"]]
        lines += ["", render.markdown(rows), ""]
    atomic_write_text(md, "\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        v = [p.vocab for p in r["levels"]]
        b = np.array([p.bytes_per_token for p in r["levels"]])
        err = np.array(
            [[p.bytes_per_token - p.ci95[0], p.ci95[1] - p.bytes_per_token] for p in r["levels"]]
        ).T
        line = ax.errorbar(v, b, yerr=err, marker="o", capsize=3, label=r["label"])
        for p in r["extra"]:
            marker = "s" if p.tokenizer.startswith("pruned") else "^"
            ax.plot(
                [p.vocab],
                [p.bytes_per_token],
                marker=marker,
                linestyle="none",
                color=line[0].get_color(),
                markerfacecolor="none",
                markersize=9,
                label=f"{p.tokenizer} ({r['spec']})",
            )
    ax.plot(
        DEFAULT_CURVE.vocab,
        DEFAULT_CURVE.bytes_per_token,
        "k--",
        marker=".",
        label="default curve (Tao et al. 2024, SlimPajama chars/token)",
    )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("vocabulary size V")
    ax.set_ylabel("bytes per token (held-out)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.text(0.01, 0.005, command, fontsize=6, family="monospace")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save_figure(fig, png, dpi=130)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--corpus",
        action="append",
        default=[],
        help="Another corpus (path, directory or glob); repeatable.",
    )
    parser.add_argument(
        "--builtin-max-bytes",
        default="64m",
        help="Cap on the builtin corpus (default 64m: all of it).",
    )
    parser.add_argument("--max-bytes", default="64m", help="Cap on each --corpus (default 64m).")
    parser.add_argument(
        "--vocab", default="8k,16k,32k,64k,128k,262k,524k", help="Level sizes (default 8k..524k)."
    )
    parser.add_argument("--prune-from", default="262k", help="Level to prune (default 262k).")
    parser.add_argument("--prune-to", default="32k", help="Pruned size (default 32k).")
    parser.add_argument("--out", default=str(DOCS), help="Output directory (default docs/).")
    args = parser.parse_args()
    sizes = sorted(parse_size_list(args.vocab))
    prune_from, prune_to = parse_size(args.prune_from), parse_size(args.prune_to)
    command = "python sims/compression_curves.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    runs = [(BUILTIN, parse_size(args.builtin_max_bytes))]
    runs += [(c, parse_size(args.max_bytes)) for c in args.corpus]
    results = [run_corpus(spec, cap, sizes, prune_from, prune_to) for spec, cap in runs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_doc(results, command, out / "compression.png", out / "compression.md")
    print((out / "compression.md").read_text())


if __name__ == "__main__":
    main()
