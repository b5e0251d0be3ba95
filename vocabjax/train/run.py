"""A training run from start (or its last checkpoint) to a training profile.

    config = RunConfig(shape=load_shape("tiny"), heads=(1024, 2048, 4096), tokenizer=None,
                       corpus=CorpusSpec("builtin", max_bytes=2 << 20), steps=200)
    result = train(config, "runs/tiny")          # run.json, checkpoint/, training.json
    result = train(resume_config("runs/tiny", {"steps": 400}), "runs/tiny", resume=True)

The run directory holds ``run.json`` (the configuration), ``checkpoint/`` (parameters, optimizer
state, step), ``tokenizer/`` when the run trained its own, and ``training.json`` at the end.
Nothing is written before the first checkpoint, so a run that fails early leaves nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

import vocabjax
from vocabjax.corpus import Corpus, open_corpus
from vocabjax.errors import UserError
from vocabjax.outputs import atomic_write_json, check_target_dir
from vocabjax.progress import Progress
from vocabjax.train.checkpoint import load_checkpoint, restore, save_checkpoint
from vocabjax.train.config import RUN_FILE, TOKENIZER_DIR, RunConfig, read_run, write_run
from vocabjax.train.data import (
    HeadTokenizer,
    Streams,
    Windows,
    load_data,
    tokenizers_from_dir,
    tokenizers_from_nested,
)
from vocabjax.train.evaluate import heldout_bpb, throughput
from vocabjax.train.mesh import MeshSpec, Placement, to_host
from vocabjax.train.pruned import check_pruned, gather, load_source, prune_source
from vocabjax.train.steps import (
    Functional,
    Params,
    all_finite,
    init_params,
    make_train_step,
    optimizer,
)
from vocabjax.trainprofile import TrainingProfile
from vocabjax.vocab import NestedBPE, Pruned, save_nested, train_nested, write_pruned

TRAINING_FILE = "training.json"
RECENT = 20  # the reported train loss is the mean over this many last steps
LOOP_TIMING_STEPS = 10  # a one-head run timed over at least this many steps reads its own loop
LOOP_TIMING = "the training loop: median of its {} steps after the first"  # tokens_per_s_from


@dataclasses.dataclass(frozen=True)
class HeadResult:
    vocab: int
    train_loss: float | None  # mean cross-entropy (nats/token) of the last steps
    bpb: float  # held-out bits per byte
    tokens_per_s: float  # training tokens/s of a step with this head alone (``TrainResult.timing``)
    bytes_per_token: float  # held-out UTF-8 bytes per text token
    eval_tokens: int  # held-out tokens predicted
    train_tokens: int  # tokens of this head's train stream

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    config: RunConfig
    run_dir: Path
    step: int  # optimizer steps done
    heads: tuple[HeadResult, ...]  # empty when the run stopped early (``stop_after``)
    device: str
    seconds: float
    timing: str = ""  # how tokens_per_s was measured (the training loop, or a timing pass)
    corpus_digest: Mapping[str, str] = dataclasses.field(default_factory=dict)  # part -> hash

    def rows(self) -> list[dict[str, Any]]:
        return [h.row() for h in self.heads]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": 1,
            "kind": "train",
            "run": str(self.run_dir),
            "model": self.config.shape.name,
            "step": self.step,
            "device": self.device,
            "seconds": round(self.seconds, 3),
            "tokens_per_s_from": self.timing,
            "corpus_digest": dict(self.corpus_digest),
            "heads": self.rows(),
        }


def device_label(mesh: MeshSpec | None = None) -> str:
    """The device a run trained on; with a mesh, how many and how they were laid out."""
    d = jax.devices()[0]
    if d.platform == "cpu":
        label = f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    else:
        label = f"{d.platform} {d.device_kind}"
    if mesh is not None:
        label += f" x {mesh.size} (mesh {mesh})"
    return label


def _stored_run(run_dir: Path) -> RunConfig:
    """The configuration of the run ``--resume`` continues."""
    if not (run_dir / RUN_FILE).is_file():
        raise UserError(
            f"{{resume}}: {run_dir} holds no {RUN_FILE} (no run to continue)", settings=["resume"]
        )
    return read_run(run_dir)


def resume_config(run_dir: str | Path, given: Mapping[str, Any]) -> RunConfig:
    """run.json's configuration with the options given on the command line applied: those in
    ``RunConfig.MUTABLE`` replace the stored values, any other must equal it. Keys are field
    names, corpus fields as ``corpus.spec``, ``corpus.max_bytes``, ..."""
    run_dir = Path(run_dir)
    stored = _stored_run(run_dir)
    changes: dict[str, Any] = {}
    for key, value in given.items():
        if key == "prune_to":  # a pruned run's one head
            key, value = "heads", (value,)
        if key.startswith("corpus."):
            have = getattr(stored.corpus, key.removeprefix("corpus."))
        else:
            have = getattr(stored, key)
        if key in RunConfig.MUTABLE:
            changes[key] = value
            continue
        same = have == value
        if key == "tokenizer" and value is not None:
            same = stored.tokenizer_path(run_dir).resolve() == Path(value).resolve()
        if key == "heads":
            same = tuple(have) == tuple(value)
        if not same:
            show = {
                "shape": lambda x: x.name,
                "heads": lambda x: ",".join(map(str, x)),
            }.get(key, repr)
            raise UserError(
                f"{{resume}}: {{{key}}} {show(value)} differs from the run in {run_dir} "
                f"({show(have)}); drop the option or choose another {{run_dir}}",
                settings=["resume", key, "run_dir"],
            )
    return dataclasses.replace(stored, **changes)


def _check_fresh(run_dir: Path) -> None:
    check_target_dir(run_dir, what="run")
    if not run_dir.exists():
        return
    if (run_dir / RUN_FILE).exists():
        raise UserError(
            f"{run_dir} holds a training run ({RUN_FILE}); pass {{resume}} to continue it, "
            "or choose another {run_dir}",
            settings=["resume", "run_dir"],
        )
    if any(run_dir.iterdir()):
        raise UserError(
            f"{{run_dir}} {run_dir} exists and is not empty; choose another directory",
            settings=["run_dir"],
        )


def train(
    config: RunConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: Progress | None = None,
    log_every: int | None = None,
    stop_after: int | None = None,
    measure: bool = True,
    timing_repeats: int = 5,
    mesh: MeshSpec | None = None,
) -> TrainResult:
    """Train ``config`` into ``run_dir`` (or continue it with ``resume``), then measure every
    head. ``config.tokenizer=None`` trains a nested BPE at the heads' sizes first (saved to
    ``run_dir/tokenizer``). ``stop_after`` stops after that many steps, once their checkpoint
    is written, as a killed run would; it and ``measure=False`` skip the measurement (and
    training.json). A one-head run's tokens/s is its own training steps' (``_Session.measure``);
    a run of several heads times ``timing_repeats`` steps of each head alone. ``mesh`` trains
    on several devices (``vocabjax.train.mesh``); the run is the same run whatever the mesh,
    so a resumed run may change it."""
    log = progress or (lambda _msg: None)
    started = time.perf_counter()
    run_dir = Path(run_dir)
    placement = None
    if mesh is not None:
        mesh.check(batch=config.batch, tables=_tables(config), devices=len(jax.devices()))
    if resume:
        _check_resume(config, run_dir, log)
    else:
        _check_fresh(run_dir)
    if mesh is not None:
        placement = Placement(mesh.make(), frozenset(name for name, _ in _table_params(config)))
        log(f"mesh {mesh} over {mesh.size} of {len(jax.devices())} devices")
    session = _Session.prepare(config, run_dir, resume=resume, log=log, placement=placement)
    end = config.steps if stop_after is None else min(config.steps, stop_after)
    session.fit(end, every=log_every or max(1, config.steps // 10))
    config = session.config
    if end < config.steps or not measure:
        if end < config.steps:
            log(f"stopped after step {end}; resume the run to continue")
        seconds = time.perf_counter() - started
        return TrainResult(config, run_dir, end, (), device_label(mesh), seconds)
    log("measuring held-out bits per byte and tokens/s per head")
    heads, timing = session.measure(timing_repeats)
    seconds = time.perf_counter() - started
    result = TrainResult(
        config, run_dir, end, heads, device_label(mesh), seconds, timing, session.digests
    )
    if jax.process_index() == 0:
        write_profile(result, session.corpus.describe("heldout"))
    log(f"wrote {run_dir / TRAINING_FILE}")
    return result


def _table_params(config: RunConfig) -> list[tuple[str, int]]:
    """The parameters whose rows are token ids, with their row counts."""
    tables = [("embed.value", config.max_vocab)]
    if config.heads_kind == "separate":
        tables += [(f"heads.{j}.value", v) for j, v in enumerate(config.heads)]
    elif not config.tie_embeddings:
        tables.append(("unembed.value", config.max_vocab))
    return tables


def _tables(config: RunConfig) -> list[tuple[str, int]]:
    """The token tables a mesh's ``model`` axis splits, named for messages."""
    return [
        ("the embedding" if name == "embed.value" else f"head {rows}", rows)
        for name, rows in _table_params(config)
    ]


