"""A jitted KV-cache decode engine for a trained run, at any of its nested heads.

    run = load_run("runs/tiny")                    # config, model + checkpoint, levels
    engine = Engine(run)
    out = engine.generate(["def main("], head=4096, max_new_tokens=32)
    out.completions[0].text, out.decode_tokens_per_s

The engine is the host side of serving: it encodes prompts, packs them into the arrays the
device functions of ``decode.py`` take, keeps their compiled forms, times them and turns their
results into completions. Prompts are encoded with the tokenizer level of the chosen head and
start with the separator ``<|endoftext|>`` (the model saw every training document follow one),
right-padded to a bucket of T_p = a power of two >= 16 tokens (at most ``max_seq``), so prompts
of any length compile at most log2(max_seq) prefills. Sequences of different lengths share one
batch. A sequence stops at the separator (not part of its text), after ``max_new_tokens``, or
when its next position would be ``max_seq`` (learned positions end there). Prefill and decode
are compiled ahead of time per (head, B, T_p, sampling, score) and called once before the timed
run, so the timings leave compiling and first-call set-up out.

For ``serve``: ``generate(..., score=True)`` also returns each prompt's teacher-forced negative
log-likelihood under the head (``Completion.prompt_nats``, ``prompt_bpb``), computed in the
same prefill from its hidden states at positions 0..n-2 against the prompt's tokens 1..n-1
through ``linear_cross_entropy(reduction="none")`` on ``W[:V]`` (the separator is given, not
predicted); ``max_new_tokens`` may be one limit per prompt; ``pad_batch_to`` runs the batch as
more rows (one-token stand-ins whose output is dropped), so batches of many sizes share a few
compiled shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vocabjax import unembed
from vocabjax.errors import UserError
from vocabjax.models import GPT
from vocabjax.serving import decode
from vocabjax.serving.decode import STOP_CODES, STOP_NAMES, DecodeConfig, Decoding, Sampling, Stop
from vocabjax.train import (
    RUN_FILE,
    Functional,
    HeadTokenizer,
    RunConfig,
    load_checkpoint,
    read_run,
    restore_params,
    tokenizers_from_dir,
)

MIN_BUCKET = 16  # the shortest padded prompt


def _fetched(done: Decoding) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The decode loop's results on the host: generated ids, their counts, stop codes."""
    return np.asarray(done.out_bs), np.asarray(done.n_b), np.asarray(done.stop_b)


def prompt_ids(level: HeadTokenizer, text: str) -> np.ndarray:
    """``text``'s ids at ``level`` after the separator (every training document followed one,
    so the prompt reads as the start of a document)."""
    lead = [] if level.separator is None else [level.separator]
    return np.asarray(lead + level.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)


# ---- a trained run ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoadedRun:
    """A training run rebuilt for serving: its configuration, the model with the checkpoint's
    parameters (also as a named array dict for jitted functions), one tokenizer level per head."""

    run_dir: Path
    config: RunConfig
    model: GPT
    fn: Functional  # the model's graph; fn.model(params) rebuilds it inside jit
    params: dict[str, jax.Array]
    levels: tuple[HeadTokenizer, ...]  # one per head, in config.heads order
    step: int  # optimizer steps of the checkpoint

    @property
    def heads(self) -> tuple[int, ...]:
        return self.config.heads

    @property
    def max_seq(self) -> int:
        """Learned positions: the longest prompt plus generation (the run's seq_len)."""
        return self.model.config.max_seq

    def level(self, vocab: int) -> HeadTokenizer:
        if vocab not in self.heads:
            raise UserError(f"head {vocab} is not one of the run's heads ({_list(self.heads)})")
        return self.levels[self.heads.index(vocab)]


