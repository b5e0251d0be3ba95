"""The points ``validate`` times: which step or op, at which model shape, V, B and context.

Families (one vocabulary across code, JSON and docs):

    step  decode       one decode step of the serving engine with a KV cache of T positions
          prefill      the engine's prefill of B prompts of T tokens (logits for the last only)
          train        one training step: forward, backward and the AdamW update, B x T tokens
    op    backbone     the model's layer stack on one token per row (its attention sees 1 token)
          attention    decode attention alone: B queries over a KV cache of T positions, L layers
          unembedding  the logits h @ W.T alone, (B, D) x (V, D)

A grid is a frozen description; :meth:`Grid.points` lists its points: decode and prefill over
(V, B, T), attention over (B, T) of the decode points (it reads their caches), training over
(train V, train B) at one sequence length, backbone over B and unembedding over (V, B) of the
op axes; each decode point also at the grid's ``loop_steps`` (more steps per call). Presets:
``GRIDS["full"]`` (the default of ``validate``), ``"quick"`` (minutes on two CPU cores),
``"loops"`` (decode loops of 1, 8 and 32 steps per call alone, to fit beside the full grid),
``"anchor"`` (a minute of steps that ``validate --anchor`` scales a profile by), ``"gpu"`` (a
1B Llama-like model for an accelerator) and ``"test"`` (seconds, for the test suite). The CPU
grids' shapes beyond ``tiny`` are synthetic, GPT-like (MHA, 4D GELU MLP) or Llama-like (GQA,
SwiGLU), sized so that on a two-core CPU a step at B = 1 reads its weights from memory
(memory-bound) and one at B >= 16 is compute-bound.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from vocabjax.errors import UserError
from vocabjax.shapes import BUILTIN_SHAPES, ModelShape
from vocabjax.timing import TimingSettings

Family = Literal["decode", "prefill", "train", "backbone", "attention", "unembedding"]
STEP_FAMILIES: tuple[str, ...] = ("decode", "prefill", "train")
OP_FAMILIES: tuple[str, ...] = ("backbone", "attention", "unembedding")
FAMILIES: tuple[str, ...] = STEP_FAMILIES + OP_FAMILIES
AXES: tuple[str, ...] = ("vocabs", "batches", "contexts", "prompt_tokens", "train_vocabs",
                         "train_batches", "op_vocabs", "op_batches")  # fmt: skip

_SYNTHETIC = "vocabjax validate: synthetic shape sized for a CPU"
W256 = ModelShape("w256-l4", 256, 4, 4, 4, 1024, source=_SYNTHETIC + " (GPT-like)")
W512 = ModelShape("w512-l6", 512, 6, 8, 8, 2048, source=_SYNTHETIC + " (GPT-like)")
W512_GQA = ModelShape(
    "w512-l4-gqa", 512, 4, 8, 2, 1408, glu=True, source=_SYNTHETIC + " (Llama-like: GQA, SwiGLU)"
)


@dataclasses.dataclass(frozen=True)
class Point:
    """One timed configuration."""

    family: Family  # which step or op (module docstring)
    shape: ModelShape  # the model
    batch: int  # B, rows (sequences) per call
    vocab: int | None = None  # V of the head; None for ops that do not read it
    context: int | None = None  # T: KV-cache positions (decode, attention), prompt or sequence
    # a decode point's steps per call where it is one of its grid's ``loop_steps``; None: the
    # grid's ``decode_steps`` (and every other family)
    steps: int | None = None

    @property
    def kind(self) -> str:
        return "step" if self.family in STEP_FAMILIES else "op"

    def label(self) -> str:
        return self.configuration() + ("" if self.steps is None else f" S={self.steps}")

    def configuration(self) -> str:
        """The label without the loop length: a decode configuration timed at several loop
        lengths is one configuration (the fit's split keeps them together)."""
        parts = [self.family, self.shape.name]
        if self.vocab is not None:
            parts.append(f"V={self.vocab}")
        parts.append(f"B={self.batch}")
        if self.context is not None:
            parts.append(f"T={self.context}")
        return " ".join(parts)

    def per_call(self, decode_steps: int) -> int:
        """Units of the point's measured time in one timed call: a decode point's loop steps
        (its own ``steps``, else its grid's ``decode_steps``), 1 for every other family."""
        if self.family != "decode":
            return 1
        return decode_steps if self.steps is None else self.steps


@dataclasses.dataclass(frozen=True)
class Grid:
    """Which points to time and how hard; every family crosses its own axes below."""

    name: str  # "full", "quick", "loops", "test", or a caller's own
    shapes: tuple[ModelShape, ...]  # models, each timed as its own round-robin group
    vocabs: tuple[int, ...]  # V of decode and prefill points
    batches: tuple[int, ...]  # B of decode, prefill and attention points
    contexts: tuple[int, ...]  # KV-cache lengths T of decode (and attention) points
    prompt_tokens: tuple[int, ...]  # prompt lengths of prefill points
    train_vocabs: tuple[int, ...]  # V of train points (a training state per V is resident)
    train_batches: tuple[int, ...]  # windows per training step
    train_seq: int  # tokens per training window
    op_vocabs: tuple[int, ...]  # V of unembedding points
    op_batches: tuple[int, ...]  # B of backbone and unembedding points
    decode_steps: int = 8  # decode steps per timed call of the engine's loop (per-step = / n)
    # more loop lengths at which every decode point is timed too (``Point.steps``): a call's
    # fixed cost and its steps' cost then part in the fit
    loop_steps: tuple[int, ...] = ()
    max_flops: float = 2e11  # points whose timed call needs more FLOPs are left out
    timing: TimingSettings = dataclasses.field(
        default_factory=lambda: TimingSettings(warmup=2, repeats=7, min_repeats=3)
    )  # warm-up calls and repeats of autotune's round-robin timer

    def __post_init__(self) -> None:
        if not self.shapes:
            raise UserError(f"grid {self.name!r} needs at least one model shape")
        for axis in AXES:
            for v in getattr(self, axis):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise UserError(f"grid {self.name!r}: {axis} must be positive integers")
        loops = (self.decode_steps, *self.loop_steps)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in loops):
            raise UserError(
                f"grid {self.name!r}: decode_steps, loop_steps must be positive integers"
            )
        if len(set(loops)) != len(loops):
            raise UserError(
                f"grid {self.name!r}: loop_steps={list(self.loop_steps)} repeat a length"
            )
        if any(t < max(loops) + 1 for t in self.contexts):
            raise UserError(
                f"grid {self.name!r}: contexts={list(self.contexts)} must exceed "
                f"decode_steps={max(loops)} (the timed steps run inside the cache)"
            )
        if self.train_seq < 1 or self.max_flops <= 0:
            raise UserError(f"grid {self.name!r}: train_seq, max_flops must be > 0")

    @property
    def max_vocab(self) -> int:
        """The largest head any point reads (each shape's tables are drawn at this size)."""
        return max((*self.vocabs, *self.train_vocabs, *self.op_vocabs, 2))

    @property
    def max_seq(self) -> int:
        """The longest sequence any point feeds a model (learned positions go this far)."""
        return max((*self.contexts, *self.prompt_tokens, self.train_seq, 1))

    def points(self) -> list[Point]:
        """Every point of the grid, shape by shape (FLOP cap not yet applied)."""
        out: list[Point] = []
        for s in self.shapes:
            for v in self.vocabs:
                for b in self.batches:
                    for t in self.contexts:
                        out.append(Point("decode", s, b, v, t))
                        out += [Point("decode", s, b, v, t, n) for n in self.loop_steps]
                    out += [Point("prefill", s, b, v, p) for p in self.prompt_tokens]
            for v in self.train_vocabs:
                out += [Point("train", s, b, v, self.train_seq) for b in self.train_batches]
            for b in self.batches:  # attention reads the decode points' caches
                out += [Point("attention", s, b, None, t) for t in self.contexts]
            for b in self.op_batches:
                out.append(Point("backbone", s, b))
                out += [Point("unembedding", s, b, v) for v in self.op_vocabs]
        return out