def _check_resume(config: RunConfig, run_dir: Path, log: Progress) -> None:
    stored = _stored_run(run_dir)
    check_target_dir(run_dir, what="run")
    diffs = stored.differences(config)
    if diffs:
        raise UserError(
            f"{{resume}}: the configuration differs from {run_dir}: {diffs[0]}",
            settings=["resume"],
        )
    if stored.steps != config.steps:
        log(
            f"note: the learning rate now decays over {config.steps} steps (the run had "
            f"{stored.steps}); the result differs from a straight {config.steps}-step run"
        )


@dataclasses.dataclass
class _Session:
    """A run's data, model and optimizer state between the checks and the measurement."""

    config: RunConfig
    run_dir: Path
    log: Progress
    corpus: Corpus
    nested: NestedBPE | None  # a tokenizer trained by this run, saved with the first checkpoint
    pruned: tuple[Pruned, dict[str, Any]] | None  # a tokenizer this run pruned (and its map)
    heads: list[HeadTokenizer]
    windows: list[Windows]
    heldout: Streams
    train_tokens: list[int]
    digests: dict[str, str]  # the train and held-out parts' text, hashed (``Streams.digest``)
    fn: Functional
    tx: optax.GradientTransformation
    params: Params
    opt_state: Any
    step: int = 0  # optimizer steps done
    recent: list[list[float]] = dataclasses.field(default_factory=list)  # last losses per head
    step_seconds: list[float] = dataclasses.field(default_factory=list)  # this session's steps
    placement: Placement | None = None  # the mesh the run's arrays are laid out on (None: one)
    written: bool = False  # run_dir holds run.json (and the tokenizer)
    saved: int | None = None  # step of the last checkpoint on disk

    @classmethod
    def prepare(
        cls,
        config: RunConfig,
        run_dir: Path,
        *,
        resume: bool,
        log: Progress,
        placement: Placement | None = None,
    ):
        c = config.corpus
        corpus = open_corpus(c.spec, field=c.field, held_out=c.held_out, max_bytes=c.max_bytes)
        # A resumed run holds its parameters: only a fresh pruned start reads its source.
        fresh = not resume or load_checkpoint(run_dir) is None
        source = load_source(config) if config.init_from is not None and fresh else None
        config, heads, nested, pruned, new_to_old = _tokenizers(config, corpus, source, run_dir,
                                                                log)  # fmt: skip
        log(f"corpus: {corpus.label}")
        windows, train_streams, heldout = load_data(
            corpus,
            heads,
            seq_len=config.seq_len,
            batch=config.batch,
            seed=config.seed,
            eval_tokens=config.eval_tokens,
            eval_bytes=config.eval_bytes,
            progress=log,
        )
        fn, params = init_params(config)
        if source is not None:
            params = gather(source, config, params, new_to_old)
            log(
                f"starting from {source.run_dir} (V = {source.config.max_vocab}) at V = "
                f"{config.heads[0]}: embedding and head rows gathered by the pruned tokenizer's "
                "id map, every other parameter copied"
            )
        tx = optimizer(config)
        session = cls(
            config=config,
            run_dir=run_dir,
            log=log,
            corpus=corpus,
            nested=nested,
            pruned=pruned,
            heads=heads,
            windows=windows,
            heldout=heldout,
            train_tokens=[int(len(ids)) for ids in train_streams.ids],
            digests={"train": train_streams.digest, "heldout": heldout.digest},
            fn=fn,
            tx=tx,
            params=params,
            opt_state=tx.init(params),
            written=resume,
            placement=placement,
        )
        if resume:
            session.restore()
        if placement is not None:
            session.params = placement.put(session.params)
            session.opt_state = placement.put(session.opt_state)
        return session

    def shardings(self) -> tuple[Any, Any, Any, Any] | None:
        """The training step's layout on the mesh: params, optimizer state, batch, losses."""
        p = self.placement
        if p is None:
            return None
        return p.like(self.params), p.like(self.opt_state), p.batch, p.whole

    def place_batch(self, batch_hbt: np.ndarray):
        p = self.placement
        return batch_hbt if p is None else p.put(batch_hbt, p.batch)

    def restore(self) -> None:
        checkpoint = load_checkpoint(self.run_dir)
        if checkpoint is None:
            self.log(f"{self.run_dir} has no checkpoint yet: starting at step 0")
            return
        if checkpoint.step > self.config.steps:
            raise UserError(
                f"{{resume}}: the checkpoint in {self.run_dir} is at step {checkpoint.step}, "
                f"beyond {{steps}} {self.config.steps}",
                settings=["resume", "steps"],
            )
        if checkpoint.meta.get("train_tokens") != self.train_tokens:
            raise UserError(
                "{resume}: the corpus or tokenizer changed since the checkpoint (train tokens "
                f"per head {checkpoint.meta.get('train_tokens')} then, {self.train_tokens} now)",
                settings=["resume"],
            )
        self.params, self.opt_state = restore(
            checkpoint, self.params, self.opt_state, where=str(self.run_dir)
        )
        self.step = self.saved = checkpoint.step
        self.recent = list(checkpoint.meta.get("recent_losses", []))
        self.log(f"resuming {self.run_dir} at step {self.step} of {self.config.steps}")

    def last_saved(self) -> str:
        if self.saved is None:
            return "no checkpoint was written"
        return f"the last checkpoint is at step {self.saved}"

    def save(self) -> None:
        """Checkpoint the current state (never a non-finite one); the first save also writes
        the tokenizer this run trained and run.json."""
        params, opt_state = self.params, self.opt_state
        if self.placement is not None:  # every process joins the gather; process 0 writes
            params, opt_state = jax.tree.map(to_host, (params, opt_state))
            if jax.process_index() != 0:
                self.saved = self.step
                return
        if not all_finite(params) or not all_finite(opt_state):
            raise UserError(
                f"the parameters are not finite after step {self.step}; not checkpointed "
                f"({self.last_saved()}); lower {{lr}}",
                settings=["lr"],
            )
        cfg = self.config
        if not self.written:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self.nested is not None:
                save_nested(
                    self.nested,
                    self.run_dir / TOKENIZER_DIR,
                    corpus=self.corpus.describe("train"),
                    source=f"train --heads {','.join(map(str, cfg.heads))}",
                )
            if self.pruned is not None:
                write_pruned(self.run_dir / TOKENIZER_DIR, *self.pruned)
            self.written = True
        write_run(self.run_dir, cfg)
        meta = {
            "seed": cfg.seed,
            "windows_used": self.step * cfg.batch,  # per head; the order is (seed, head, epoch)
            "windows_per_epoch": [w.count for w in self.windows],
            "train_tokens": self.train_tokens,
            "recent_losses": self.recent,
        }
        save_checkpoint(self.run_dir, self.step, params, opt_state, meta)
        self.saved = self.step

    def fit(self, end: int, *, every: int) -> None:
        """Steps up to ``end``, checkpoints every ``checkpoint_every`` steps and at ``end``."""
        cfg = self.config
        n_params = sum(int(np.prod(p.shape)) for p in self.params.values())
        self.log(
            f"model {cfg.shape.name}: {n_params / 1e6:.2f}M parameters (embedding and W of "
            f"{cfg.max_vocab} rows), heads {list(cfg.heads)}, {cfg.batch} x {cfg.seq_len} "
            f"tokens per head per step, {cfg.steps} steps"
        )
        step_fn = make_train_step(
            self.fn,
            cfg.heads,
            self.tx,
            cfg.impl,
            align_weight=cfg.align_weight,
            shardings=self.shardings(),
        )
        meter = _Meter(len(self.heads) * cfg.batch * cfg.seq_len, first=self.step, end=end)
        last = time.perf_counter()
        while self.step < end:
            batch = self.place_batch(
                np.stack([w.batch(self.step, cfg.batch) for w in self.windows])
            )
            self.params, self.opt_state, losses = step_fn(self.params, self.opt_state, batch)
            losses = np.asarray(losses, dtype=np.float64)
            self.step += 1
            if not np.all(np.isfinite(losses)):
                raise UserError(
                    f"the loss is not finite at step {self.step} "
                    f"({_losses(cfg.heads, losses, 'head ')}); "
                    f"stopped without checkpointing it ({self.last_saved()}); lower {{lr}}",
                    settings=["lr"],
                )
            self.recent = [*self.recent, [float(x) for x in losses]][-RECENT:]
            now = time.perf_counter()
            if self.step > meter.first + 1:  # the session's first step compiles
                self.step_seconds.append(now - last)
            last = now
            meter.tick(self.step)
            if self.step == meter.first + 1 or self.step % every == 0 or self.step == end:
                self.log(
                    f"step {self.step}/{cfg.steps}  loss {_losses(cfg.heads, losses)}  {meter}"
                )
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < end:
                self.save()
                last = time.perf_counter()  # a checkpoint is not a step
        if self.saved != self.step:
            self.save()

    def measure(self, timing_repeats: int) -> tuple[tuple[HeadResult, ...], str]:
        """Every head's result, and how its tokens/s was measured: a one-head run's own
        training steps when this session ran ``LOOP_TIMING_STEPS`` or more (the median step,
        the compiling one left out: hundreds of steps that a transient slowdown hardly moves),
        else a timing pass of ``timing_repeats`` steps of each head alone."""
        cfg = self.config
        p = self.placement
        place = None if p is None else (lambda x: p.put(x, p.rows))
        evals = [
            heldout_bpb(
                self.fn,
                self.params,
                head,
                ids,
                seq_len=cfg.seq_len,
                batch=cfg.batch,
                impl=cfg.impl,
                place=place,
            )
            for head, ids in zip(self.heads, self.heldout.ids, strict=True)
        ]
        n = len(self.step_seconds)
        if len(self.heads) == 1 and n >= LOOP_TIMING_STEPS:
            speeds = [cfg.batch * cfg.seq_len / float(np.median(self.step_seconds))]
            timing = LOOP_TIMING.format(n)
            return self._results(evals, speeds), timing
        speeds = throughput(
            self.fn,
            self.params,
            self.opt_state,
            self.tx,
            self.heads,
            self.windows,
            batch=cfg.batch,
            impl=cfg.impl,
            repeats=timing_repeats,
            shardings=self.shardings(),
            place=self.place_batch,
        )
        what = "each head alone" if len(self.heads) > 1 else "the head"
        timing = f"a timing pass: median of {timing_repeats} steps of {what} after a compiling one"
        return self._results(evals, speeds), timing

    def _results(self, evals, speeds: Sequence[float]) -> tuple[HeadResult, ...]:
        losses = np.mean(np.asarray(self.recent), axis=0) if self.recent else [None] * len(evals)
        return tuple(
            HeadResult(
                vocab=head.vocab,
                train_loss=None if loss is None else float(loss),
                bpb=ev.bpb,
                tokens_per_s=speed,
                bytes_per_token=ev.bytes_per_token,
                eval_tokens=len(ids) - 1,
                train_tokens=n,
            )
            for head, loss, ev, speed, ids, n in zip(
                self.heads, losses, evals, speeds, self.heldout.ids, self.train_tokens, strict=True
            )
        )