def load_run(run_dir: str | Path) -> LoadedRun:
    """Rebuild a run written by ``train``: run.json's model with checkpoint/'s parameters and
    the tokenizer level of each head. A missing or corrupt part is one UserError."""
    path = Path(run_dir)
    if not path.is_dir():
        raise UserError(f"run directory {str(path)!r} does not exist")
    if not (path / RUN_FILE).is_file():
        raise UserError(
            f"{path} holds no {RUN_FILE}: give a run directory written by `python cli.py train`"
        )
    config = read_run(path)
    checkpoint = load_checkpoint(path)
    if checkpoint is None:
        raise UserError(f"{path} holds no checkpoint yet (train writes one as it goes)")
    levels = tuple(tokenizers_from_dir(config.tokenizer_path(path), config.heads))
    # Shapes only: the checkpoint supplies every value, so nothing is initialised.
    abstract = nnx.eval_shape(lambda: GPT(config.model_config, rngs=nnx.Rngs(0)))
    fn, like = Functional.of(abstract)
    params = restore_params(checkpoint, like, where=str(path))
    return LoadedRun(path, config, fn.model(params), fn, params, levels, checkpoint.step)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _list(xs: Sequence[int]) -> str:
    return ", ".join(map(str, xs))


# ---- generation -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Completion:
    prompt: str
    head: int
    prompt_tokens: int  # with the leading separator
    tokens: tuple[int, ...]  # generated ids (the stopping separator left out)
    text: str  # the generated tokens decoded
    stop: Stop
    # generate(score=True): the teacher-forced negative log-likelihood (nats) of the prompt's
    # tokens, each given the separator and the tokens before it, under this head
    prompt_nats: float | None = None

    @property
    def prompt_bytes(self) -> int:
        """The prompt's UTF-8 bytes: what its tokens decode to (byte-level BPE)."""
        return len(self.prompt.encode("utf-8"))

    @property
    def prompt_bpb(self) -> float | None:
        """Bits per byte of the prompt under the head (score=True), as train's held-out bpb
        measures text: nats / (ln 2 * bytes)."""
        if self.prompt_nats is None:
            return None
        return self.prompt_nats / (math.log(2) * self.prompt_bytes)


@dataclasses.dataclass(frozen=True)
class Generation:
    completions: tuple[Completion, ...]
    head: int
    impl: str  # the unembedding implementation impl="auto" chose, and why
    impl_reason: str
    bucket: int  # padded prompt length T_p
    compile_s: float  # compiling prefill and decode and one warm-up call of each (untimed)
    prefill_s: float  # the prefill call, its first tokens included
    decode_s: float  # the decode loop after the prefill
    decode_steps: int
    decode_tokens: int  # tokens the decode steps produced for running sequences
    padded_batch: int  # rows the compiled functions ran: the batch, or pad_batch_to

    @property
    def batch(self) -> int:
        return len(self.completions)

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_steps else None

    def timing(self) -> dict[str, Any]:
        rate = self.decode_tokens_per_s
        return {
            "batch": self.batch,
            "bucket": self.bucket,
            "compile_s": round(self.compile_s, 3),
            "prefill_ms": round(1e3 * self.prefill_s, 3),
            "decode_steps": self.decode_steps,
            "decode_tokens": self.decode_tokens,
            "decode_ms_per_step": (
                round(1e3 * self.decode_s / self.decode_steps, 3) if self.decode_steps else None
            ),
            "decode_tokens_per_s": None if rate is None else round(rate, 1),
        }


def bucket_length(n: int, max_seq: int) -> int:
    """The padded prompt length: the next power of two >= max(n, 16), at most max_seq."""
    return min(max_seq, max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length()))


def attention_window(ends: Sequence[int], max_seq: int) -> int | None:
    """The cache positions decode steps attend to (``DecodeConfig.window``), for rows that end
    at most at ``ends`` (a row's prompt tokens plus its max_new_tokens: it feeds no token at or
    past that position): rounded up as prompts are (``bucket_length``), so that sequences of
    any length compile at most log2(max_seq) windows; None for the whole cache."""
    window = bucket_length(int(max(ends, default=1)), max_seq)
    return None if window >= max_seq else window