def _full() -> Grid:
    return Grid(
        name="full",
        shapes=(BUILTIN_SHAPES["tiny"], W256, W512, W512_GQA),
        vocabs=(1024, 4096, 16384, 65536, 131072),
        batches=(1, 4, 16, 64),
        contexts=(64, 512),
        prompt_tokens=(64, 512),  # the decode contexts: a prefill shares its engine build
        train_vocabs=(1024, 16384, 65536),
        train_batches=(1, 4, 16),
        train_seq=64,
        op_vocabs=(1024, 4096, 16384, 65536, 131072),
        op_batches=(1, 4, 16, 64, 256),
        max_flops=1e11,
    )


def _quick() -> Grid:
    return Grid(
        name="quick",
        shapes=(BUILTIN_SHAPES["tiny"], W256, W512_GQA),
        vocabs=(1024, 65536),
        batches=(1, 4, 16),
        contexts=(64, 256),
        prompt_tokens=(64,),
        train_vocabs=(1024, 65536),
        train_batches=(1, 4),
        train_seq=64,
        op_vocabs=(1024, 8192, 65536),
        op_batches=(1, 4, 16, 64),
        max_flops=1.5e10,
        timing=TimingSettings(warmup=2, repeats=5, min_repeats=3),
    )


def _loops() -> Grid:
    """Decode loops alone, each configuration at 1, 8 and 32 steps per call: what the full
    grid's 8-step loops cannot tell apart (a call's fixed cost, its steps' own). Its runs fit
    beside the full grid's (``validate --from`` combines runs of several grids)."""
    return Grid(
        name="loops",
        shapes=(BUILTIN_SHAPES["tiny"], W256, W512_GQA),
        vocabs=(1024, 65536),
        batches=(1, 4, 16, 64),
        contexts=(64, 512),
        prompt_tokens=(),
        train_vocabs=(),
        train_batches=(),
        train_seq=64,
        op_vocabs=(),
        op_batches=(),
        loop_steps=(1, 32),
        max_flops=1e11,
    )