def _losses(heads, losses, prefix: str = "") -> str:
    return ", ".join(f"{prefix}{v}: {x:.4g}" for v, x in zip(heads, losses, strict=True))


class _Meter:
    """Training tokens/s, elapsed time and ETA for the progress lines; the first step (which
    compiles) is left out of the rate once there is a second."""

    def __init__(self, tokens_per_step: int, *, first: int, end: int) -> None:
        self.tokens_per_step, self.first, self.end = tokens_per_step, first, end
        self.start = time.perf_counter()
        self.steady: tuple[float, int] | None = None  # (time, step) after the first step
        self.now, self.step = self.start, first

    def tick(self, step: int) -> None:
        self.now, self.step = time.perf_counter(), step
        if self.steady is None:
            self.steady = (self.now, step)

    def __str__(self) -> str:
        t0, s0 = self.steady or (self.start, self.first)
        elapsed = self.now - self.start
        if self.step > s0:
            per_step = (self.now - t0) / (self.step - s0)
            return (
                f"{self.tokens_per_step / per_step:,.0f} tok/s  elapsed {elapsed:.0f} s  "
                f"eta {(self.end - self.step) * per_step:.0f} s"
            )
        rate = (self.step - self.first) * self.tokens_per_step / max(elapsed, 1e-9)
        return f"{rate:,.0f} tok/s  elapsed {elapsed:.0f} s  eta -  (includes compiling)"


