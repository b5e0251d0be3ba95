"""A jitted KV-cache decode engine for a trained run, at any of its nested heads.

    run = load_run("runs/tiny")                    # config, model + checkpoint, levels
    engine = Engine(run)
    out = engine.generate(["def main("], head=4096, max_new_tokens=32)
    out.completions[0].text, out.decode_tokens_per_s

Prompts are encoded with the tokenizer level of the chosen head and start with the separator
``<|endoftext|>`` (the model saw every training document follow one), right-padded to a bucket
of T_p = a power of two >= 16 tokens (at most ``max_seq``), so prompts of any length compile
at most log2(max_seq) prefills. The prefill runs the padded prompts through
``GPT.cached`` at positions 0..T_p-1, which fills per-layer K/V caches of (B, max_seq, K, Dh);
each sequence's next token comes from its last real prompt position. The decode is one jitted
``lax.while_loop`` on the device, with no host round trip per token: each step feeds one token
per running sequence at its own position (its length so far), appends its K/V there and attends
to the positions before it, so the padding a shorter prompt leaves in the cache is overwritten
before any query can see it. Sequences of different lengths share one batch.

The next token is ``vocabjax.unembed.greedy`` (temperature 0) or ``sample`` (Gumbel-max at a
temperature, optionally within the top k) on the head ``W[:V]``, with ``impl="auto"`` (the
kernel selector's choice for (V, B, D)). Step i's key is ``fold_in(key(seed), i)``, so a seed
reproduces a generation. A sequence stops at the separator (not part of its text), after
``max_new_tokens``, or when its next position would be ``max_seq`` (learned positions end
there). Prefill and decode are compiled ahead of time and called once before the timed run, so
the timings leave compiling and first-call set-up out.

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
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from vocabjax import unembed
from vocabjax.errors import UserError
from vocabjax.models import GPT, head_loss
from vocabjax.planning import POLICY_KIND
from vocabjax.profiles import (
    VOCAB_MAX,
    a_list,
    an_object,
    closed,
    integer,
    load_json,
    require,
)
from vocabjax.train import (
    IGNORE,
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
Stop = Literal["eos", "max_new_tokens", "max_seq"]
# How the on-device decode loop marks a row: still running, or why it stopped.
STOP_CODES = {"running": 0, "eos": 1, "max_new_tokens": 2, "max_seq": 3, "nonfinite": 4}
_STOP_NAMES = {code: name for name, code in STOP_CODES.items()}


class _Decoding(NamedTuple):
    """The decode loop's carry: caches, generated ids (B, max_seq) and per-row counters."""

    caches: Any
    out_bs: jax.Array  # generated ids, row i's first n_b[i] valid
    n_b: jax.Array  # tokens generated per row
    stop_b: jax.Array  # STOP_CODES
    last_b: jax.Array  # the token each row feeds next (its last generated; 0 before any)
    pos_b: jax.Array  # where each row's next fed token goes
    steps: jax.Array  # decode steps run (step i samples with fold_in(key, i))
    produced: jax.Array  # tokens the steps produced for running rows


def _fetched(done: _Decoding) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


# ---- which head -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HeadChoice:
    vocab: int
    reason: str  # one line for the log


