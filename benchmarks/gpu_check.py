"""One prepared check for a lent GPU: kernel correctness, the simulator against this card's own
timings, then autotune on a small grid.

    python benchmarks/gpu_check.py --out "$OUT"          # on the GPU machine (8-12 min?)
    python benchmarks/gpu_check.py --out "$OUT" --skip-autotune   # the first three (4-6 min?)

(The minutes are estimates: the validate step has not yet run on a card. The report is written
after every step, so a run cut off by a time limit keeps the steps it finished.)
    python benchmarks/gpu_check.py --cpu-try              # rehearsal here: interpreter, tiny grids

1. ``pallas_kernels.selfcheck.run_all``: every Pallas kernel compiled for this device (the
   interpreter on CPU) against its pure-jnp reference.
2. The public ops with ``impl="pallas"`` against ``impl="xla"`` at ragged shapes
   (V = 50,257, D = 768, B in 1, 3, 513; f32 and bf16): greedy ids' logits, logsumexp, top-k
   values, the sample (identical), cross-entropy loss and gradients.
3. ``validate`` on the ``gpu`` grid (vocabjax.validation: a Llama-like 1B model's decode
   loops, prefills, training steps and the ops, 75 points) priced on the builtin profile of
   this card (``h100-sxm``, ``h200``, ``a100-80gb``: calibrated on published kernel timings;
   else its ceilings measured now), the same points priced again on the card's datasheet
   profile, and ``--fit`` on them: how far the simulator's GPU profiles price this project's
   own steps on a real card (issue 10), before and after a fit on a third of them held out.
   Its f32 matmuls run at true float32 there, as they are priced (not JAX's default TF32).
   ``--skip-validate`` leaves it out.
4. ``autotune`` on a small grid (V in {32k, 131k}, B in {1, 16, 256}, D = 768, bf16; greedy and
   linear_cross_entropy), with at most ``--pallas-candidates`` tilings per kernel.
5. The GPU goals of issue 4 from those timings: fused decode >= 80% of the measured bandwidth
   for B <= 16 and no slower than XLA; compute-bound forward (B = 256) >= 0.95x XLA's FLOP/s;
   fused cross-entropy >= 0.9x XLA's throughput.

Writes ``gpu_check.json`` (everything), ``gpu_check.md`` (the tables), the validation run
``validation.json`` (``validate --from`` reads it), its calibrated profile
``validation_profile.json`` and autotune's measured device profile ``profile.json`` to
``--out``, the first two again after every step (a run cut short keeps what it finished);
prints the short goal table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from vocabjax import autotune as at  # noqa: E402
from vocabjax import render, timing, unembed, validation  # noqa: E402
from vocabjax.errors import UserError  # noqa: E402
from vocabjax.hardware import BUILTIN_DEVICES, DATASHEET, save_device  # noqa: E402
from vocabjax.outputs import atomic_write_text  # noqa: E402
from vocabjax.validation.fit import calibrate  # noqa: E402

# the builtin profile of each card this project has one for (by jax's device_kind), its
# efficiency tables fitted on published kernel timings (docs/gpu_calibration.md)
CARD_PROFILES = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb"))


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def public_op_checks(shapes, dtypes, interpret: bool, blocks) -> list[dict]:
    """impl="pallas" against impl="xla" through vocabjax.unembed, one row per (op, shape): a
    short block per op."""
    rows = []
    for dtype in dtypes:
        jdt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
        for batch, vocab, d in shapes:
            rng = np.random.default_rng(batch + vocab)
            h = jnp.asarray(rng.standard_normal((batch, d), dtype=np.float32)).astype(jdt)
            w = jnp.asarray(rng.standard_normal((vocab, d), dtype=np.float32) * (2 / np.sqrt(d)))
            w = w.astype(jdt)
            labels = jnp.asarray(rng.integers(0, vocab, size=batch, dtype=np.int32))
            key = jax.random.key(batch)
            kw = {"impl": "pallas", "interpret": interpret, "blocks": blocks}

            def logit_at(ids, h=h, w=w):
                rows_ = jnp.take(w, ids, axis=0).astype(jnp.float32)
                return np.asarray(
                    jnp.einsum("bd,bd->b", h.astype(jnp.float32), rows_, precision="highest")
                )

            where = f"B={batch} V={vocab} D={d}"

            def check(
                name,
                fn,
                h=h,
                w=w,
                kw=kw,
                labels=labels,
                key=key,
                logit_at=logit_at,
                where=where,
                dtype=dtype,
            ):
                row = {"op": name, "shape": where, "dtype": dtype}
                try:
                    got = fn(h, w, labels, key, kw)
                    ref = fn(h, w, labels, key, {"impl": "xla"})
                    err, ok = _compare(name, got, ref, logit_at, dtype)
                    row.update(max_abs_err=err, ok=ok)
                except Exception as exc:
                    row.update(
                        max_abs_err=float("nan"),
                        ok=False,
                        error=f"{type(exc).__name__}: {exc}"[:300],
                    )
                rows.append(row)
                say(f"public op {name} {row['shape']} {dtype}: {'ok' if row['ok'] else 'FAILED'}")

            check("greedy", lambda h, w, lab, key, kw: unembed.greedy(h, w, **kw))
            check("logsumexp", lambda h, w, lab, key, kw: unembed.logsumexp(h, w, **kw))
            check("top_k", lambda h, w, lab, key, kw: unembed.top_k(h, w, 10, **kw))
            check("sample", lambda h, w, lab, key, kw: unembed.sample(h, w, key, 0.8, **kw))
            check(
                "linear_cross_entropy",
                lambda h, w, lab, key, kw: jax.value_and_grad(
                    lambda h, w: unembed.linear_cross_entropy(h, w, lab, z_loss=1e-4, **kw),
                    argnums=(0, 1),
                )(h, w),
            )
    return rows


def _compare(name, got, ref, logit_at, dtype):
    """(max abs error, ok): values within 1e-3 of their scale; gradients within 1e-4 of their
    scale in f32 and 2^-7 in bf16 (two bf16 results, each within 2^-8 of the scale of the
    truth, as pallas_kernels.selfcheck bounds them, differ by at most 2^-7)."""
    if name == "greedy":
        a, b = logit_at(got), logit_at(ref)
        err = float(np.max(np.abs(a - b)))
        return err, err <= 1e-3 * max(1.0, float(np.max(np.abs(b))))
    if name == "sample":
        same = float(np.mean(np.asarray(got) == np.asarray(ref)))
        return 1.0 - same, same >= 0.99
    if name == "top_k":
        a, b = np.asarray(got[0], np.float64), np.asarray(ref[0], np.float64)
    elif name == "logsumexp":
        a, b = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    else:
        (loss, (dh, dw)), (rloss, (rdh, rdw)) = got, ref
        errs, ok = [], True
        for x, y in ((loss, rloss), (dh, rdh), (dw, rdw)):
            x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
            e = float(np.max(np.abs(x - y)))
            errs.append(e)
            tol = 2**-7 if dtype == "bf16" else 1e-4
            ok = ok and np.isfinite(e) and e <= tol * max(float(np.max(np.abs(y))), 1e-30)
        return max(errs), bool(ok)
    err = float(np.max(np.abs(a - b)))
    return err, bool(np.isfinite(err) and err <= 1e-3 * max(1.0, float(np.max(np.abs(b)))))


def goals(run: at.Run, d_model: int) -> list[dict]:
    """The issue's GPU goals from the autotune timings of one run: one row per goal, each its
    measured figure, its threshold and its verdict, hence the length."""
    prof, ceilings = run.profile, run.ceilings
    out = []
    for r_best in prof.best:
        point = [
            r
            for r in prof.kernels
            if (r.op, r.vocab, r.batch) == (r_best.op, r_best.vocab, r_best.batch)
        ]
        xla = [r for r in point if r.impl == "xla"]
        pallas = [r for r in point if r.impl == "pallas"]
        if not xla or not pallas:
            continue
        x, p = xla[0], min(pallas, key=lambda r: r.time_s)
        flops, bytes_ = unembed.unembed_cost(
            r_best.op,
            vocab=r_best.vocab,
            batch=r_best.batch,
            d_model=d_model,
            dtype=r_best.dtype,
        )
        where = {"op": r_best.op, "vocab": r_best.vocab, "batch": r_best.batch}
        if r_best.op == "greedy" and r_best.batch <= 16:
            frac = bytes_ / p.time_s / ceilings.hbm_bandwidth
            out.append(
                {
                    **where,
                    "goal": "fused decode bandwidth / measured",
                    "value": frac,
                    "target": ">= 0.80",
                    "met": frac >= 0.80,
                }
            )
            out.append(
                {
                    **where,
                    "goal": "fused decode time / xla",
                    "value": p.time_s / x.time_s,
                    "target": "<= 1.0",
                    "met": p.time_s <= x.time_s,
                }
            )
        elif r_best.op == "greedy":
            ratio = x.time_s / p.time_s
            out.append(
                {
                    **where,
                    "goal": "compute-bound forward FLOP/s vs xla",
                    "value": ratio,
                    "target": ">= 0.95",
                    "met": ratio >= 0.95,
                }
            )
        if r_best.op == "linear_cross_entropy":
            ratio = x.time_s / p.time_s
            out.append(
                {
                    **where,
                    "goal": "fused CE throughput vs xla",
                    "value": ratio,
                    "target": ">= 0.90",
                    "met": ratio >= 0.90,
                }
            )
            chunked = [r for r in point if r.impl == "chunked"]
            if chunked:  # the other path with no N x V buffer: the one-pass row tiles
                ratio = x.time_s / min(r.time_s for r in chunked)
                out.append(
                    {
                        **where,
                        "goal": "chunked CE throughput vs xla",
                        "value": ratio,
                        "target": "(context)",
                        "met": "-",
                    }
                )
        del flops
    return out


def card_profile(device) -> str:
    """The builtin profile of ``device``'s card, or ``validate``'s ``measure`` (its ceilings
    measured now) for a card with none."""
    kind = str(getattr(device, "device_kind", "")).upper()
    return next((name for needle, name in CARD_PROFILES if needle in kind), validation.MEASURE)


def validation_step(out: Path, profile: str, grid: str) -> dict:
    """``validate`` on ``grid`` priced on ``profile``, the same points priced on its datasheet
    variant (where it has one) and fitted (``validate --fit``): the error tables, with the run
    and the calibrated profile written to ``out``."""
    v = validation.validate(profile, grid, progress=say)
    result = {
        "headline": validation.headline(v),
        "profile": v.device.name,
        "before": validation.summary_rows(v),
    }
    try:
        cal = calibrate(v)
    except UserError as exc:  # a grid too small to fit on (the CPU rehearsal's)
        cal, result["fit_error"] = None, str(exc)
    doc = validation.document(v, command=f"gpu_check: validate --grid {grid} --fit", calibrated=cal)
    atomic_write_text(out / "validation.json", json.dumps(doc, indent=2) + "\n")
    if cal is not None:
        save_device(cal.fit.profile, out / "validation_profile.json")
        result["held_out_before"] = validation.summary_rows(v, cal.held_out(v.results))
        result["held_out_after"] = validation.summary_rows(v, cal.held_out(cal.after))
    sheet = profile + DATASHEET
    if sheet in BUILTIN_DEVICES:
        again = validation.read_validation(out / "validation.json", sheet)
        result["datasheet"] = {"profile": sheet, "rows": validation.summary_rows(again)}
    return result


def markdown_report(report: dict) -> str:
    """gpu_check.md: every table of ``report`` so far."""
    md = [f"# gpu_check: {report['header']}", "", "## Pallas kernels against their references", ""]
    md.append(
        render.markdown(
            report["selfcheck"], ["kernel", "shape", "dtype", "max_abs_err", "ok", "error"]
        )
    )
    if "public_ops" in report:
        md += ["", "## Public ops, impl=pallas against impl=xla", ""]
        md.append(
            render.markdown(
                report["public_ops"], ["op", "shape", "dtype", "max_abs_err", "ok", "error"]
            )
        )
    val = report.get("validation")
    if val is not None:
        md += ["", "## The simulator against this card (validate)", ""]
        if "error" in val:
            md.append(f"validate failed: {val['error']}")
        else:
            md += [val["headline"], "", f"Every point, priced on `{val['profile']}`:", ""]
            md.append(render.markdown(val["before"]))
            if "datasheet" in val:
                md += ["", f"The same points priced on `{val['datasheet']['profile']}`:", ""]
                md.append(render.markdown(val["datasheet"]["rows"]))
            if "held_out_after" in val:
                md += ["", "Held-out points (a third, never fitted), before the fit:", ""]
                md.append(render.markdown(val["held_out_before"]))
                md += ["", "and after it (`validation_profile.json`):", ""]
                md.append(render.markdown(val["held_out_after"]))
            if "fit_error" in val:
                md += ["", f"not fitted: {val['fit_error']}"]
    if "autotune" in report:
        md += ["", "## Ceilings", "", render.markdown(report["ceilings"]), "", "## Autotune", ""]
        md.append(render.markdown(report["autotune"]))
        if report["failures"]:
            md += ["", "## Failed candidate checks", "", render.markdown(report["failures"])]
        md += [
            "",
            "## Goals",
            "",
            render.markdown(report["goals"]) if report["goals"] else "(no pallas timings)",
        ]
    if "seconds" in report:
        md += ["", f"total {report['seconds']:.0f} s"]
    return "\n".join(md) + "\n"


def write(out: Path, report: dict) -> None:
    """gpu_check.json and gpu_check.md as they stand (after every step)."""
    atomic_write_text(out / "gpu_check.json", json.dumps(report, indent=2, default=str) + "\n")
    atomic_write_text(out / "gpu_check.md", markdown_report(report))


def main(argv=None) -> int:
    """The GPU check as one script, in the order it runs and prints: the device, the kernels' own
    checks, the public ops, the simulator against this card, autotune's timings and the goals.
    Long because each step is a few lines of calls and a table, read top to bottom as the run's
    log; the report is written again after every step."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--out", default="gpu_check_out", help="folder for gpu_check.{json,md} and the profiles"
    )
    p.add_argument(
        "--cpu-try", action="store_true", help="rehearse on CPU: interpreter, tiny shapes and grids"
    )
    p.add_argument("--pallas-candidates", type=int, default=3)
    p.add_argument("--skip-autotune", action="store_true")
    p.add_argument("--skip-validate", action="store_true")
    p.add_argument(
        "--validate-grid",
        default=None,
        choices=sorted(validation.GRIDS),
        help="the grid validate times [gpu; --cpu-try: test]",
    )
    p.add_argument(
        "--validate-profile",
        default=None,
        help="the profile validate prices on [this card's builtin (CARD_PROFILES), else "
        "measure; --cpu-try: measure]",
    )
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    interpret = not on_gpu
    device = jax.devices()[0]
    header = (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, device "
        f"{getattr(device, 'device_kind', device.platform)} ({device.platform}), jax {jax.__version__}"
        + (", Pallas interpreter (CPU rehearsal)" if interpret else "")
    )
    say(header)
    report: dict = {"header": header}

    from pallas_kernels import selfcheck

    try:
        kernel_rows = selfcheck.run_all(interpret=interpret)
    except Exception:
        kernel_rows = [{"kernel": "selfcheck", "ok": False, "error": traceback.format_exc(limit=3)}]
    for r in kernel_rows:
        r.pop("traceback", None)
        say(
            f"selfcheck {r.get('kernel')} {r.get('shape')} {r.get('dtype')}: {'ok' if r.get('ok') else 'FAILED'}"
        )
    report["selfcheck"] = kernel_rows
    write(out, report)

    if args.cpu_try:
        shapes, blocks = [(3, 1000, 100), (37, 1000, 100)], None
    else:
        shapes, blocks = [(1, 50257, 768), (3, 50257, 768), (513, 50257, 768)], None
    report["public_ops"] = public_op_checks(shapes, ("f32", "bf16"), interpret, blocks)
    write(out, report)

    if not args.skip_validate:
        grid = args.validate_grid or ("test" if args.cpu_try else "gpu")
        profile = args.validate_profile or (
            validation.MEASURE if args.cpu_try else card_profile(device)
        )
        try:
            report["validation"] = validation_step(out, profile, grid)
        except Exception:  # the other steps still run
            report["validation"] = {"error": traceback.format_exc(limit=3)}
            say(report["validation"]["error"])
        write(out, report)

    goal_rows: list[dict] = []
    if not args.skip_autotune:
        if args.cpu_try:
            grid = dict(vocabs=(1000, 4096), batches=(1, 16), d_model=64, dtype="f32")
            settings = dataclasses.replace(
                timing.TimingSettings.quick(),
                copy_bytes=32 * 2**20,
                matmul_n={"f32": 512, "bf16": 512},
                pallas_candidates=1,
            )
        else:
            grid = dict(vocabs=(32768, 131072), batches=(1, 16, 256), d_model=768, dtype="bf16")
            settings = dataclasses.replace(
                timing.TimingSettings(), pallas_candidates=args.pallas_candidates
            )
        run = at.autotune(
            **grid,
            ops=("greedy", "linear_cross_entropy"),
            settings=settings,
            progress=say,
            include_interpret=interpret,
        )
        save_device(run.profile, out / "profile.json")
        report["ceilings"] = run.ceiling_rows()
        report["autotune"] = run.table_rows()
        report["failures"] = [dataclasses.asdict(f) for f in run.failures]
        goal_rows = goals(run, grid["d_model"])
        report["goals"] = goal_rows
    report["seconds"] = time.perf_counter() - t0
    write(out, report)

    n_bad = sum(not r.get("ok") for r in kernel_rows) + sum(
        not r["ok"] for r in report["public_ops"]
    )
    print(
        f"{header}: {len(kernel_rows)} kernel checks, {len(report['public_ops'])} public-op checks, "
        f"{n_bad} failed; {report['seconds']:.0f} s; wrote {out}/gpu_check.md"
    )
    val = report.get("validation")
    if val is not None and "before" in val:
        every = next(r for r in val["before"] if r["group"] == "all")
        print(
            f"validate on {val['profile']}: {every['n']} points, "
            f"{every['median_abs_error_pct']:.1f}% median, {every['max_abs_error_pct']:.0f}% worst"
        )
    elif val is not None:
        print("validate failed (gpu_check.md says how)")
    if goal_rows:
        print(render.table(goal_rows, ["goal", "op", "vocab", "batch", "value", "target", "met"]))
    else:
        print("no goal rows (no Pallas timings in this run)")
    return 1 if n_bad or (val is not None and "error" in val) else 0


if __name__ == "__main__":
    sys.exit(main())
