"""The engine's on-device decode loop against a host loop of the same decode step, side by side.

    python cli.py train --out runs/tiny                    # once: a run to serve
    python benchmarks/decode_loop.py --run runs/tiny --batch 1,8 --tokens 96

The engine (``vocabjax.serving.Engine.generate``) runs every decode step of a batch in one
jitted ``lax.while_loop``. The baseline is what it did before: one jitted decode step per
token, called from Python, with the new tokens brought to the host after each step (to check
for the separator). Both run the same model, head, ``impl="auto"`` greedy pick and cache shape;
each is timed per decode token (median of ``--repeats`` rounds, alternating), compiling left
out. The engine's rows stop at the separator, so its token count is the one it produced.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _report import header  # noqa: E402

from vocabjax import render, unembed  # noqa: E402
from vocabjax.serving import Engine, load_run  # noqa: E402
from vocabjax.units import parse_size_list  # noqa: E402

PROMPT = "def main(argv):\n    "


def host_loop(run, head: int, batch: int, prompt_len: int):
    """A call that decodes ``n`` tokens for ``batch`` rows, one jitted step per token with a
    host sync after each (the baseline); returns seconds per token."""
    fn, max_seq = run.fn, run.max_seq

    def step(params, caches, token_b, pos_b):
        model = fn.model(params)
        h_b1d, caches = model.cached(token_b[:, None], caches, pos_b)
        return caches, unembed.greedy(h_b1d[:, 0], model.head(head), impl="auto")

    step_c = jax.jit(step, donate_argnums=(1,))
    init = jax.jit(lambda: fn.model(run.params).init_cache(batch, max_seq))

    def run_n(n: int) -> float:
        caches = init()
        token = np.zeros((batch,), np.int32)
        pos = np.full((batch,), prompt_len, np.int32)
        started = time.perf_counter()
        for _ in range(n):
            caches, token_b = step_c(run.params, caches, jnp.asarray(token), jnp.asarray(pos))
            token = np.asarray(token_b)  # the per-token host round trip
            pos = np.minimum(pos + 1, max_seq - 1)
        return (time.perf_counter() - started) / n

    run_n(2)  # compile and first-call set-up
    return run_n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run", required=True, help="a run directory written by `train`")
    p.add_argument("--head", default=None, help="head size (default: the largest)")
    p.add_argument("--batch", default="1,8", help="batch sizes (default 1,8)")
    p.add_argument("--tokens", type=int, default=96, help="decode tokens per row (default 96)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--format", choices=["table", "markdown"], default="table")
    args = p.parse_args(argv)
    run = load_run(args.run)
    head = int(args.head) if args.head else max(run.heads)
    engine = Engine(run)
    prompt_len = len(engine.encode([PROMPT], head)[0])
    tokens = min(args.tokens, run.max_seq - prompt_len)
    rows = []
    for batch in parse_size_list(args.batch, what="batch"):
        prompts = [PROMPT] * batch
        baseline = host_loop(run, head, batch, prompt_len)
        engine.generate(prompts, head=head, max_new_tokens=tokens)  # compile
        device_t, host_t, produced = [], [], 0
        for _ in range(args.repeats):
            out = engine.generate(prompts, head=head, max_new_tokens=tokens)
            per_row = out.decode_tokens / batch
            device_t.append(out.decode_s / max(per_row, 1))
            produced = out.decode_tokens
            host_t.append(baseline(tokens))
        d, h = statistics.median(device_t), statistics.median(host_t)
        rows.append(
            {
                "batch": batch,
                "engine_tokens": produced,
                "device loop ms/step": d * 1e3,
                "host loop ms/step": h * 1e3,
                "host / device": h / d,
                "device tokens/s": batch / d,
            }
        )
    header(
        __file__,
        argv,
        f"run {args.run} ({run.config.shape.name}), head {head}, prompt {prompt_len} tokens, "
        f"up to {tokens} decode steps",
    )
    print(render.rows(rows, args.format))
    return 0


if __name__ == "__main__":
    sys.exit(main())
