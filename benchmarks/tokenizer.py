"""Tokenizer benchmarks, measured side by side in one run.

1. Training: the nested set (one training at the largest V, every level cut and written) against
   training each level separately on the same text. The nested set should cost about one
   training at the largest V.
2. Measuring: throughput of ``vocab.measure`` in MiB of corpus per second, on ``--threads``
   cores (RAYON_NUM_THREADS, set before tokenizers starts its thread pool).

    python benchmarks/tokenizer.py --max-bytes 8m --vocab 8k,16k,32k --threads 2

Wall times are the best of ``--repeats`` runs; CPU seconds (all threads) are printed beside them
so that a run on a shared, loaded machine can be read.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    """Options, then each measured variant side by side in this process, then the table; one
    script read top to bottom, hence its length."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="builtin", help="Corpus (default: builtin).")
    parser.add_argument("--max-bytes", default="8m", help="Text to train on (default 8m).")
    parser.add_argument("--vocab", default="8k,16k,32k", help="Levels (default 8k,16k,32k).")
    parser.add_argument("--threads", type=int, default=2, help="Cores for tokenizers (2).")
    parser.add_argument("--measure-bytes", default="16m", help="Text to measure (default 16m).")
    parser.add_argument("--repeats", type=int, default=2, help="Runs per timing; best kept (2).")
    args = parser.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # before tokenizers' pool starts

    from vocabjax.corpus import open_corpus
    from vocabjax.units import parse_size, parse_size_list
    from vocabjax.vocab import load_tokenizers, measure, save_nested, train_nested

    sizes = sorted(parse_size_list(args.vocab))
    corpus = open_corpus(args.corpus, max_bytes=parse_size(args.max_bytes))
    texts = list(corpus.texts("train"))
    mib = sum(len(t.encode()) for t in texts) / 2**20
    print(f"corpus: {corpus.describe('train')}: {mib:.1f} MiB, {len(texts)} documents")
    print(f"levels: {sizes}; RAYON_NUM_THREADS={args.threads}; cpu_count={os.cpu_count()}")

    def timed(fn, repeats: int = args.repeats):
        """(result, best wall seconds, CPU seconds of that run) over ``repeats`` runs."""
        best = None
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            result = fn()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if best is None or wall < best[1]:
                best = (result, wall, cpu)
        return best

    with tempfile.TemporaryDirectory() as tmp:
        nested, t_train, c_train = timed(lambda: train_nested(texts, sizes))
        _, t_write, _ = timed(
            lambda: save_nested(nested, Path(tmp) / "nested", corpus=corpus.label)
        )
        t_nested = t_train + t_write
        print(
            f"nested: one training at {sizes[-1]}: {t_train:.2f} s (CPU {c_train:.2f} s) "
            f"+ cut and write {len(sizes)} levels: {t_write:.2f} s = {t_nested:.2f} s"
        )

        t_separate = {}
        identical = True
        for v in sizes:
            alone, t_alone, c_alone = timed(lambda v=v: train_nested(texts, [v]))
            _, t_w, _ = timed(
                lambda v=v, alone=alone: save_nested(alone, Path(tmp) / f"alone-{v}", corpus="")
            )
            t_separate[v] = t_alone + t_w
            identical &= alone.level(v)["model"] == nested.level(v)["model"]
            print(
                f"separate: training at {v}: {t_alone:.2f} s (CPU {c_alone:.2f} s) "
                f"+ write {t_w:.2f} s"
            )
        total = sum(t_separate.values())
        print(
            f"separate total: {total:.2f} s; ratio separate / nested = {total / t_nested:.2f}; "
            f"nested / one separate training at the largest = "
            f"{t_nested / t_separate[sizes[-1]]:.2f}"
        )
        print(f"each cut level identical to training at its size: {identical}")

        mcorpus = open_corpus(args.corpus, max_bytes=parse_size(args.measure_bytes))
        mtexts = list(mcorpus.texts("all"))
        mmib = sum(len(t.encode()) for t in mtexts) / 2**20
        levels = load_tokenizers(Path(tmp) / "nested")
        for label, toks in (
            (f"one tokenizer ({sizes[-1]})", levels[-1:]),
            (f"all {len(levels)} levels", levels),
        ):
            _, seconds, cpu = timed(lambda toks=toks: measure(toks, mtexts))
            print(
                f"measure {label}: {mmib:.1f} MiB in {seconds:.2f} s (CPU {cpu:.2f} s) = "
                f"{mmib / seconds:.2f} MiB/s of corpus, "
                f"{mmib * len(toks) / seconds:.2f} MiB/s tokenized"
            )


if __name__ == "__main__":
    main()