def load_policy(path: str | Path) -> list[tuple[int | None, int]]:
    """The ``batch_routes`` of a policy written by ``plan --out``: (max_batch or None, head)
    pairs in increasing max_batch, None (every larger batch) last. A route's ``b_max`` and
    ``fits`` (whether its batches fit beside its head on the planned device) are checked but not
    acted on: the engine's own batch limit decides here. The policy's other fields are
    ``plan``'s record of how it decided and are not read."""
    data = load_json(path, POLICY_KIND)
    where = f"policy {str(path)!r}"
    require(data, ("batch_routes",), where=where)
    routes = a_list(data["batch_routes"], where=f"{where}: batch_routes", nonempty=True)
    out: list[tuple[int | None, int]] = []
    for i, r in enumerate(routes):
        at = f"{where}: batch_routes[{i}]"
        closed(an_object(r, where=at), ("max_batch", "head", "b_max", "fits"), where=at)
        require(r, ("head",), where=at)
        if "b_max" in r:
            integer(r["b_max"], where=f"{at}.b_max", minimum=0)
        if "fits" in r and not isinstance(r["fits"], bool):
            raise UserError(f"{at}.fits must be true or false, got {r['fits']!r}")
        head = integer(r["head"], where=f"{at}.head", maximum=VOCAB_MAX)
        bound = r.get("max_batch")
        if bound is not None:
            bound = integer(bound, where=f"{at}.max_batch")
            last = out[-1][0] if out else 0  # never None: a null bound before here was refused
            if last is not None and bound <= last:
                raise UserError(
                    f"{at}.max_batch={bound} must be above the previous route's ({last}): "
                    "routes go in increasing max_batch, null last"
                )
        elif i != len(routes) - 1:
            raise UserError(f"{at}.max_batch is null (every larger batch) but is not the last")
        out.append((bound, head))
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def choose_head(
    heads: Sequence[int],
    head: int | Literal["auto"],
    *,
    batch: int,
    routes: Sequence[tuple[int | None, int]] | None = None,
) -> HeadChoice:
    """The head to serve a batch with: ``head`` itself (one of ``heads``); for ``"auto"`` the
    route of a policy for this batch size, snapped to the nearest of the run's heads in log V
    (ties to the larger), or without a policy the largest head."""
    heads = tuple(sorted(heads))
    if head != "auto":
        if head not in heads:
            raise UserError(
                f"{{head}} {head} is not one of the run's heads ({_list(heads)})",
                settings=["head"],
            )
        return HeadChoice(int(head), f"head {head} (asked for)")
    if routes is None:
        return HeadChoice(heads[-1], f"head auto: the largest of the run's heads ({_list(heads)})")
    i = next((i for i, r in enumerate(routes) if r[0] is None or batch <= r[0]), len(routes) - 1)
    bound_b, want = routes[i]
    if bound_b is not None:
        bound = f"B <= {bound_b}"
    else:
        bound = f"B > {routes[i - 1][0]}" if i else "every batch"
    vocab = min(heads, key=lambda v: (abs(math.log(v / want)), -v))
    note = "" if vocab == want else f", the run's nearest head in log V ({_list(heads)})"
    return HeadChoice(
        vocab, f"head auto: the policy routes B={batch} ({bound}) to {want}: serving {vocab}{note}"
    )


def _list(xs: Sequence[int]) -> str:
    return ", ".join(map(str, xs))


