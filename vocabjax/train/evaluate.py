"""What a run measures per head: held-out bits per byte and training throughput.

Bits per byte of head V on a held-out token stream x_0 .. x_n (every head sees the same text):

    bpb = sum_{i >= 1} CE_i / (ln 2 * sum_{i >= 1} bytes(x_i))

CE_i is the cross-entropy in nats of predicting x_i, over non-overlapping windows of T
predictions (context restarts at each window), and bytes(x_i) the UTF-8 bytes token x_i decodes
to (0 for the document separator, whose loss still counts). Dividing by bytes, not tokens, makes
heads of different V comparable.

Throughput of head V: tokens (B T) per second of one jitted training step (forward, backward,
optimizer update) that uses head V alone, timed after compiling, median of a few repeats on
fixed inputs; the measured tokens_per_s vs V of the training profile.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from vocabjax.errors import UserError
from vocabjax.train.data import HeadTokenizer, Windows, eval_windows
from vocabjax.train.steps import Functional, Params, make_eval_step, make_train_step, time_step


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """Bits per byte of one head on its held-out stream."""

    nats: float  # summed cross-entropy of the predicted tokens
    bytes: int  # UTF-8 bytes of the predicted tokens
    tokens: int  # predicted tokens (the stream's length - 1)

    @property
    def bpb(self) -> float:
        return self.nats / (math.log(2) * self.bytes)

    @property
    def bytes_per_token(self) -> float:
        """Bytes per text token (the separators, which stand for no text, left out)."""
        return self.bytes / self.tokens


def heldout_bpb(
    fn: Functional,
    params: Params,
    head: HeadTokenizer,
    ids: np.ndarray,
    *,
    seq_len: int,
    batch: int,
    impl: str,
    place: Callable[[np.ndarray], Any] | None = None,
) -> HeldOut:
    """Bits per byte of ``head`` on ``ids``; ``place`` lays each batch of windows out (on a
    mesh, beside parameters laid out there)."""
    inputs, labels = eval_windows(ids, seq_len, batch)
    nats_fn = make_eval_step(fn, head.vocab, impl)
    place = place or (lambda x: x)
    total = 0.0
    for i in range(inputs.shape[0]):
        total += float(nats_fn(params, place(inputs[i]), place(labels[i])))
    predicted = ids[1:]
    nbytes = int(head.token_bytes[predicted].sum())
    text_tokens = int((head.token_bytes[predicted] > 0).sum())
    if nbytes == 0:
        raise UserError(f"head {head.vocab}: the held-out tokens stand for no text")
    if not math.isfinite(total):
        raise UserError(f"head {head.vocab}: the held-out cross-entropy is not finite")
    return HeldOut(nats=total, bytes=nbytes, tokens=text_tokens)


def throughput(
    fn: Functional,
    params: Params,
    opt_state,
    tx,
    heads: Sequence[HeadTokenizer],
    windows: Sequence[Windows],
    *,
    batch: int,
    impl: str,
    repeats: int,
    shardings: tuple[Any, Any, Any, Any] | None = None,
    place: Callable[[np.ndarray], Any] | None = None,
) -> list[float]:
    """Training tokens per second of each head alone (B T tokens per step); ``shardings`` and
    ``place`` lay the step and its batch out on a mesh, as training does."""
    out = []
    place = place or (lambda x: x)
    for head, w in zip(heads, windows, strict=True):
        step = make_train_step(fn, (head.vocab,), tx, impl, shardings=shardings)
        batch_hbt = place(w.batch(0, batch)[None])
        seconds = time_step(step, params, opt_state, batch_hbt, repeats=repeats)
        out.append(batch * (batch_hbt.shape[-1] - 1) / seconds)
    return out