# ---- host packing -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Packed:
    """A batch as the compiled functions take it: B prompts, then padding rows."""

    ids_bt: np.ndarray  # (rows, bucket) prompt ids; id 0 past each prompt, never attended to
    lengths_b: np.ndarray  # prompt tokens per row (1 for a padding row)
    limits_b: np.ndarray  # max_new_tokens per row (1 for a padding row)
    real_b: np.ndarray  # the rows that hold prompts

    @property
    def rows(self) -> int:
        return self.ids_bt.shape[0]

    @property
    def bucket(self) -> int:
        return self.ids_bt.shape[1]


def _checked_limits(max_new_tokens: int | Sequence[int]) -> int | list[int]:
    """``max_new_tokens`` as one positive limit for all prompts or a list of one per prompt."""
    per_prompt = isinstance(max_new_tokens, Sequence) and not isinstance(max_new_tokens, str)
    limits = list(max_new_tokens) if per_prompt else [max_new_tokens]  # type: ignore[arg-type]
    if not all(_is_int(n) and n >= 1 for n in limits):
        raise UserError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    return limits if per_prompt else max_new_tokens  # type: ignore[return-value]


def _pack(
    encoded: Sequence[np.ndarray],
    limits: int | list[int],
    *,
    pad_batch_to: int | None,
    max_seq: int,
) -> _Packed:
    """Right-pad ``encoded`` prompts to their bucket and add ``pad_batch_to`` - B padding rows
    (token id 0 alone, limit 1; their outputs are dropped)."""
    b = len(encoded)
    if isinstance(limits, int):
        limits = [limits] * b
    elif len(limits) != b:
        raise UserError(f"{len(limits)} max_new_tokens for {b} prompts: give one per prompt")
    rows = b if pad_batch_to is None else pad_batch_to
    if not _is_int(rows) or rows < b:
        raise UserError(f"pad_batch_to={pad_batch_to!r} must be an integer >= {b} prompts")
    lengths_b = np.asarray([len(x) for x in encoded] + [1] * (rows - b), dtype=np.int32)
    ids_bt = np.zeros((rows, bucket_length(int(lengths_b.max()), max_seq)), dtype=np.int32)
    for row, x in zip(ids_bt, encoded, strict=False):
        row[: len(x)] = x
    limits_b = np.asarray(limits + [1] * (rows - b), dtype=np.int32)
    return _Packed(ids_bt, lengths_b, limits_b, np.arange(rows) < b)


def check_finite(stop_b: np.ndarray) -> None:
    """One UserError when a row stopped on a non-finite hidden state or a NaN logit."""
    if np.any(stop_b == STOP_CODES["nonfinite"]):
        raise UserError(
            "the model's hidden state or its logits are not finite (NaN or inf): the "
            "checkpoint's parameters may be corrupt"
        )


def _completions(
    level: HeadTokenizer,
    prompts: Sequence[str],
    batch: _Packed,
    done: tuple[np.ndarray, np.ndarray, np.ndarray],
    nats_b: jax.Array | None,
) -> tuple[Completion, ...]:
    """The prompts' completions from the decode loop's fetched results (padding rows dropped);
    a row stopped on a non-finite state is one UserError."""
    out_bs, n_b, stop_b = done
    check_finite(stop_b[batch.real_b])
    b = len(prompts)
    nats = [None] * b if nats_b is None else [float(x) for x in np.asarray(nats_b)[:b]]
    out = []
    for i, (text, nll) in enumerate(zip(prompts, nats, strict=True)):
        tokens = list(map(int, out_bs[i, : n_b[i]]))
        out.append(
            Completion(
                prompt=text,
                head=level.vocab,
                prompt_tokens=int(batch.lengths_b[i]),
                tokens=tuple(tokens),
                text=level.tokenizer.decode(tokens, skip_special_tokens=False),
                stop=STOP_NAMES[int(stop_b[i])],  # type: ignore[arg-type]  (every row stopped)
                prompt_nats=nll,
            )
        )
    return tuple(out)


# ---- compiling --------------------------------------------------------------------------------


