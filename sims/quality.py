"""The paper's quality claims at the scale two CPU cores allow: docs/quality.md, docs/quality.png
and the data behind them (sims/data/quality.json).

    python sims/quality.py --plan     # the runs and how long what is left takes; runs nothing
    python sims/quality.py            # the study: 68 min on two idle CPU cores (its tiny runs 27)

Every figure comes from training runs (``vocabjax.train.train``) kept in ``--work``, one
directory per run. A run whose training.json exists is read, not run again; a run stopped midway
resumes from its checkpoint; so a stopped study resumes where it stopped. Progress and an ETA go
to stderr. Compiled programs are kept in ``--work``/jax-cache, so the seeds after the first of
each configuration load theirs (a small run at 16k: 4-10% shorter, docs/benchmarks.md). Parts:

1. bits per byte against V: ``--scales`` (tiny, small) on ``--corpora`` (builtin: code,
   builtin-prose: English prose), V in ``--vocab``, ``--seeds`` seeds; every run trains on the
   same number of bytes of text (``--train-bytes`` per scale), not the same number of tokens:
   its steps are those bytes over (batch x seq-len x the level's bytes per token on the train
   part). Held-out bits per byte on the same text for every V: the held-out part's first
   ``--eval-bytes`` of text (``train --eval-bytes``), whatever the tokenizer.
2. pruned initialisation: a run at ``--prune-from`` for ``--prune-share`` of the bytes, pruned to
   ``--prune-to`` (``train --init-from``) for the rest, against part 1's run at ``--prune-to``
   (the same total bytes, the large-V pretraining counted); first scale, last corpus.
3. heads: ``--head-set`` as nested heads and as separate heads with ``--align-weight``, one run
   each per seed, against part 1's separate models at each V; every head sees at most the bytes
   a separate model sees (steps set by the largest head's bytes per token). Parameters counted.
4. training throughput: part 1's tokens/s at the smallest and largest V (512 -> 16k spans 32x,
   as 8k -> 262k does), each run's from its own training steps (the median step).
5. compression on prose: nested levels trained on ``--compression-bytes`` of the last corpus (V
   alone changes), every production tokenizer installed packages ship and each ``--tokenizer``,
   and each production rank file cut to the smaller ``--compression-vocab`` sizes (V alone, on
   the data that file was trained on).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import _common  # noqa: F401  (puts the checkout on sys.path)
from _common import ROOT, command, figure_path, write_doc

from vocabjax.corpus import open_corpus
from vocabjax.errors import UserError
from vocabjax.models import GPTConfig
from vocabjax.outputs import atomic_write_text
from vocabjax.shapes import load_shape
from vocabjax.train.run import LOOP_TIMING
from vocabjax.units import parse_size, parse_size_list

DATA = ROOT / "sims" / "data" / "quality.json"
T95 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
ASSUMED_FLOPS = 1.0e11  # FLOP/s a 2-core CPU trains at (tiny: 33k tokens/s x 3.1 MFLOP/token)
OVERHEAD_S = 10.0  # per run: compiling and evaluating (and reading the corpus, once per level)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def name(scale: str) -> str:
    """A scale's shape name (a preset's, or a shape file's), as run keys and tables show it."""
    return load_shape(scale).name


def write_json(path: Path, data: Any) -> None:
    """The study's own files: its data and what it keeps between invocations (not profiles)."""
    atomic_write_text(path, json.dumps(data, indent=1, default=str) + "\n")


def mean_ci(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): a 95% t-interval over seeds (the mean alone for one value)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, m, m
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


@dataclasses.dataclass(frozen=True)
class Job:
    """One training run of the study."""

    key: str  # its directory under --work
    scale: str  # model shape
    corpus: str
    heads: tuple[int, ...]
    seed: int
    steps: int
    heads_kind: str = "nested"
    align_weight: float = 0.0
    init_from: str | None = None  # key of the run a pruned start gathers from

    def flops(self, batch: int, seq_len: int) -> float:
        """Training FLOPs: 6 N per token, each head's windows through the backbone and its head."""
        shape = load_shape(self.scale)
        weights = len(self.heads) * shape.n_nonembedding + sum(self.heads) * shape.d_model
        return 6 * self.steps * batch * seq_len * weights