def _anchor() -> Grid:
    """A minute of steps across the three shapes' memory- and compute-bound corners, to scale a
    calibrated profile to the machine's speed today (``validate --anchor``, anchor.py)."""
    return Grid(
        name="anchor",
        shapes=(BUILTIN_SHAPES["tiny"], W256, W512_GQA),
        vocabs=(1024, 65536),
        batches=(1, 16),
        contexts=(64,),
        prompt_tokens=(64,),
        train_vocabs=(1024,),
        train_batches=(1,),
        train_seq=64,
        op_vocabs=(),
        op_batches=(),
        max_flops=2e10,
        timing=TimingSettings(warmup=2, repeats=5, min_repeats=3),
    )


def _gpu() -> Grid:
    """A Llama-like 1B model (``llama-1b``: GQA, SwiGLU, 16 layers of D = 2,048) on an
    accelerator, where the CPU grids' shapes are all launch-bound: decode loops of 1, 8 and 32
    steps a call at V = 32k and 128k, B = 1, 4, 16 and 64, caches of 512 and 2,048 positions;
    prefills of 512 tokens; training steps of 1 and 4 x 512 tokens; and the ops. 75 points, 58
    of them steps, of which the fit split holds enough to calibrate on (tests/test_gpu_grid.py);
    its 16 engine builds dominate its minutes on a card (``benchmarks/gpu_check.py`` runs it).
    Far too large for a CPU's two cores."""
    return Grid(
        name="gpu",
        shapes=(BUILTIN_SHAPES["llama-1b"],),
        vocabs=(32768, 131072),
        batches=(1, 4, 16, 64),
        contexts=(512, 2048),
        prompt_tokens=(512,),
        train_vocabs=(32768,),
        train_batches=(1, 4),
        train_seq=512,
        op_vocabs=(32768, 131072),
        op_batches=(1, 64, 256),
        loop_steps=(1, 32),
        max_flops=5e14,
    )


def _test() -> Grid:
    return Grid(
        name="test",
        shapes=(BUILTIN_SHAPES["tiny"],),
        vocabs=(512,),
        batches=(2,),
        contexts=(16, 32),
        prompt_tokens=(16,),
        train_vocabs=(512,),
        train_batches=(2,),
        train_seq=16,
        op_vocabs=(512,),
        op_batches=(2,),
        decode_steps=4,
        max_flops=1e10,
        timing=TimingSettings(warmup=1, repeats=3, min_repeats=3),
    )


GRIDS = {
    "full": _full,
    "quick": _quick,
    "loops": _loops,
    "anchor": _anchor,
    "gpu": _gpu,
    "test": _test,
}


def get_grid(name: str) -> Grid:
    """A preset grid by name (``GRIDS``: full, quick, loops, anchor, gpu, test)."""
    if name not in GRIDS:
        raise UserError(f"unknown grid {name!r} (choose from {', '.join(GRIDS)})")
    return GRIDS[name]()