class Compiled(NamedTuple):
    """An engine's compiled pair for one (head, B, T_p, sampling, score, attention window)."""

    prefill: Any  # (params, ids_bt, lengths_b, rng) -> (caches, first_b, nats_b or None)
    decode: Any  # (params, caches, first_b, start_b, limits_b, real_b, rng) -> Decoding
    compile_s: float  # compiling what was new and one warm-up call of each now: 0 when kept


def _compile_prefill(config: DecodeConfig, example) -> Any:
    """``decode.prefill`` compiled for the shapes of ``example`` (params, ids_bt, lengths_b,
    rng); it does not read ``config.window``, so one serves every window."""
    return jax.jit(functools.partial(decode.prefill, config)).lower(*example).compile()


def _compile_decode(config: DecodeConfig, prefill_c, example) -> Any:
    """``decode.decode`` compiled for what ``prefill_c`` makes of ``example``, donating its
    caches, and called once untimed: a fresh executable's first call pays set-up costs that are
    not decoding."""
    params, _, lengths_b, rng = example
    caches, first_b, _ = prefill_c(*example)
    # The decode's warm-up arguments: at most one loop step (a limit of 2 tokens per row).
    twos_b = jnp.asarray(np.full(lengths_b.shape, 2, np.int32))
    real_b = jnp.asarray(np.ones(lengths_b.shape, bool))
    loop = jax.jit(functools.partial(decode.decode, config), donate_argnums=(1,))
    decode_c = loop.lower(params, caches, first_b, lengths_b, twos_b, real_b, rng).compile()
    # Fetched as a timed call is, or the first timed call pays the fetch's set-up.
    _fetched(decode_c(params, caches, first_b, lengths_b, twos_b, real_b, rng))
    return decode_c