# ---- generation -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is picked."""

    temperature: float = 0.0  # 0: greedy (argmax); > 0: sample softmax(logits / temperature)
    top_k: int | None = None  # sample among the k largest logits only (temperature > 0)
    seed: int = 0  # the sampling key: jax.random.key(seed), folded with the step

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise UserError(f"temperature={t!r} must be a finite number >= 0 (0: greedy)")
        if self.top_k is not None:
            if not _is_int(self.top_k) or self.top_k < 1:
                raise UserError(f"top_k={self.top_k!r} must be a positive integer")
            if t == 0:
                raise UserError("top_k applies to sampling: give a temperature > 0 with it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


class Engine:
    """Generation from a loaded run; compiled functions are kept per (head, B, T_p, sampling)."""

    def __init__(self, run: LoadedRun) -> None:
        self.run = run
        self._compiled: dict[tuple, tuple[Any, Any]] = {}

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

    def _functions(
        self, head: int, batch: int, bucket: int, sampling: Sampling, score: bool, example
    ):
        """(prefill, decode, seconds spent compiling them now: 0 when they were kept)."""
        key = (head, batch, bucket, sampling.temperature, sampling.top_k, score)
        if key in self._compiled:
            return (*self._compiled[key], 0.0)
        fn, max_seq = self.run.fn, self.run.max_seq

        def pick(model: GPT, h_bd: jax.Array, rng: jax.Array) -> jax.Array:
            w_vd = model.head(head)
            if sampling.greedy:
                return unembed.greedy(h_bd, w_vd, impl="auto")
            return unembed.sample(
                h_bd, w_vd, rng, sampling.temperature, sampling.top_k, impl="auto"
            )

        def prompt_nats(model: GPT, h_btd, ids_bt, lengths_b):
            # Position t predicts token t + 1; predictions past a prompt's end are left out.
            t = ids_bt.shape[1]
            real_bt = jnp.arange(1, t, dtype=lengths_b.dtype)[None, :] < lengths_b[:, None]
            labels_bt = jnp.where(real_bt, ids_bt[:, 1:], IGNORE)
            nats_bt = head_loss(
                h_btd[:, :-1], model.head(head), labels_bt, impl="auto", reduction="none"
            )
            return nats_bt.sum(axis=1)

        def prefill(params, ids_bt, lengths_b, rng):
            model = fn.model(params)
            caches = model.init_cache(ids_bt.shape[0], max_seq)
            start_b = jnp.zeros((ids_bt.shape[0],), jnp.int32)
            h_btd, caches = model.cached(ids_bt, caches, start_b)
            h_bd = jnp.take_along_axis(h_btd, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
            nats_b = prompt_nats(model, h_btd, ids_bt, lengths_b) if score else None
            return caches, pick(model, h_bd, jax.random.fold_in(rng, 0)), nats_b

        separator = self.run.level(head).separator
        sep = -1 if separator is None else int(separator)  # ids are >= 0: -1 matches none

        def take(state: _Decoding, tokens_b, running_b, limits_b) -> _Decoding:
            """Each running row's new token: a non-finite state (id -1) or the separator stops
            it, any other token is appended, then the row stops at its limit or at max_seq."""
            bad = running_b & (tokens_b < 0)
            eos = running_b & ~bad & (tokens_b == sep)
            keep = running_b & ~bad & ~eos
            col = jnp.arange(max_seq, dtype=jnp.int32)[None, :]
            out_bs = jnp.where(keep[:, None] & (col == state.n_b[:, None]), tokens_b[:, None],
                               state.out_bs)  # fmt: skip
            n_b = state.n_b + keep.astype(jnp.int32)
            stop_b = jnp.where(bad, STOP_CODES["nonfinite"], state.stop_b)
            stop_b = jnp.where(eos, STOP_CODES["eos"], stop_b)
            full = keep & (n_b >= limits_b)
            stop_b = jnp.where(full, STOP_CODES["max_new_tokens"], stop_b)
            ended = keep & ~full & (state.pos_b >= max_seq)
            stop_b = jnp.where(ended, STOP_CODES["max_seq"], stop_b)
            last_b = jnp.where(keep, tokens_b, state.last_b)
            return state._replace(out_bs=out_bs, n_b=n_b, stop_b=stop_b, last_b=last_b)

        def decode(params, caches, first_b, lengths_b, limits_b, real_b, rng):
            """Every decode step in one on-device loop, until each real row has stopped: no
            host round trip per token."""
            rows = first_b.shape[0]
            zeros = jnp.zeros((rows,), jnp.int32)
            state = _Decoding(
                caches=caches,
                out_bs=jnp.zeros((rows, max_seq), jnp.int32),
                n_b=zeros,
                stop_b=zeros,
                last_b=zeros,
                pos_b=lengths_b,
                steps=jnp.int32(0),
                produced=jnp.int32(0),
            )
            state = take(state, first_b, real_b, limits_b)

            def running(state: _Decoding):
                return real_b & (state.stop_b == STOP_CODES["running"])

            def step(state: _Decoding) -> _Decoding:
                model = fn.model(params)
                run_b = running(state)
                steps = state.steps + 1
                pos_b = jnp.minimum(state.pos_b, max_seq - 1)  # finished rows write harmlessly
                h_b1d, caches = model.cached(state.last_b[:, None], state.caches, pos_b)
                tokens_b = pick(model, h_b1d[:, 0], jax.random.fold_in(rng, steps))
                state = state._replace(
                    caches=caches,
                    pos_b=state.pos_b + run_b.astype(jnp.int32),
                    steps=steps,
                    produced=state.produced + run_b.sum(dtype=jnp.int32),
                )
                return take(state, tokens_b, run_b, limits_b)

            # The caches come back too, so the donated input buffers are the loop's own.
            return lax.while_loop(lambda st: running(st).any(), step, state)

        params, ids_bt, lengths_b, rng = example
        started = time.perf_counter()
        prefill_c = jax.jit(prefill).lower(params, ids_bt, lengths_b, rng).compile()
        caches, token_b, _ = jax.eval_shape(prefill, params, ids_bt, lengths_b, rng)
        # The decode's warm-up arguments: at most one loop step (a limit of 2 tokens per row).
        twos_b = jnp.asarray(np.full(lengths_b.shape, 2, np.int32))
        real_b = jnp.asarray(np.ones(lengths_b.shape, bool))
        decode_c = (
            jax.jit(decode, donate_argnums=(1,))
            .lower(params, caches, token_b, lengths_b, twos_b, real_b, rng)
            .compile()
        )
        # One untimed run of each: a fresh executable's first call pays set-up costs (10-30 ms
        # for a 16-token prefill on a 2-core CPU against under 1 ms after) that are not decoding.
        # The decode's warm-up runs on host arrays and fetches its results, as a timed call
        # does: without the fetch, the first timed call of a process took ~20 ms more (tiny
        # run, CPU: 25 against 7 ms).
        caches, token_b, _ = prefill_c(params, ids_bt, lengths_b, rng)
        _fetched(decode_c(params, caches, token_b, lengths_b, twos_b, real_b, rng))
        self._compiled[key] = (prefill_c, decode_c)
        return prefill_c, decode_c, time.perf_counter() - started

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
        per_prompt = isinstance(max_new_tokens, Sequence) and not isinstance(max_new_tokens, str)
        limits = list(max_new_tokens) if per_prompt else [max_new_tokens]  # type: ignore[arg-type]
        if not all(_is_int(n) and n >= 1 for n in limits):
            raise UserError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
        if sampling.top_k is not None and sampling.top_k > head:
            raise UserError(f"top_k={sampling.top_k} must be <= the head's V={head}")
        encoded = self.encode(prompts, head)
        max_seq = self.run.max_seq
        b = len(encoded)
        if not per_prompt:
            limits *= b
        elif len(limits) != b:
            raise UserError(f"{len(limits)} max_new_tokens for {b} prompts: give one per prompt")
        rows = b if pad_batch_to is None else pad_batch_to
        if not _is_int(rows) or rows < b:
            raise UserError(f"pad_batch_to={pad_batch_to!r} must be an integer >= {b} prompts")
        # Padding rows: token id 0 alone, never read (their outputs are dropped).
        lengths = np.asarray([len(x) for x in encoded] + [1] * (rows - b), dtype=np.int32)
        bucket = bucket_length(int(lengths.max()), max_seq)
        ids = np.zeros((rows, bucket), dtype=np.int32)  # padding: id 0, never attended to
        for row, x in zip(ids, encoded, strict=False):
            row[: len(x)] = x
        rng = jax.random.key(sampling.seed)
        params = self.run.params
        args = (params, jnp.asarray(ids), jnp.asarray(lengths), rng)
        prefill_c, decode_c, compile_s = self._functions(head, rows, bucket, sampling, score, args)

        started = time.perf_counter()
        caches, token_b, nats_b = prefill_c(*args)
        jax.block_until_ready(token_b)
        prefill_s = time.perf_counter() - started

        real = np.arange(rows) < b  # the rows that hold prompts
        started = time.perf_counter()
        done = decode_c(
            params,
            caches,
            token_b,
            jnp.asarray(lengths),
            jnp.asarray(np.asarray(limits + [1] * (rows - b), dtype=np.int32)),
            jnp.asarray(real),
            rng,
        )
        out_bs, n_b, stop_b = _fetched(done)
        decode_s = time.perf_counter() - started
        if np.any(stop_b[real] == STOP_CODES["nonfinite"]):
            raise UserError(
                "the model's hidden state is not finite (NaN or inf): the checkpoint's "
                "parameters may be corrupt"
            )
        generated = [list(map(int, out_bs[i, : n_b[i]])) for i in range(rows)]
        stop = [_STOP_NAMES[int(code)] for code in stop_b]
        steps, produced = int(done.steps), int(done.produced)
        nats = [None] * b if nats_b is None else [float(x) for x in np.asarray(nats_b)[:b]]

        level = self.run.level(head)
        completions = tuple(
            Completion(
                prompt=text,
                head=head,
                prompt_tokens=int(n),
                tokens=tuple(g),
                text=level.tokenizer.decode(g, skip_special_tokens=False),
                stop=s,  # type: ignore[arg-type]  (every row has stopped here)
                prompt_nats=nll,
            )
            for text, n, g, s, nll in zip(
                prompts, lengths[:b], generated[:b], stop[:b], nats, strict=True
            )
        )
        op = "greedy" if sampling.greedy else ("sample" if sampling.top_k is None else "top_k")
        choice = unembed.select(
            op,
            vocab=head,
            batch=rows,
            d_model=self.run.config.shape.d_model,
            dtype=unembed.dtype_name(self.run.config.model_config.dtype),
        )
        return Generation(
            completions=completions,
            head=head,
            impl=choice.impl,
            impl_reason=choice.reason,
            bucket=bucket,
            compile_s=compile_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            decode_steps=steps,
            decode_tokens=produced,
            padded_batch=rows,
        )