def write_profile(result: TrainResult, corpus: str) -> Path:
    """``training.json``: the TrainingProfile (for ``sweep --training``) plus what was run."""
    cfg = result.config
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    heads = ",".join(str(h.vocab) for h in result.heads)
    profile = TrainingProfile(
        name=f"{result.run_dir.name}: {cfg.shape.name}, heads {heads}",
        vocab=tuple(h.vocab for h in result.heads),
        tokens_per_s=tuple(h.tokens_per_s for h in result.heads),
        bpb=tuple(h.bpb for h in result.heads),
        source=(
            f"vocabjax train: model {cfg.shape.name}, heads {heads}, {result.step} steps of "
            f"{cfg.batch} x {cfg.seq_len} tokens per head, corpus {corpus}, device "
            f"{result.device}, jax {jax.__version__}, {date}"
        ),
    )
    data = profile.to_json()
    for point, head in zip(data["points"], result.heads, strict=True):
        point.update(
            train_loss=head.train_loss,
            bytes_per_token=head.bytes_per_token,
            eval_tokens=head.eval_tokens,
        )
    data.update(
        model=cfg.shape.name,
        steps=result.step,
        tokens_per_s_from=result.timing,
        corpus=corpus,
        corpus_digest=dict(result.corpus_digest),
        device=result.device,
        date=date,
        vocabjax=vocabjax.__version__,
    )
    return atomic_write_json(result.run_dir / TRAINING_FILE, data)