class Engine:
    """Generation from a loaded run; compiled functions are kept per (head, B, T_p, sampling)."""

    def __init__(self, run: LoadedRun) -> None:
        self.run = run
        self._prefills: dict[tuple, Any] = {}  # by (head, B, T_p, sampling, score)
        self._decodes: dict[tuple, Any] = {}  # by the same and the attention window
        self._functions: dict[tuple, Any] = {}  # ahead-of-time compiled, by (name, shapes)

    @property
    def shapes(self) -> int:
        """The device functions compiled so far (one per name and shapes)."""
        return len(self._functions)

    def function(
        self, key: tuple, fn: Callable, example: tuple, *, donate: tuple[int, ...] = ()
    ) -> tuple[Any, float]:
        """``jax.jit(fn)`` compiled for ``example``'s shapes on first use of ``key`` and called
        once untimed (a fresh executable's first call pays set-up costs; donated arguments are
        copied for it), then kept: (the compiled function, the seconds spent now, 0 if kept)."""
        if key in self._functions:
            return self._functions[key], 0.0
        started = time.perf_counter()
        compiled = jax.jit(fn, donate_argnums=donate).lower(*example).compile()
        warm = [jax.tree.map(jnp.copy, x) if i in donate else x for i, x in enumerate(example)]
        jax.block_until_ready(compiled(*warm))
        self._functions[key] = compiled
        return compiled, time.perf_counter() - started

    def encode(self, prompts: Sequence[str], head: int) -> list[np.ndarray]:
        """Each prompt's ids at ``head``'s level, after the separator; checked against max_seq."""
        if not prompts:
            raise UserError("give at least one prompt")
        level = self.run.level(head)
        max_seq = self.run.max_seq
        out = []
        for i, text in enumerate(prompts, 1):
            if not text:
                raise UserError(f"prompt {i} is empty: give the text to continue")
            ids = prompt_ids(level, text)
            if len(ids) > max_seq:
                raise UserError(
                    f"prompt {i} is {len(ids)} tokens at head {head} (separator included), "
                    f"above the run's max_seq={max_seq}; shorten it"
                )
            out.append(ids)
        return out

    def config(self, head: int, sampling: Sampling, score: bool) -> DecodeConfig:
        """What the device functions of ``head`` are specialised to."""
        run = self.run
        separator = run.level(head).separator
        return DecodeConfig(run.fn, run.max_seq, head, sampling, separator, score)

    def compile(
        self,
        head: int,
        batch: int,
        bucket: int,
        sampling: Sampling,
        score: bool,
        example,
        window: int | None = None,
    ) -> Compiled:
        """Prefill and decode for ``head``, ``batch`` rows and prompts of ``bucket`` tokens,
        the decode attending to ``window`` cache positions (``attention_window``), compiled on
        first use from ``example`` = (params, ids_bt, lengths_b, rng) and kept."""
        key = (head, batch, bucket, sampling.temperature, sampling.top_k, score)
        if (key, window) in self._decodes:
            return Compiled(self._prefills[key], self._decodes[(key, window)], 0.0)
        started = time.perf_counter()
        config = self.config(head, sampling, score)
        if key not in self._prefills:
            self._prefills[key] = _compile_prefill(config, example)
        config = dataclasses.replace(config, window=window)
        self._decodes[(key, window)] = _compile_decode(config, self._prefills[key], example)
        return Compiled(
            self._prefills[key], self._decodes[(key, window)], time.perf_counter() - started
        )

    def generate(
        self,
        prompts: Sequence[str],
        *,
        head: int,
        max_new_tokens: int | Sequence[int] = 64,
        sampling: Sampling | None = None,
        score: bool = False,
        pad_batch_to: int | None = None,
    ) -> Generation:
        """Continue every prompt at head ``head`` (one of the run's heads), as one batch.

        ``max_new_tokens`` is one limit for all or one per prompt. ``score``: the prefill also
        measures each prompt's negative log-likelihood under the head (``Completion.prompt_nats``,
        ``prompt_bpb``), from the prefill's hidden states through ``linear_cross_entropy``.
        ``pad_batch_to``: run the batch as this many rows (>= the prompts; the extra rows are a
        one-token stand-in whose output is dropped), so that batches of many sizes share a few
        compiled shapes.
        """
        sampling = sampling or Sampling()
        limits = _checked_limits(max_new_tokens)
        if sampling.top_k is not None and sampling.top_k > head:
            raise UserError(f"top_k={sampling.top_k} must be <= the head's V={head}")
        encoded = self.encode(prompts, head)
        batch = _pack(encoded, limits, pad_batch_to=pad_batch_to, max_seq=self.run.max_seq)
        rng = jax.random.key(sampling.seed)
        params = self.run.params
        args = (params, jnp.asarray(batch.ids_bt), jnp.asarray(batch.lengths_b), rng)
        ends = batch.lengths_b[batch.real_b] + batch.limits_b[batch.real_b]
        window = attention_window(ends.tolist(), self.run.max_seq)
        compiled = self.compile(head, batch.rows, batch.bucket, sampling, score, args, window)

        started = time.perf_counter()
        caches, first_b, nats_b = compiled.prefill(*args)
        jax.block_until_ready(first_b)
        prefill_s = time.perf_counter() - started

        started = time.perf_counter()
        rows_b = (jnp.asarray(x) for x in (batch.lengths_b, batch.limits_b, batch.real_b))
        done = compiled.decode(params, caches, first_b, *rows_b, rng)
        fetched = _fetched(done)
        decode_s = time.perf_counter() - started

        completions = _completions(self.run.level(head), prompts, batch, fetched, nats_b)
        choice = self.impl_choice(head, sampling, batch.rows)
        return Generation(
            completions=completions,
            head=head,
            impl=choice.impl,
            impl_reason=choice.reason,
            bucket=batch.bucket,
            compile_s=compiled.compile_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            decode_steps=int(done.steps),
            decode_tokens=int(done.produced),
            padded_batch=batch.rows,
        )

    def impl_choice(self, head: int, sampling: Sampling, rows: int):
        """What ``impl="auto"`` picks for the token pick of (head, rows), and why."""
        op = "greedy" if sampling.greedy else ("sample" if sampling.top_k is None else "top_k")
        config = self.run.config
        return unembed.select(
            op,
            vocab=head,
            batch=rows,
            d_model=config.shape.d_model,
            dtype=unembed.dtype_name(config.model_config.dtype),
        )