@dataclasses.dataclass
class Study:
    args: argparse.Namespace
    work: Path

    def corpus(self, spec: str):
        return open_corpus(spec, max_bytes=self.args.max_bytes)

    def tokenizer(self, spec: str) -> Path:
        """The corpus's nested tokenizer at every V of the study (one training, kept)."""
        from vocabjax.vocab import save_nested, train_nested

        out = self.work / f"tok-{spec}"
        if not (out / "manifest.json").is_file():
            say(f"training a nested BPE at {self.args.vocab} on {spec}")
            corpus = self.corpus(spec)
            nested = train_nested(corpus.texts("train"), self.args.vocab)
            save_nested(nested, out, corpus=corpus.describe("train"), source="sims/quality.py")
        return out

    def bytes_per_token(self, spec: str) -> dict[int, float]:
        """Train-part bytes per token of each level (what turns bytes into steps), kept."""
        from vocabjax.train import encode_streams, tokenizers_from_dir

        path = self.work / f"bytes-per-token-{spec}.json"
        if path.is_file():
            return {int(k): v for k, v in json.loads(path.read_text()).items()}
        heads = tokenizers_from_dir(self.tokenizer(spec), self.args.vocab)
        streams = encode_streams(heads, self.corpus(spec).texts("train"))
        out = {h.vocab: streams.bytes / len(ids) for h, ids in zip(heads, streams.ids, strict=True)}
        write_json(path, {str(k): v for k, v in out.items()})
        return out

    def steps(self, spec: str, vocab: int, nbytes: float) -> int:
        per_step = self.args.batch * self.args.seq_len * self.bytes_per_token(spec)[vocab]
        return max(1, math.ceil(nbytes / per_step))

    def jobs(self) -> dict[str, list[Job]]:
        a = self.args
        parts: dict[str, list[Job]] = {"bpb": [], "pruned": [], "heads": []}
        for scale, nbytes in zip(a.scales, a.train_bytes, strict=True):
            for spec in a.corpora:
                for v in a.vocab:
                    for seed in a.seeds:
                        steps = self.steps(spec, v, nbytes)
                        key = f"{name(scale)}-{spec}-v{v}-s{seed}"
                        parts["bpb"].append(Job(key, scale, spec, (v,), seed, steps))
        scale, spec, nbytes = a.scales[0], a.corpora[-1], a.train_bytes[0]
        for seed in a.seeds:
            src = f"{name(scale)}-{spec}-v{a.prune_from}-pretrain-s{seed}"
            share = a.prune_share * nbytes
            parts["pruned"] += [
                Job(src, scale, spec, (a.prune_from,), seed, self.steps(spec, a.prune_from, share)),
                Job(
                    f"{name(scale)}-{spec}-v{a.prune_from}-to-v{a.prune_to}-s{seed}",
                    scale,
                    spec,
                    (a.prune_to,),
                    seed,
                    self.steps(spec, a.prune_to, nbytes - share),
                    init_from=src,
                ),
            ]
            steps = self.steps(spec, a.head_set[-1], nbytes)
            heads = tuple(a.head_set)
            parts["heads"] += [
                Job(f"{name(scale)}-{spec}-nested-s{seed}", scale, spec, heads, seed, steps),
                Job(
                    f"{name(scale)}-{spec}-separate-s{seed}",
                    scale,
                    spec,
                    heads,
                    seed,
                    steps,
                    heads_kind="separate",
                    align_weight=a.align_weight,
                ),
            ]
        return parts

    def run(self, job: Job) -> dict[str, Any]:
        """The job's training.json, training it (or resuming it) first when there is none."""
        from vocabjax.train import CorpusSpec, RunConfig, resume_config, train

        out = self.work / job.key
        profile = out / "training.json"
        if not profile.is_file():
            if (out / "run.json").is_file():
                config, resume = resume_config(out, {}), True
            else:
                config = RunConfig(
                    shape=load_shape(job.scale),
                    heads=job.heads,
                    tokenizer=None if job.init_from else str(self.tokenizer(job.corpus)),
                    corpus=CorpusSpec(job.corpus, max_bytes=self.args.max_bytes),
                    steps=job.steps,
                    seq_len=self.args.seq_len,
                    batch=self.args.batch,
                    lr=self.args.lr,
                    warmup=min(100, job.steps // 10),
                    seed=job.seed,
                    eval_bytes=self.args.eval_bytes,
                    checkpoint_every=self.args.checkpoint_every,
                    heads_kind=job.heads_kind,
                    align_weight=job.align_weight,
                    init_from=str(self.work / job.init_from) if job.init_from else None,
                )
                resume = False
            train(config, out, resume=resume, timing_repeats=3)
        result = json.loads(profile.read_text())
        if result.get("steps") != job.steps:
            raise UserError(
                f"{out} was trained for {result.get('steps')} steps, and this study's settings "
                f"give it {job.steps} (other --train-bytes, --batch or --seq-len): give another "
                "--work, or delete that run"
            )
        evaluated = json.loads((out / "run.json").read_text()).get("eval_bytes")
        if evaluated != self.args.eval_bytes:
            raise UserError(
                f"{out} was evaluated on {evaluated or 'a token count'} held-out bytes, and this "
                f"study evaluates every run on {self.args.eval_bytes} (--eval-bytes): give "
                "another --work, or delete that run"
            )
        return result


def run_all(study: Study, parts: dict[str, list[Job]]) -> dict[str, dict[str, Any]]:
    """Every job's training.json by key, in order, with progress and an ETA on stderr (the
    assumed rate corrected by the pace of the runs trained so far). Each run's wall seconds are
    kept in ``--work``/seconds.json."""
    a = study.args
    seconds_path = study.work / SECONDS
    seconds = recorded_seconds(study.work)
    jobs = [j for part in parts.values() for j in part]
    todo = {j.key: guess(j, a) for j in jobs if not trained(study.work, j)}
    left, spent, guessed = sum(todo.values()), 0.0, 0.0
    results = {}
    for i, job in enumerate(jobs, 1):
        t0 = time.perf_counter()
        results[job.key] = study.run(job)
        if job.key in todo:
            took = time.perf_counter() - t0
            seconds[job.key] = round(took, 1)
            write_json(seconds_path, seconds)
            spent, guessed, left = spent + took, guessed + todo[job.key], left - todo[job.key]
            what = f"trained in {took:.0f} s"
        else:
            what = "read"
        say(
            f"[{i}/{len(jobs)}] {job.key}: {job.steps} steps {what}; elapsed {spent / 60:.1f} min, "
            f"eta {left * (spent / guessed if guessed else 1.0) / 60:.1f} min"
        )
    return results


SECONDS = "seconds.json"  # in --work: each run's wall seconds, by key


def recorded_seconds(work: Path) -> dict[str, float]:
    """The wall seconds ``--work`` keeps per run (``SECONDS``), empty when there are none."""
    path = work / SECONDS
    return json.loads(path.read_text()) if path.is_file() else {}


def trained(work: Path, job: Job) -> bool:
    """Whether ``job``'s run has finished in ``work`` (its training.json is written last)."""
    return (work / job.key / "training.json").is_file()


def guess(job: Job, args) -> float:
    """A run's seconds at the assumed rate (``ASSUMED_FLOPS``, ``OVERHEAD_S``)."""
    return job.flops(args.batch, args.seq_len) / ASSUMED_FLOPS + OVERHEAD_S


def estimate(study: Study, parts: dict[str, list[Job]]) -> tuple[float, str]:
    """Seconds the runs not yet done should take, and how that was reckoned: the assumed rate,
    corrected per scale by the runs of that scale already trained in ``--work`` (their wall
    seconds in seconds.json over what the assumed rate gave them; a scale with none takes
    the correction of every run trained, or none)."""
    a = study.args
    seconds = recorded_seconds(study.work)
    jobs = [j for part in parts.values() for j in part]
    done = [j for j in jobs if j.key in seconds and trained(study.work, j)]
    todo = [j for j in jobs if not trained(study.work, j)]

    def factor(runs: list[Job]) -> float | None:
        guessed = sum(guess(j, a) for j in runs)
        return sum(seconds[j.key] for j in runs) / guessed if runs else None

    overall = factor(done) or 1.0
    scales = {j.scale for j in todo}
    per_scale = {s: factor([j for j in done if j.scale == s]) or overall for s in scales}
    left = sum(guess(j, a) * per_scale[j.scale] for j in todo)
    if not todo:
        how = "every run is trained"
    elif not done:
        how = f"at {ASSUMED_FLOPS / 1e9:.0f} GFLOP/s and {OVERHEAD_S:.0f} s a run"
    else:
        rates = ", ".join(f"{name(s)} x{per_scale[s]:.2f}" for s in sorted(scales))
        how = (
            f"at {ASSUMED_FLOPS / 1e9:.0f} GFLOP/s and {OVERHEAD_S:.0f} s a run, scaled by the "
            f"wall time of the {len(done)} runs trained here ({rates})"
        )
    return left, how


def run_seconds(work: Path, keys: Iterable[str]) -> float:
    """Wall seconds of the runs ``keys`` of the study, over all its invocations (a run
    ``--work`` holds for another study's settings is not counted)."""
    seconds = recorded_seconds(work)
    return sum(seconds.get(k, 0.0) for k in keys)


# ---- the report -------------------------------------------------------------------------------


def head(result: dict[str, Any], vocab: int) -> dict[str, Any]:
    return next(p for p in result["points"] if p["vocab"] == vocab)


def bpb_table(a, parts, results) -> tuple[list[str], list[dict[str, Any]]]:
    lines = [
        "| scale | corpus | V | bpb (mean over seeds) | 95% interval | tokens/s | bytes/token | steps |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    rows = []
    for scale in a.scales:
        for spec in a.corpora:
            for v in a.vocab:
                jobs = [
                    j for j in parts["bpb"] if (j.scale, j.corpus, j.heads) == (scale, spec, (v,))
                ]
                points = [head(results[j.key], v) for j in jobs]
                m, lo, hi = mean_ci([p["bpb"] for p in points])
                tps = statistics.median(p["tokens_per_s"] for p in points)
                bpt = statistics.fmean(p["bytes_per_token"] for p in points)
                rows.append(
                    dict(
                        scale=scale,
                        corpus=spec,
                        vocab=v,
                        bpb=m,
                        lo=lo,
                        hi=hi,
                        tokens_per_s=tps,
                        tokens_per_s_seeds=[p["tokens_per_s"] for p in points],
                        seeds=[p["bpb"] for p in points],
                    )
                )
                lines.append(
                    f"| {name(scale)} | {spec} | {v} | {m:.4f} | {lo:.4f}-{hi:.4f} | {tps:,.0f} | "
                    f"{bpt:.3f} | {jobs[0].steps} |"
                )
    return lines, rows


def timing_of(results, jobs: Sequence[Job]) -> str:
    """How the runs ``jobs`` measured their tokens/s (training.json's ``tokens_per_s_from``),
    the runs timed by their own loop summed up by their range of steps, other ways listed (a
    run trained before the loop was timed says a timing pass)."""
    loop, other = [], set()
    for j in jobs:
        how = results[j.key].get("tokens_per_s_from") or "a timing pass"
        found = re.fullmatch(re.escape(LOOP_TIMING).replace(re.escape("{}"), r"(\d+)"), how)
        if found:
            loop.append(int(found[1]))
        else:
            other.add(how)
    ways = sorted(other)
    if loop:
        ways.insert(
            0,
            f"its own training steps: the median step of {min(loop)}-{max(loop)} a run, the "
            "compiling first left out",
        )
    return "; ".join(ways)


def corpus_rows(a, parts, results) -> list[dict[str, Any]]:
    """Per corpus: the digests (``train``'s ``corpus_digest``) of the text its runs trained and
    were evaluated on. One held-out digest per corpus: every run was scored on one text; two
    studies with other digests read other text (another machine's packages, another cap)."""
    out = []
    for spec in a.corpora:
        jobs = [j for part in parts.values() for j in part if j.corpus == spec]
        digests = [results[j.key].get("corpus_digest") or {} for j in jobs]
        out.append(
            dict(
                corpus=spec,
                runs=len(jobs),
                train=sorted({d.get("train", "not recorded") for d in digests}),
                heldout=sorted({d.get("heldout", "not recorded") for d in digests}),
            )
        )
    return out


def corpus_lines(corpora: list[dict[str, Any]]) -> list[str]:
    lines = []
    for c in corpora:
        one = len(c["heldout"]) == 1
        lines.append(
            f"- {c['corpus']}: {c['runs']} runs; held-out text {', '.join(c['heldout'])}"
            + (" (one text for every run)" if one else " (the runs were scored on different text)")
            + f"; train part {', '.join(c['train'])}"
        )
    return lines


def spread_rows(a, rows) -> list[dict[str, Any]]:
    """Per scale and corpus: the best V and the spread (max - min) / min of bpb over V, the
    spread computed per seed and summarized over seeds."""
    out = []
    for scale in a.scales:
        for spec in a.corpora:
            sel = [r for r in rows if (r["scale"], r["corpus"]) == (scale, spec)]
            best = min(sel, key=lambda r: r["bpb"])
            per_seed = [
                (max(s) - min(s)) / min(s) * 100
                for s in zip(*(r["seeds"] for r in sel), strict=True)
            ]
            out.append(dict(scale=scale, corpus=spec, best=best["vocab"], spread=mean_ci(per_seed)))
    return out


def pruned_rows(a, parts, results) -> list[float]:
    """Per seed: (pruned - direct) / direct bpb at --prune-to, in percent."""
    scale, spec = a.scales[0], a.corpora[-1]
    out = []
    for seed in a.seeds:
        pruned = results[f"{name(scale)}-{spec}-v{a.prune_from}-to-v{a.prune_to}-s{seed}"]
        direct = results[f"{name(scale)}-{spec}-v{a.prune_to}-s{seed}"]
        p, d = head(pruned, a.prune_to)["bpb"], head(direct, a.prune_to)["bpb"]
        out.append((p - d) / d * 100)
    return out


def heads_rows(a, results) -> list[dict[str, Any]]:
    """Per head and kind: (shared - separate model) / separate model bpb over seeds, percent."""
    scale, spec = a.scales[0], a.corpora[-1]
    out = []
    for kind in ("nested", "separate"):
        for v in a.head_set:
            diffs = []
            for seed in a.seeds:
                shared = head(results[f"{name(scale)}-{spec}-{kind}-s{seed}"], v)["bpb"]
                alone = head(results[f"{name(scale)}-{spec}-v{v}-s{seed}"], v)["bpb"]
                diffs.append((shared - alone) / alone * 100)
            out.append(dict(kind=kind, vocab=v, diff=mean_ci(diffs)))
    return out


def parameter_saving(a) -> dict[str, float]:
    """1 - (parameters of one shared model) / (parameters of one model per head)."""
    shape = load_shape(a.scales[0])
    heads = tuple(a.head_set)
    alone = sum(GPTConfig(shape, max_vocab=v, max_seq=a.seq_len).n_params() for v in heads)
    nested = GPTConfig(shape, max_vocab=heads[-1], max_seq=a.seq_len).n_params()
    separate = GPTConfig(
        shape, max_vocab=heads[-1], max_seq=a.seq_len, heads_kind="separate", heads=heads
    ).n_params()
    return {"nested": 1 - nested / alone, "separate": 1 - separate / alone}


REPEATABLE = 1.25  # seeds of one V within this ratio of tokens/s: the machine was quiet enough


def throughput_rows(a, rows) -> list[dict[str, Any]]:
    out = []
    for scale in a.scales:
        for spec in a.corpora:
            sel = {r["vocab"]: r for r in rows if (r["scale"], r["corpus"]) == (scale, spec)}
            lo, hi = min(sel), max(sel)
            # how far the seeds of one V disagree on tokens/s: a machine loaded by other work
            # shows here, and a ratio between two V is no better than this
            repeat = max(
                max(sel[v]["tokens_per_s_seeds"]) / min(sel[v]["tokens_per_s_seeds"])
                for v in (lo, hi)
            )
            ratio = sel[lo]["tokens_per_s"] / sel[hi]["tokens_per_s"]
            out.append(dict(scale=scale, corpus=spec, lo=lo, hi=hi, ratio=ratio, repeat=repeat))
    return out


def compression(a, work: Path) -> dict[str, Any]:
    """Bytes per token on the last corpus's held-out part: nested levels trained on its train
    part (V alone changes), the production tokenizers found and given, and each production rank
    file cut to the smaller study levels (V alone again, on the data that file was trained on)."""
    from vocabjax.vocab import LoadedTokenizer, measure, train_nested
    from vocabjax.vocab.bpe import from_json

    spec = a.corpora[-1]
    shipped = shipped_tokenizers()
    # kept in --work for the settings it was measured with; other settings measure again
    key = {
        "corpus": spec,
        "bytes": a.compression_bytes,
        "vocab": list(a.compression_vocab),
        "tokenizers": [str(t) for t in a.tokenizer],
        "shipped": [str(t) for t in shipped],
    }
    path = work / "compression.json"
    if path.is_file():
        kept = json.loads(path.read_text())
        if kept.get("key") == key:
            return kept
    corpus = open_corpus(spec, max_bytes=a.compression_bytes)
    say(f"compression: nested levels {a.compression_vocab} on {corpus.describe('train')}")
    nested = train_nested(corpus.texts("train"), a.compression_vocab, stop_short=True)
    tokenizers = [
        LoadedTokenizer(from_json(nested.level(v), where=f"level {v}"), f"nested {v}", "hf")
        for v in nested.vocab_sizes
    ]
    heldout = list(corpus.texts("heldout"))
    say(f"compression: measuring {len(tokenizers)} nested levels")
    points = measure(tokenizers, heldout)
    production, aliases, skipped, more = production_points(a, shipped, heldout)
    out = {
        "key": key,
        "corpus": corpus.describe("heldout"),
        "reached": list(nested.vocab_sizes),
        "points": [
            {**p.to_json(), "tokenizer": short(p.tokenizer)}
            for p in sorted(points + more, key=lambda p: p.vocab)
        ],
        "production": [short(t.path) for t in production],
        "aliases": aliases,
        "skipped": skipped,
    }
    write_json(path, out)
    return out


def production_points(a, shipped: list[Path], heldout: list[str]):
    """The production tokenizers (shipped, then ``--tokenizer``) measured on ``heldout``, each
    rank file also cut to the smaller ``--compression-vocab`` sizes: (the tokenizers, the
    aliases, the shipped files skipped, the points). Files that count every document alike at
    one size are one tokenizer released twice (Mistral's instruct models re-ship one
    SentencePiece model): measured once, the others named as its aliases."""
    from vocabjax.vocab import cut_ranks, load_tokenizer, measure

    production, skipped = [], []
    for file in [*shipped, *map(Path, a.tokenizer)]:
        try:
            production.append(load_tokenizer(file))
        except UserError as exc:
            if file not in shipped:
                raise
            skipped.append(f"{short(file)}: {exc}")  # a shipped file this machine cannot read
    if not production:
        return production, {}, skipped, []
    say(f"compression: measuring {len(production)} production tokenizers")
    points = {p.tokenizer: p for p in measure(production, heldout)}
    same: dict[tuple[int, int, str], list[str]] = {}
    for t in production:
        same.setdefault((points[t.path].vocab, points[t.path].tokens, t.kind), []).append(t.path)
    firsts = {paths[0] for paths in same.values()}
    unique = [t for t in production if t.path in firsts]
    aliases = {short(v[0]): [short(x) for x in v[1:]] for v in same.values() if len(v) > 1}
    cuts = [
        cut_ranks(t, v)
        for t in unique
        for v in a.compression_vocab
        if v < t.vocab and t.can_cut_to(v)
    ]
    kept = [points[t.path] for t in unique]
    if cuts:
        say(f"compression: measuring {len(cuts)} cuts of the rank files")
        kept += measure(cuts, heldout)
    return production, aliases, skipped, kept


PAPER_CUT = 0.20  # the paper's fewer tokens from 32k to 262k: three doublings of V


def series_of(tokenizer: str) -> str:
    """Which same-data series a compression point belongs to: the nested levels, or a rank file
    with its cuts."""
    return "nested levels" if tokenizer.startswith("nested ") else tokenizer.split(" cut to ")[0]


def by_series(comp: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The compression points per same-data series (see ``series_of``), each by V."""
    series: dict[str, list[dict[str, Any]]] = {}
    for p in sorted(comp["points"], key=lambda p: p["vocab"]):
        series.setdefault(series_of(p["tokenizer"]), []).append(p)
    return series


def v_alone(comp: dict[str, Any]) -> list[dict[str, Any]]:
    """Per same-data series of two or more sizes: the share of tokens saved from 32k (or its
    smallest size) to its largest, beside the paper's 20% over 32k -> 262k taken at an even
    rate per doubling over the same span (more, if returns diminish with V)."""
    out = []
    for name_, points in by_series(comp).items():
        if len(points) < 2:
            continue
        first = next((p for p in points[:-1] if p["vocab"] == 32768), points[0])
        last = points[-1]
        out.append(
            {
                "series": name_,
                "lo": first["vocab"],
                "hi": last["vocab"],
                "cut": 1 - first["bytes_per_token"] / last["bytes_per_token"],
                "paper": 1 - (1 - PAPER_CUT) ** (math.log2(last["vocab"] / first["vocab"]) / 3),
            }
        )
    return out


def families_at(comp: dict[str, Any], vocab: int = 32768) -> list[dict[str, Any]]:
    """The compression points within 10% of ``vocab`` ids: tokenizers of about one size that
    differ in training corpus, pre-tokenizer or algorithm."""
    return sorted(
        (p for p in comp["points"] if abs(p["vocab"] / vocab - 1) <= 0.1),
        key=lambda p: p["bytes_per_token"],
    )


def short(path: str | Path) -> str:
    """A tokenizer file as the report names it: its package folder and name, and any cut."""
    text = str(path)
    if text.startswith("nested "):
        return text
    file, _, cut = text.partition(" cut to ")
    name = "/".join(Path(file).parts[-3:])
    return f"{name} cut to {cut}" if cut else name


def shipped_tokenizers() -> list[Path]:
    """Tokenizer files installed packages ship: tiktoken rank files, tokenizer.json, Tekken files
    and SentencePiece models (``pip install mistral-common`` ships both of Mistral's kinds)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["purelib"])
    patterns = ("**/*.tiktoken", "**/tokenizer.json", "**/tekken*.json", "**/*tokenizer*.model*")
    found = sorted({p for pattern in patterns for p in root.glob(pattern) if p.is_file()})
    return [p for p in found if "test" not in p.parts and "tests" not in p.parts]


def verdict(agrees: bool | None, criterion: str) -> str:
    """The verdict word, then the rule it was reached by."""
    word = {True: "agrees", False: "disagrees", None: "inconclusive at this scale"}[agrees]
    return f"{word} (rule: {criterion})"


def report(a, parts, results, comp, seconds: float) -> tuple[str, dict[str, Any]]:
    """docs/quality.md's text and sims/data/quality.json's content from the finished runs."""
    table, rows = bpb_table(a, parts, results)
    spreads = spread_rows(a, rows)
    pruned = mean_ci(pruned_rows(a, parts, results))
    heads = heads_rows(a, results)
    saving = parameter_saving(a)
    speeds = throughput_rows(a, rows)
    claims = claim_rows(a, spreads, pruned, heads, saving, speeds, comp)
    corpora = corpus_rows(a, parts, results)
    body = report_body(a, parts, results, comp, seconds, claims, table, heads, saving, corpora)
    data = {
        "schema": 1,
        "kind": "quality_study",
        "command": command(),
        "seconds": round(seconds, 1),
        "settings": {k: v for k, v in vars(a).items() if k not in ("plan",)},
        "bpb": rows,
        "spread": spreads,
        "pruned_pct": pruned_rows(a, parts, results),
        "heads": heads,
        "parameter_saving": saving,
        "throughput": speeds,
        "corpora": corpora,
        "claims": claims,  # docs/quality.md's claim table, row by row (paper_claims.py reads it)
        "compression": comp,
        "runs": results,
    }
    return "\n".join(body), data


def claim_rows(a, spreads, pruned, heads, saving, speeds, comp) -> list[str]:
    """One table row per claim: the measured figure, its interval over seeds and a verdict."""
    scale0, spec_last = name(a.scales[0]), a.corpora[-1]
    claims = ["| claim | measured | 95% interval over seeds | verdict |", "|---|---|---|---|"]
    for s in spreads:
        m, lo, hi = s["spread"]
        ok = True if hi < 2 else False if lo > 2 else None
        claims.append(
            f"| (1) bpb spread < 2% over V, {name(s['scale'])} on {s['corpus']} | {m:.2f}% (best V "
            f"{s['best']}) | {lo:.2f}-{hi:.2f}% | {verdict(ok, 'agrees if the interval lies below 2%, disagrees if above; paper best V: 16k at 100M')} |"
        )
    m, lo, hi = pruned
    ok = True if hi < 0 else False if lo > 0 else None
    claims.append(
        f"| (2) pruning {a.prune_from} -> {a.prune_to} beats training at {a.prune_to} "
        f"(~5% bpb), {scale0} on {spec_last} | {m:+.2f}% bpb | {lo:+.2f} to {hi:+.2f}% | "
        f"{verdict(ok, 'negative is better: agrees if the interval lies below 0, disagrees if above')} |"
    )
    for h in heads:
        m, lo, hi = h["diff"]
        ok = True if lo >= -2 and hi <= 2 else False if hi < -2 or lo > 2 else None
        claims.append(
            f"| (3) {h['kind']} heads serve like separate models, head {h['vocab']} "
            f"({saving[h['kind']]:.0%} fewer parameters; paper ~30%) | {m:+.2f}% bpb | "
            f"{lo:+.2f} to {hi:+.2f}% | {verdict(ok, 'agrees if the interval lies within +-2% of a separate model, disagrees if outside')} |"
        )
    for s in speeds:
        ok = abs(s["ratio"] / 2.4 - 1) <= 0.15 if s["repeat"] <= REPEATABLE else None
        claims.append(
            f"| (4) training throughput falls 2.4x over a 32x V span, {name(s['scale'])} on "
            f"{s['corpus']} | "
            f"{s['ratio']:.2f}x ({s['lo']} -> {s['hi']}) | median over seeds; seeds of one V "
            f"differ up to {s['repeat']:.2f}x | "
            f"{verdict(ok, f'within 15% of 2.4 when the seeds of each end V agree within {REPEATABLE:g}x (a quiet machine); the head is a larger share of a small model')} |"
        )
    for v in (v for v in v_alone(comp) if v["hi"] >= 2 * v["lo"]):
        rule = (
            "within 5 points of the paper's 20% over 32k -> 262k taken evenly per doubling: "
            f"{v['paper']:.1%} over {v['lo']} -> {v['hi']}"
        )
        claims.append(
            f"| sequence length ~20% shorter from 32k to 262k (same data, V alone: {v['series']} "
            f"{v['lo']} -> {v['hi']}) | {v['cut']:.1%} fewer tokens | over documents: see "
            f"compression table | {verdict(abs(v['cut'] - v['paper']) <= 0.05, rule)} |"
        )
    return claims


def report_body(
    a, parts, results, comp, seconds, claims, table, heads, saving, corpora
) -> list[str]:
    """The sections of docs/quality.md: the settings, the claims and each part's table. Most of
    its length is the documents' prose, kept in one place so it reads in order."""
    n = len(a.seeds)
    scale0, spec_last = name(a.scales[0]), a.corpora[-1]
    body = [
        f"Study time: {run_seconds(a.work, results) / 60:.1f} min of training runs in all "
        f"({len(results)} runs, over every invocation; this one took {seconds / 60:.1f} min). "
        "Every run: "
        f"batch {a.batch} x seq-len {a.seq_len} per head, lr {a.lr}, {n} seeds "
        f"({', '.join(map(str, a.seeds))}), corpora capped at {a.max_bytes / 2**20:.3g} MiB "
        "before the 90/10 split by document hash. **Equal training bytes, not equal tokens**: "
        + ", ".join(
            f"{name(s)} trains on {b / 2**20:.3g} MiB" for s, b in zip(a.scales, a.train_bytes)
        )
        + " of text per run, so a larger V takes fewer steps. Scale caveat: the paper's models have "
        "100M-2.3B parameters trained to convergence; these are "
        + ", ".join(
            f"{name(s)} ({load_shape(s).n_nonembedding / 1e6:.2f}M non-embedding)" for s in a.scales
        )
        + " trained for minutes, so a verdict says whether the trend shows here, not whether the "
        "paper's figure holds at its scale.",
        "",
        "## The claims",
        "",
        *claims,
        "",
        "## Bits per byte against V",
        "",
        f"Held-out bits per byte (the held-out part's first {a.eval_bytes / 1024:g} KiB of text, "
        "the same text for every V and every run of a corpus; mean over seeds with its 95% "
        "t-interval), training tokens/s (median over seeds; each run's from "
        f"{timing_of(results, parts['bpb'])}) and train-part bytes per token. "
        "Figure: [quality.png](quality.png).",
        "",
        *table,
        "",
        "Which text, as BLAKE2b-128 digests of the documents each run read (`train`'s "
        "`corpus_digest`; the builtin corpora are made from what this machine has installed, so "
        "another machine's differ):",
        "",
        *corpus_lines(corpora),
        "",
        "## Pruned initialisation",
        "",
        f"{scale0} on {spec_last}: a run at V = {a.prune_from} for {a.prune_share:.0%} of the "
        f"bytes, its tokenizer pruned to {a.prune_to} by use on the train part, its embedding and "
        f"head rows gathered (`train --init-from --prune-to`) and trained for the rest, against "
        f"training at {a.prune_to} from the start on the same total bytes. Per seed: "
        + ", ".join(f"{d:+.2f}%" for d in pruned_rows(a, parts, results))
        + " (pruned minus direct, relative).",
        "",
        "## Shared backbone, several heads",
        "",
        f"{scale0} on {spec_last}, heads {', '.join(map(str, a.head_set))} (the paper's "
        "32k/131k/262k, 1:4:8, scaled to this V range): nested prefix heads, and separate heads "
        f"with alignment weight {a.align_weight}, each trained jointly (every head's windows in "
        "every step; the steps set so that the largest head sees the bytes a separate model sees, "
        "the smaller ones fewer), against a separate model per V from part 1. Parameters: "
        f"nested {saving['nested']:.0%}, separate {saving['separate']:.0%} fewer than one model "
        "per head (embedding, heads, backbone, positions).",
        "",
        "| kind | head | bpb vs separate model | 95% interval |",
        "|---|---:|---:|---|",
        *[
            f"| {h['kind']} | {h['vocab']} | {h['diff'][0]:+.2f}% | {h['diff'][1]:+.2f} to "
            f"{h['diff'][2]:+.2f}% |"
            for h in heads
        ],
        "",
        "## Compression: what V alone buys, and what a production tokenizer does",
        "",
        f"Bytes per token on {comp['corpus']}, with a 95% interval over documents. Nested levels "
        f"reached: {', '.join(map(str, comp['reached']))} (same data and pre-tokenizer: what V "
        "alone buys). Production tokenizers measured: "
        + (
            ", ".join(comp["production"])
            or "none found in the installed packages (give "
            "`--tokenizer FILE`, a rank file or tokenizer.json a package ships)"
        )
        + ": those differ in training corpus and pre-tokenizer too. A rank file's ranks are in "
        "the order its training made them, so a rank file *cut to* N keeps its specials and its "
        "first ranks: the tokenizer the same training would have made at N, which measures what "
        "V alone buys on the data that tokenizer was trained on. Where they come from: "
        "`pip install mistral-common` ships Mistral's SentencePiece models and Tekken files "
        "(SentencePiece models are read with the sentencepiece package it installs); "
        "`pip download openai-whisper --no-deps` fetches Whisper's source, whose "
        "whisper/assets/ holds GPT-2's and Whisper's rank files (give them with `--tokenizer`). "
        "Figure: the last panel of [quality.png](quality.png).",
        "",
        *compression_reading(comp),
        "",
        "| tokenizer | vocab | bytes/token | 95% interval |",
        "|---|---:|---:|---|",
        *[
            f"| {p['tokenizer']} | {p['vocab']} | {p['bytes_per_token']:.3f} | "
            f"{p['ci95'][0]:.3f}-{p['ci95'][1]:.3f} |"
            for p in comp["points"]
        ],
    ]
    return body


def compression_reading(comp: dict[str, Any]) -> list[str]:
    """What V alone buys against what the family buys, in figures from the table."""
    lines = [
        f"- V alone, {v['series']}: {v['cut']:.1%} fewer tokens from {v['lo']} to {v['hi']} "
        f"(the paper's rate would give {v['paper']:.1%} over that span)"
        for v in v_alone(comp)
    ]
    for first, others in comp.get("aliases", {}).items():
        lines.append(f"- {', '.join(others)}: the same counts as {first} on every document")
    near = families_at(comp)
    if len(near) >= 2:
        lo, hi = near[0], near[-1]
        lines.append(
            f"- The family at about 32k ids ({len(near)} tokenizers of "
            f"{min(p['vocab'] for p in near)}-{max(p['vocab'] for p in near)} ids): "
            f"{lo['bytes_per_token']:.3f} ({lo['tokenizer']}) to {hi['bytes_per_token']:.3f} "
            f"({hi['tokenizer']}) bytes per token, "
            f"{1 - lo['bytes_per_token'] / hi['bytes_per_token']:.1%} fewer tokens for the best "
            "at the same size: what a training corpus and pre-tokenizer buy without V (the "
            "nested levels are trained on this corpus's own train part)."
        )
    for skipped in comp.get("skipped", []):
        lines.append(f"- not measured: {skipped}")
    return lines


def plot(a, rows, comp, path: Path) -> None:
    """One panel of bpb against V per scale, and one of bytes per token against V: each
    same-data series as a line, a tokenizer without cuts as a point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vocabjax.outputs import save_figure

    n = len(a.scales) + 1
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
    for ax, scale in zip(axes[0], a.scales, strict=False):
        for spec in a.corpora:
            sel = [r for r in rows if (r["scale"], r["corpus"]) == (scale, spec)]
            x = [r["vocab"] for r in sel]
            y = [r["bpb"] for r in sel]
            err = [[r["bpb"] - r["lo"] for r in sel], [r["hi"] - r["bpb"] for r in sel]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=spec)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("vocabulary size V")
        ax.set_ylabel("held-out bits per byte")
        ax.set_title(f"{name(scale)}: bpb against V (95% over seeds)")
        ax.legend()
    ax = axes[0][-1]
    for label, points in by_series(comp).items():
        style = "o-" if len(points) > 1 else "s"
        ax.plot([p["vocab"] for p in points], [p["bytes_per_token"] for p in points], style,
                label=label, markersize=4)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("vocabulary size V (ids, specials included)")
    ax.set_ylabel("held-out bytes per token")
    ax.set_title(f"compression on {a.corpora[-1]}")
    ax.legend(fontsize=6)
    fig.text(0.01, -0.02, command(), fontsize=7)
    save_figure(fig, path)
    plt.close(fig)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    size = lambda what: lambda t: parse_size(t, what=what)  # noqa: E731
    sizes = lambda what: lambda t: parse_size_list(t, what=what)  # noqa: E731
    p.add_argument("--plan", action="store_true", help="list the runs and the time they take")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "quality", help="run directories")
    p.add_argument("--scales", default="tiny,small", help="model shapes (names or files)")
    p.add_argument("--corpora", default="builtin,builtin-prose", help="corpora (last: prose)")
    p.add_argument("--vocab", type=sizes("vocab"), default="512,1k,2k,4k,8k,16k")
    p.add_argument("--seeds", type=int, default=3, help="seeds per point (0..N-1)")
    p.add_argument(
        "--train-bytes",
        type=sizes("train bytes"),
        default="768k,384k",
        help="text each run trains on, per scale",
    )
    p.add_argument("--max-bytes", type=size("max bytes"), default="8m", help="corpus cap")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--eval-bytes",
        type=size("eval bytes"),
        default="64k",
        help="held-out text every run is evaluated on (the same text at every V)",
    )
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument("--prune-from", type=size("prune from"), default="16k")
    p.add_argument("--prune-to", type=size("prune to"), default="2k")
    p.add_argument("--prune-share", type=float, default=0.5, help="bytes at --prune-from")
    p.add_argument("--head-set", type=sizes("head set"), default="2k,8k,16k")
    p.add_argument("--align-weight", type=float, default=0.1)
    p.add_argument("--compression-bytes", type=size("compression bytes"), default="32m")
    p.add_argument(
        "--compression-vocab", type=sizes("compression vocab"), default="8k,16k,32k,64k,128k,256k"
    )
    p.add_argument("--tokenizer", action="append", default=[], help="a production tokenizer")
    p.add_argument("--doc", default="quality.md", help="docs/ file to write")
    p.add_argument("--figure", type=Path, default=None, help="figure (default docs/quality.png)")
    p.add_argument("--data", type=Path, default=DATA, help="the study's data as JSON")
    a = p.parse_args(argv)
    a.scales = a.scales.split(",")
    a.corpora = a.corpora.split(",")
    a.vocab = sorted(a.vocab)
    a.seeds = list(range(a.seeds))
    if len(a.train_bytes) == 1:
        a.train_bytes = a.train_bytes * len(a.scales)
    for name in ("prune_from", "prune_to"):
        if getattr(a, name) not in a.vocab:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)} must be one of --vocab")
    if not set(a.head_set) <= set(a.vocab) or len(a.train_bytes) != len(a.scales):
        p.error("--head-set must be sizes of --vocab, --train-bytes one size or one per scale")
    return a


def use_compile_cache(work: Path) -> None:
    """Keep compiled programs in ``work/jax-cache`` (unless a cache is set already): the seeds
    of one configuration and a resumed study load them instead of compiling again. The
    programs are the same, so no figure changes; compiling is excluded from every timing."""
    import jax

    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(work / "jax-cache"))


def main(argv: Sequence[str] | None = None, *, doc_writer: Callable = write_doc) -> int:
    a = parse(argv)
    study = Study(a, a.work)
    a.work.mkdir(parents=True, exist_ok=True)
    use_compile_cache(a.work)
    try:
        parts = study.jobs()
        left, how = estimate(study, parts)
        n_jobs = sum(len(p) for p in parts.values())
        say(
            f"{n_jobs} runs ({', '.join(f'{k}: {len(v)}' for k, v in parts.items())}) in {a.work}; "
            f"about {left / 60:.0f} min left ({how}; a busy machine takes longer)"
        )
        if a.plan:
            for part, jobs in parts.items():
                for j in jobs:
                    print(f"{part}\t{j.key}\t{j.steps} steps\theads {','.join(map(str, j.heads))}")
            return 0
        started = time.perf_counter()
        results = run_all(study, parts)
        comp = compression(a, a.work)
        seconds = time.perf_counter() - started
    except UserError as exc:
        say(f"Error: {exc}")
        return 1
    body, data = report(a, parts, results, comp, seconds)
    figure = a.figure or figure_path("quality.png")
    plot(a, data["bpb"], comp, figure)
    write_json(a.data, data)
    doc_writer(a.doc, "The paper's quality claims on two CPU cores", body)
    say(f"done in {seconds / 60:.1f} min; wrote {figure} and {a.data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