__all__ = [
    "TRAINING_FILE",
    "HeadResult",
    "TrainResult",
    "device_label",
    "resume_config",
    "train",
]


def _tokenizers(config: RunConfig, corpus, source, run_dir: Path, log: Progress):
    """(config, head tokenizers, nested training or None, pruned levels or None, the pruned
    tokenizer's new-to-old id map or ()): the run's tokenizer pruned from ``source`` (a pruned
    start without one), trained nested on the corpus (none given), or read from
    ``config.tokenizer`` (checked against ``source`` when there is one)."""
    if config.tokenizer is None and source is not None:
        *pruned, head = prune_source(
            source, corpus.texts("train"), config.heads[0],
            corpus=corpus.describe("train"), progress=log,
        )  # fmt: skip
        config = dataclasses.replace(config, tokenizer=TOKENIZER_DIR)
        return config, [head], None, tuple(pruned), pruned[0].new_to_old
    if config.tokenizer is None:
        log(
            f"no tokenizer given: training a nested BPE at {', '.join(map(str, config.heads))} "
            f"on {corpus.describe('train')}, to be saved in {run_dir / TOKENIZER_DIR}"
        )
        nested = train_nested(corpus.texts("train"), config.heads, progress=log)
        config = dataclasses.replace(config, tokenizer=TOKENIZER_DIR)
        return config, tokenizers_from_nested(nested, config.heads), nested, None, ()
    heads = tokenizers_from_dir(config.tokenizer_path(run_dir), config.heads)
    new_to_old: Sequence[int] = ()
    if source is not None:
        new_to_old = check_pruned(source, heads[0], config.tokenizer_path(run_dir)).new_to_old
    return config, heads, None, None, new_to_old
