"""vocabjax command line: parse, call the library, render. No logic lives here.

python cli.py sweep                       # V* over (V, B, lambda) on builtin defaults
python cli.py sweep --device h100-sxm --model llama-8b --format json
"""

from __future__ import annotations

import functools
import math
import os
import sys
from pathlib import Path

import click

import vocabjax
from vocabjax import render
from vocabjax.compression import load_compression
from vocabjax.costmodel import COST_MODES, CostModel, Settings
from vocabjax.errors import UserError
from vocabjax.hardware import BUILTIN_DEVICES, DEFAULT_DEVICE, calibration_note, load_device
from vocabjax.lifecycle import (
    DEFAULT_BATCH,
    DEFAULT_LAM,
    DEFAULT_TOLERANCE,
    DEFAULT_VOCAB,
    Grid,
    Quality,
    check_grid_fits,
    sweep_json,
    sweep_rows,
    sweep_tables,
    train_optimal_vocab,
)
from vocabjax.lifecycle import sweep as sweep_grid
from vocabjax.outputs import atomic_write_json, check_file_target
from vocabjax.planning import kv_table, make_plan, parse_workload, policy_json
from vocabjax.plots import check_plot_path, plot_sweep
from vocabjax.serving.controller import DEFAULT_BAND, DEFAULT_WINDOW
from vocabjax.serving.mixing import MIXING
from vocabjax.serving.records import BATCHING, DEFAULT_MAX_BATCH, DEFAULT_MAX_NEW_TOKENS
from vocabjax.shapes import BUILTIN_SHAPES, DEFAULT_MODEL, load_shape
from vocabjax.trainprofile import load_training
from vocabjax.units import (
    BATCH_RANGE,
    BYTES_MAX,
    BYTES_RANGE,
    D_MODEL_RANGE,
    LAM_MAX,
    SIZE_MAX,
    STEPS_RANGE,
    TOKENS_RANGE,
    VOCAB_RANGE,
    parse_float,
    parse_float_list,
    parse_size,
    parse_size_list,
)

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# library setting -> the flag that sets it, where the two are not spelled alike
_FLAGS = {
    "shape": "--model",
    "corpus.spec": "--corpus",
    "run_dir": "--out",
}


def flag(setting: str) -> str:
    """The command-line flag of a library setting (``max_new_tokens`` -> ``--max-new-tokens``,
    corpus fields by their own name), as error messages name it."""
    if setting in _FLAGS:
        return _FLAGS[setting]
    return "--" + setting.removeprefix("corpus.").replace("_", "-")


class _Group(click.Group):
    """A click group that turns the library's UserError into one ``Error: ...`` line."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            raise click.ClickException(exc.render(flag)) from None
        except OSError as exc:  # a file-system failure no check foresaw: still one line
            where = f" {exc.filename!r}" if exc.filename else ""
            raise click.ClickException(f"cannot access{where}: {exc.strerror or exc}") from None


class _Parsed(click.ParamType):
    """A click type backed by one of vocabjax.units' parsers; its UserError becomes click's
    "Invalid value for '--opt': ..." line (exit 2)."""

    def __init__(self, name: str, parse) -> None:
        self.name = name
        self._parse = parse

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value  # a default already parsed, or a value passed from Python
        try:
            return self._parse(value, what=param.name if param else self.name)
        except UserError as exc:
            self.fail(str(exc), param, ctx)


class OutputFile(click.ParamType):
    """A file the command will write: checked when parsed, so before any work starts
    (``vocabjax.outputs.check_file_target``; figures by ``plots.check_plot_path``)."""

    name = "file"

    def __init__(self, *, figure: bool = False) -> None:
        self._figure = figure

    def convert(self, value, param, ctx):
        from vocabjax.outputs import check_file_target

        try:
            if self._figure:
                return str(check_plot_path(value))
            return str(check_file_target(value, what=param.opts[-1] if param else "output"))
        except UserError as exc:
            self.fail(str(exc), param, ctx)


def SizeList(bounds: tuple[int, int] = (1, SIZE_MAX)) -> click.ParamType:  # noqa: N802
    """``8k,32k,262k`` -> [8192, 32768, 262144], each within ``bounds`` (vocabjax.units)."""
    lo, hi = bounds
    return _Parsed("LIST", functools.partial(parse_size_list, minimum=lo, maximum=hi))


def Size(bounds: tuple[int, int] = (1, SIZE_MAX)) -> click.ParamType:  # noqa: N802
    """``8k``, ``65536``, ``1m``, within ``bounds``."""
    lo, hi = bounds
    return _Parsed("N", functools.partial(parse_size, minimum=lo, maximum=hi))


def Float(minimum: float = 0.0, maximum: float = math.inf) -> click.ParamType:  # noqa: N802
    """``4096``, ``1e3``: finite and within ``minimum..maximum``."""
    return _Parsed("FLOAT", functools.partial(parse_float, minimum=minimum, maximum=maximum))


def FloatList(minimum: float = 0.0, maximum: float = math.inf) -> click.ParamType:  # noqa: N802
    """``0,1,10,100`` -> [0.0, 1.0, 10.0, 100.0]; finite and within ``minimum..maximum``."""
    return _Parsed("LIST", functools.partial(parse_float_list, minimum=minimum, maximum=maximum))


def format_option(f):
    return click.option(
        "--format",
        "fmt",
        type=click.Choice(render.FORMATS),
        default="table",
        show_default=True,
        help="Output format; json prints JSON alone on stdout.",
    )(f)


def emit(text: str) -> None:
    click.echo(text)


def log(message: str) -> None:
    """Progress and notes go to stderr so that stdout stays machine-readable."""
    click.echo(message, err=True)


@click.group(cls=_Group, context_settings=CONTEXT)
@click.version_option(vocabjax.__version__, "--version", prog_name="vocabjax")
def main() -> None:
    """Choose the tokenizer vocabulary size for how the model will be served.

    \b
    Example:
        python cli.py sweep                                   # builtin defaults
        python cli.py sweep --device a10g --batch 1,64 --format markdown
        python cli.py plan --workload "edge:b=1:share=0.5,dc:b=256:share=0.5" --lam 100
    """


# ---- simulator: sweep, plan -----------------------------------------------------------------


def _cost_options(f):
    """Options shared by sweep and plan: what is simulated, and how. Declarations only, one
    ``click.option`` each, which is all that makes it long; sharing them keeps the two commands'
    flags, defaults and help alike."""
    options = [
        click.option(
            "--device",
            "devices",
            multiple=True,
            default=[DEFAULT_DEVICE],
            show_default=True,
            help=f"Builtin device ({', '.join(BUILTIN_DEVICES)}) or an autotune .json; repeatable.",
        ),
        click.option(
            "--model",
            "models",
            multiple=True,
            default=[DEFAULT_MODEL],
            show_default=True,
            help=f"Builtin shape ({', '.join(BUILTIN_SHAPES)}) or a .json/.toml shape; repeatable.",
        ),
        click.option(
            "--vocab",
            type=SizeList(VOCAB_RANGE),
            default=",".join(str(v) for v in DEFAULT_VOCAB),
            help="Vocabulary sizes to sweep, e.g. 8k,32k,262k.  [default: 8k..512k, x2]",
        ),
        click.option(
            "--compression",
            default="default",
            show_default=True,
            help="Bytes-per-token curve: 'default' or a `tokenizer measure` profile .json.",
        ),
        click.option(
            "--training",
            type=click.Path(dir_okay=False),
            help="Training profile .json (`train`): measured tokens/s and BPB per V.",
        ),
        click.option(
            "--bpb-tolerance",
            type=Float(0.0, 1e6),
            default=None,
            help="With --training: keep only V within this relative BPB of the best (0.02 = 2%).",
        ),
        click.option(
            "--prompt-bytes",
            type=Float(0.0, BYTES_MAX),
            default=Settings.prompt_bytes,
            show_default=True,
            help="Prompt bytes per sequence (S_in).",
        ),
        click.option(
            "--output-bytes",
            type=Float(0.0, BYTES_MAX),  # 0 passes here; Settings says it must be > 0
            default=Settings.output_bytes,
            show_default=True,
            help="Generated bytes per sequence (S_out).",
        ),
        click.option(
            "--cost-model",
            "mode",
            type=click.Choice(COST_MODES),
            default="full",
            show_default=True,
            help="full, or weights-only (drops attention and KV terms, as the paper compares).",
        ),
        click.option(
            "--dtype",
            type=click.Choice(["bf16", "f32"]),
            default="bf16",
            show_default=True,
            help="Weight dtype: bytes per weight and which peak FLOP/s applies.",
        ),
        click.option(
            "--fused-logits",
            is_flag=True,
            help="Assume fused unembedding + sampling (and a fused cross-entropy in training): "
            "the logits never reach memory.",
        ),
        click.option(
            "--include-prefill",
            is_flag=True,
            help="Charge each sequence's prompt prefill to its generated bytes.",
        ),
        click.option(
            "--cap-batch/--no-cap-batch",
            default=True,
            show_default=True,
            help="Cost each batch at the largest one whose weights and KV cache fit on the "
            "device (marked *); --no-cap-batch: the roofline of B however much memory it needs "
            "(marked ! where it does not fit).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _build_models(
    devices, models, compression, training, bpb_tolerance, dtype, cap_batch, **settings
):
    curve = load_compression(compression)
    train = load_training(training) if training else None
    if bpb_tolerance is not None and train is None:
        raise UserError("--bpb-tolerance needs --training with measured bpb")
    quality = Quality(train, bpb_tolerance) if bpb_tolerance is not None else None
    s = Settings(weight_dtype=dtype, **settings)
    built = [
        CostModel(load_device(d), load_shape(m), s, curve, train) for d in devices for m in models
    ]
    for cm in built:
        if cm.measured_unembed is None and cm.device.best:
            have = sorted({r.dtype for r in cm.device.best if r.op == "greedy"})
            log(
                f"note: {cm.device.name} has measured 'greedy' times for "
                f"{', '.join(have) or 'no dtype'}, not {cm.settings.weight_dtype}; "
                "the unembedding term uses the roofline of the measured ceilings"
            )
        if cm.measured_unembed is not None:
            log(
                f"{cm.device.name}: decode unembedding from measured kernel times "
                f"(d_model={cm.measured_unembed.d_model})"
            )
    for device in {cm.device.name: cm.device for cm in built}.values():
        log(calibration_note(device))
    return built, quality, curve


def _curve_note(curve, vocab) -> None:
    outside = [v for v in vocab if not curve.covers(v)]
    if outside:
        log(
            f"note: compression curve {curve.name!r} measured {curve.vocab[0]}..{curve.vocab[-1]}; "
            f"held flat at {', '.join(map(str, outside))}"
        )


@main.command(context_settings=CONTEXT)
@_cost_options
@click.option(
    "--batch",
    type=SizeList(BATCH_RANGE),
    default=",".join(str(b) for b in DEFAULT_BATCH),
    show_default=True,
    help="Serving batch sizes B.",
)
@click.option(
    "--lam",
    type=FloatList(0.0, LAM_MAX),
    default=",".join(f"{x:g}" for x in DEFAULT_LAM),
    show_default=True,
    help="lambda = bytes served / bytes trained.",
)
@click.option(
    "--plot", type=OutputFile(figure=True), help="Write a figure (.png): V* map, cost vs V."
)
@click.option(
    "--break-even",
    "show_break_even",
    is_flag=True,
    help="Also print break-even lambda per (V, B) (always in --format json).",
)
@click.option(
    "--tolerance",
    type=Float(0.0, 10.0),
    default=DEFAULT_TOLERANCE,
    show_default=True,
    help="Band of V* per cell: every V whose J is within this fraction of J at V*.",
)
@format_option
def sweep(devices, models, vocab, batch, lam, plot, show_break_even, tolerance, fmt, **kw):
    """V* = argmin_V c_train(V) + lambda c_infer(V, B) over a (V, B, lambda) grid.

    \b
    Example:
        python cli.py sweep
        python cli.py sweep --device a10g --device h100-sxm --model llama-8b --format markdown
        python cli.py sweep --cost-model weights-only --plot vstar.png
    """
    grid = Grid(vocab=tuple(vocab), batch=tuple(batch), lam=tuple(lam))
    check_grid_fits(grid)
    built, quality, curve = _build_models(devices, models, **kw)
    _curve_note(curve, grid.vocab)
    runs = [
        (cm, sweep_grid(cm, grid, cap_batch=kw["cap_batch"], quality=quality, tolerance=tolerance))
        for cm in built
    ]
    if plot:
        plot_sweep(runs, plot, caption="python cli.py " + " ".join(sys.argv[1:]))
        log(f"wrote {plot}")
    if fmt == "json":
        emit(render.json_text(sweep_json(runs)))
    elif fmt == "csv":
        emit(render.rows([row for cm, res in runs for row in sweep_rows(cm, res)], "csv"))
    else:
        for cm, res in runs:
            emit(_sweep_text(cm, res, fmt, break_even=show_break_even))


def _sweep_text(cm, res, fmt: str, *, break_even: bool) -> str:
    """One sweep's tables (``lifecycle.sweep_tables``) with their headline and legend."""
    tables = sweep_tables(cm, res)
    ridge = cm.device.ridge_point(cm.settings.weight_dtype)
    out = [
        f"V* on {cm.device.name} (ridge {ridge:.0f} FLOP/B), {cm.shape.name}, "
        f"{cm.settings.mode} cost model, compression: {cm.compression.name}",
        render.rows(tables.v_star, fmt),
        _sweep_legend(res),
    ]
    if tables.share is not None:
        out.append(f"\nhow sure: {res.share_note}; the share that picks the V* above")
        out.append(render.rows(tables.share, fmt))
    else:
        out.append(f"how sure: not known; {res.share_note}")
    if break_even:
        v_t = render.human_size(train_optimal_vocab(res))
        out.append(f"\nbreak-even lambda against the training optimum V_t = {v_t}")
        out.append(render.rows(tables.break_even, fmt))
    return "\n".join(out) + "\n"


def _sweep_legend(res) -> str:
    lines = [
        f"[band]: every V whose J is within {100 * res.tolerance:g}% of J at V* "
        f"(--tolerance), on {len(res.fine_vocab)} sizes from "
        f"{render.approx_size(res.fine_vocab[0])} to {render.approx_size(res.fine_vocab[-1])}"
    ]
    if res.capped:
        if res.batch_capped.any():
            lines.append(
                "*: B does not fit in device memory there; costed at the largest batch that "
                "does (batch_run in --format json; --no-cap-batch for the uncapped roofline)"
            )
    elif not res.fits.all():
        lines.append("!: B does not fit in device memory there (weights and KV cache)")
    return "\n".join(lines)


@main.command(context_settings=CONTEXT)
@_cost_options
@click.option(
    "--workload",
    required=True,
    help='Traffic classes: "edge:b=1:share=0.5,dc:b=256:share=0.5" (optional in=/out= bytes).',
)
@click.option(
    "--lam",
    type=Float(0.0, LAM_MAX),
    required=True,
    help="lambda = bytes served / bytes trained.",
)
@click.option(
    "--max-heads",
    type=click.IntRange(1, 8),
    default=3,
    show_default=True,
    help="Largest number of nested heads to consider.",
)
@click.option("--out", type=OutputFile(), help="Write the policy JSON for `serve`.")
@format_option
def plan(devices, models, vocab, workload, lam, max_heads, out, fmt, **kw):
    """Best single V and best nested heads for a mixed workload; writes policy.json.

    \b
    Example:
        python cli.py plan --workload "edge:b=1:share=0.5,dc:b=256:share=0.5" --lam 100 \\
            --out policy.json
    """
    if len(devices) > 1 or len(models) > 1:
        raise UserError("plan takes one --device and one --model")
    classes = parse_workload(workload)
    built, quality, curve = _build_models(devices, models, **kw)
    cm = built[0]
    _curve_note(curve, vocab)
    result = make_plan(
        cm, vocab, classes, lam, max_heads=max_heads, cap_batch=kw["cap_batch"], quality=quality
    )
    policy = policy_json(result, cm, max_heads=max_heads)
    if out:
        atomic_write_json(out, policy)
        log(f"wrote {out}")
    emit(render.json_text(policy) if fmt == "json" else _plan_text(policy, cm, fmt))


def _plan_text(policy: dict, cm: CostModel, fmt: str) -> str:
    """A policy (``planning.policy_json``) as ``plan`` prints it: the best single V and heads,
    each class's route, the batch routes, break-even lambda and the KV plan, and the decode step
    per op at the largest head for the last class's batch."""
    hs = render.human_size
    out = [
        f"plan on {cm.device.name}, {cm.shape.name}, lambda={policy['lam']:g}, "
        f"{cm.settings.mode} cost model",
        f"best single V: {hs(policy['single']['vocab'])}  "
        f"(J = {policy['single']['cost_per_byte']:.4g} s per training byte)",
        f"best nested heads: {', '.join(hs(v) for v in policy['heads'])}  "
        f"(J = {policy['cost_per_byte']:.4g}, "
        f"{100 * policy['saving_vs_single']:.2f}% below single)",
        "",
        render.rows(policy["routes"], fmt),
    ]
    misfit = [r["name"] for r in policy["routes"] if not r["fits"]]
    if misfit:
        out.append(
            f"! {', '.join(misfit)}: the class's batch does not fit beside its head's weights "
            + (
                "; costed at batch_run, the largest that does"
                if policy["cap_batch"]
                else "; costed uncapped (--no-cap-batch)"
            )
        )
    routes = (
        (f"B<={r['max_batch']}: " if r["max_batch"] else "larger: ")
        + hs(r["head"])
        + ("" if r["fits"] else f" (! fits B<={r['b_max']})")
        for r in policy["batch_routes"]
    )
    head, batch = policy["heads"][-1], policy["routes"][-1]["batch"]
    out += [
        "\nbatch routes: " + ", ".join(routes),
        f"\nbreak-even lambda against the training optimum {hs(policy['train_optimal_vocab'])} "
        "(mixed workload) and KV-cache plan",
        render.rows(kv_table(policy), fmt),
        f"\ndecode step per op at {hs(head)}, B={batch}",
        render.rows(cm.breakdown(head, batch), fmt),
    ]
    return "\n".join(out)


# ---- tokenizers: tokenizer train / measure / prune ------------------------------------------


@main.group("tokenizer", context_settings=CONTEXT)
def tokenizer_group() -> None:
    """Train nested BPE tokenizers, measure their compression, prune them.

    \b
    Example:
        python cli.py tokenizer train --corpus builtin --vocab 8k,16k,32k --out tok
        python cli.py tokenizer measure --tokenizer tok --corpus builtin --out compression.json
        python cli.py sweep --compression compression.json
        python cli.py tokenizer prune --tokenizer tok --corpus builtin --vocab 4k --out tok-4k
    """


def _corpus_options(split: str):
    """--corpus and how to read it; ``split`` is the command's default part."""

    def decorate(f):
        from vocabjax.corpus import BUILTIN_MAX_BYTES, SPLITS

        options = [
            click.option(
                "--corpus",
                "corpus_spec",
                required=True,
                metavar="PATH|builtin|builtin-prose",
                help="A file, directory or glob of .txt/.jsonl/.parquet (also .gz/.zst), "
                "'builtin': Python's standard library (code-heavy text), or 'builtin-prose': "
                "English documentation this machine ships (made here, never downloaded).",
            ),
            click.option(
                "--field",
                default="text",
                show_default=True,
                help="Text field of .jsonl records and column of .parquet files.",
            ),
            click.option(
                "--split",
                type=click.Choice(SPLITS),
                default=split,
                show_default=True,
                help="Documents to use: the train or held-out part (by document hash), or all.",
            ),
            click.option(
                "--held-out",
                type=click.FloatRange(0, 1),
                default=0.1,
                show_default=True,
                help="Fraction of documents in the held-out part.",
            ),
            click.option(
                "--max-bytes",
                type=Size(BYTES_RANGE),
                default=None,
                help="Read at most this much text before the split, e.g. 64m [default: "
                f"all; {render.human_size(BUILTIN_MAX_BYTES)} for builtin].",
            ),
        ]
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


def _corpus_inputs(corpus_spec) -> tuple[str, ...]:
    """The corpus path an output directory must not replace (none for builtin or a glob)."""
    return (corpus_spec,) if os.path.exists(corpus_spec) else ()


def _open_corpus(corpus_spec, field, held_out, max_bytes):
    from vocabjax.corpus import default_max_bytes, open_corpus

    if max_bytes is None:
        max_bytes = default_max_bytes(corpus_spec)
    return open_corpus(corpus_spec, field=field, held_out=held_out, max_bytes=max_bytes)


@tokenizer_group.command("train", context_settings=CONTEXT)
@_corpus_options("train")
@click.option(
    "--vocab",
    type=SizeList(VOCAB_RANGE),
    required=True,
    help="Level sizes, e.g. 8k,32k,262k: one training at the largest, the rest cut.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    required=True,
    help="Output directory: manifest.json and v<V>/tokenizer.json per level.",
)
@click.option(
    "--force", is_flag=True, help="Replace --out even if it holds files that are not levels."
)
@click.option(
    "--special",
    "specials",
    multiple=True,
    default=["<|endoftext|>"],
    show_default=True,
    help="Special token (ids 0..); repeatable.",
)
@format_option
def tokenizer_train(
    corpus_spec, field, split, held_out, max_bytes, vocab, out, force, specials, fmt
):
    """Train one byte-level BPE at the largest size and cut every smaller level from it.

    \b
    Example:
        python cli.py tokenizer train --corpus builtin --vocab 8k,16k,32k --out tok
        python cli.py tokenizer train --corpus 'data/*.jsonl.zst' --vocab 32k,262k --out tok
    """
    from vocabjax.vocab import check_nested_out, check_vocab_sizes, save_nested, train_nested

    check_vocab_sizes(vocab, specials)
    check_nested_out(out, force=force, inputs=_corpus_inputs(corpus_spec))
    corpus = _open_corpus(corpus_spec, field, held_out, max_bytes)
    log(f"corpus: {corpus.describe(split)}")
    nested = train_nested(corpus.texts(split, progress=log), vocab, specials=specials, progress=log)
    source = f"tokenizer train --corpus {corpus_spec} --vocab {','.join(map(str, vocab))}"
    manifest = save_nested(nested, out, corpus=corpus.describe(split), source=source, force=force)
    log(f"wrote {len(manifest['levels'])} level(s) to {out}")
    if fmt == "json":
        emit(render.json_text(manifest))
    else:
        emit(render.rows(manifest["levels"], fmt))


_pattern_option = click.option(
    "--pattern",
    metavar="NAME|REGEX",
    help="Split regex of tiktoken rank files: cl100k, gpt2, llama3, o200k, tekken, or a regex "
    "[default: recognized from the file's content].",
)


@tokenizer_group.command("measure", context_settings=CONTEXT)
@click.option(
    "--tokenizer",
    "specs",
    multiple=True,
    required=True,
    metavar="DIR|FILE",
    help="A level directory, a tokenizer.json (or its directory), a tiktoken BPE rank file, "
    "a Mistral tekken*.json, or (with the sentencepiece package) a SentencePiece model; "
    "repeatable.",
)
@_corpus_options("heldout")
@_pattern_option
@click.option(
    "--cut",
    type=SizeList(VOCAB_RANGE),
    help="Also measure each rank file (tiktoken, Tekken) cut to these sizes: its specials and "
    "first ranks, the tokenizer its own training would have made at that size.",
)
@click.option(
    "--out",
    type=OutputFile(),
    help="Write the compression profile here (for sweep --compression).",
)
@format_option
def tokenizer_measure(
    specs, corpus_spec, field, split, held_out, max_bytes, pattern, cut, out, fmt
):
    """Bytes and characters per token of each tokenizer on a corpus (held-out part by default).

    \b
    Example:
        python cli.py tokenizer measure --tokenizer tok --corpus builtin --out compression.json
        python cli.py tokenizer measure --tokenizer a/tokenizer.json \\
            --tokenizer cl100k_base.tiktoken --corpus docs/ --split all --format json
        python cli.py tokenizer measure --tokenizer tekken.json --cut 32k,64k \\
            --corpus builtin-prose --out tekken-curve.json   # V alone on Tekken's own data
    """
    from vocabjax.vocab import compression_profile, curve_notes, cut_ranks, load_tokenizers, measure
    from vocabjax.vocab.measure import read_ahead

    corpus = _open_corpus(corpus_spec, field, held_out, max_bytes)
    texts = read_ahead(corpus.texts(split))  # a bad corpus fails before any tokenizer loads
    tokenizers = [t for spec in specs for t in load_tokenizers(spec, pattern=pattern)]
    if cut:
        ranked = [t for t in tokenizers if t.ranks is not None]
        if not ranked:
            raise UserError("--cut cuts rank files (tiktoken, Tekken); no tokenizer given is one")
        tokenizers += [cut_ranks(t, v) for t in ranked for v in cut if v < t.vocab]
    label = corpus.describe(split)
    log(f"corpus: {label}; {len(tokenizers)} tokenizer(s)")
    points = measure(tokenizers, texts, progress=log)
    source = "tokenizer measure " + " ".join(f"--tokenizer {s}" for s in specs)
    if pattern is not None:
        source += f" --pattern {pattern}"
    if cut:
        source += " --cut " + ",".join(map(str, cut))
    source += f" --corpus {corpus_spec} --split {split}"
    profile = compression_profile(points, corpus=label, source=source)
    notes = curve_notes(points)
    if notes:
        profile["notes"] = notes
    if out:
        atomic_write_json(out, profile)
        log(f"wrote compression profile {out}")
    for note in notes:
        log(f"Note: {note}")
    if fmt == "json":
        emit(render.json_text(profile))
        return
    rows = [
        {
            "vocab": p.vocab,
            "bytes_per_token": p.bytes_per_token,
            "chars_per_token": p.chars_per_token,
            "ci95_lo": p.ci95[0],
            "ci95_hi": p.ci95[1],
            "tokens": p.tokens,
            "bytes": p.bytes,
            "documents": p.documents,
            "tokenizer": p.tokenizer,
        }
        for p in points
    ]
    if fmt != "csv":
        emit(f"corpus: {label}")
    emit(render.rows(rows, fmt))


@tokenizer_group.command("prune", context_settings=CONTEXT)
@click.option(
    "--tokenizer",
    "spec",
    required=True,
    metavar="DIR|FILE",
    help="Source: a level directory (its largest level), a tokenizer.json or a rank file.",
)
@_corpus_options("all")
@click.option(
    "--vocab",
    type=Size(VOCAB_RANGE),
    required=True,
    help="Exact size of the pruned tokenizer, e.g. 32k.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    required=True,
    help="Output directory: tokenizer.json and id_map.json (new id -> source id).",
)
@click.option(
    "--force", is_flag=True, help="Replace --out even if it holds files that are not a pruning."
)
@_pattern_option
@format_option
def tokenizer_prune(
    spec, corpus_spec, field, split, held_out, max_bytes, vocab, out, force, pattern, fmt
):
    """Prune a byte-level BPE to exactly N tokens, keeping those most used on a corpus.

    A kept token keeps the merges that build it; a dropped one takes every merge that makes or
    uses it. Embedding rows follow id_map.json: w_new = w_old[new_to_old].

    \b
    Example:
        python cli.py tokenizer prune --tokenizer tok --corpus builtin --vocab 4k --out tok-4k
    """
    from vocabjax.vocab import check_prune_out, load_largest, prune_to_dir

    source = load_largest(spec, pattern=pattern)
    inputs = (spec, *_corpus_inputs(corpus_spec))
    check_prune_out(out, source=source.path, force=force, inputs=inputs)
    corpus = _open_corpus(corpus_spec, field, held_out, max_bytes)
    label = corpus.describe(split)
    log(f"pruning {source.path} ({source.vocab} tokens) to {vocab} on {label}")
    meta = prune_to_dir(
        source,
        corpus.texts(split, progress=log),
        vocab,
        out,
        corpus=label,
        progress=None,
        force=force,
    )
    log(f"wrote {out}/tokenizer.json and {out}/id_map.json")
    if fmt == "json":
        emit(render.json_text(meta))
    else:
        emit(
            render.rows(
                [meta],
                fmt,
                columns=[
                    "source",
                    "source_vocab",
                    "vocab",
                    "merges",
                    "kept_by_use",
                    "kept_to_fill",
                    "corpus_tokens",
                ],
            )
        )


# ---- training: train --------------------------------------------------------------------------


def _mesh_spec(text: str):
    from vocabjax.train.mesh import MeshSpec

    return MeshSpec.parse(text)


_TRAIN_FIELDS = {  # option -> RunConfig field (corpus fields as corpus.<name>)
    "model": "shape",
    "heads": "heads",
    "tokenizer": "tokenizer",
    "corpus_spec": "corpus.spec",
    "field": "corpus.field",
    "held_out": "corpus.held_out",
    "max_bytes": "corpus.max_bytes",
    "steps": "steps",
    "seq_len": "seq_len",
    "batch": "batch",
    "lr": "lr",
    "warmup": "warmup",
    "seed": "seed",
    "eval_tokens": "eval_tokens",
    "eval_bytes": "eval_bytes",
    "impl": "impl",
    "checkpoint_every": "checkpoint_every",
    "compute_dtype": "compute_dtype",
    "init_from": "init_from",
    "prune_to": "prune_to",
    "heads_kind": "heads_kind",
    "align_weight": "align_weight",
}


@main.command("train", context_settings=CONTEXT)
@click.option(
    "--model",
    default=None,
    help=f"Builtin shape ({', '.join(BUILTIN_SHAPES)}) or a .json/.toml shape [default: tiny; "
    "the --init-from run's].",
)
@click.option(
    "--tokenizer",
    type=click.Path(file_okay=False),
    help="Nested tokenizer directory (`tokenizer train`), or a pruned one (`tokenizer prune`) "
    "[default: train one at the heads' sizes into OUT/tokenizer].",
)
@click.option(
    "--heads",
    type=SizeList(VOCAB_RANGE),
    default=None,
    help="Head vocabulary sizes: tokenizer levels (or cut from its largest level) "
    "[default: 1k,2k,4k].",
)
@click.option(
    "--steps", type=Size(STEPS_RANGE), default=250, show_default=True, help="Optimizer steps."
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    required=True,
    help="Run directory: run.json, checkpoint/, training.json (for sweep --training).",
)
@click.option("--resume", is_flag=True, help="Continue the run in --out to --steps in all.")
@click.option(
    "--corpus",
    "corpus_spec",
    default="builtin",
    show_default=True,
    metavar="PATH|builtin|builtin-prose",
    help="A file, directory or glob of .txt/.jsonl/.parquet (also .gz/.zst), 'builtin' "
    "(code-heavy) or 'builtin-prose' (English documentation this machine ships).",
)
@click.option("--field", default="text", show_default=True, help="Text field of .jsonl / .parquet.")
@click.option(
    "--held-out",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=0.1,
    show_default=True,
    help="Fraction of documents held out (by content hash) for bits per byte.",
)
@click.option(
    "--max-bytes",
    type=Size(BYTES_RANGE),
    default=None,
    help="Read at most this much text before the split [default: all; 2m for a builtin corpus].",
)
@click.option(
    "--seq-len",
    type=Size(TOKENS_RANGE),
    default=None,
    help="Tokens per window T [default: 128; the --init-from run's].",
)
@click.option(
    "--batch",
    type=Size(BATCH_RANGE),
    default=8,
    show_default=True,
    help="Windows per head per step.",
)
@click.option("--lr", type=float, default=3e-3, show_default=True, help="Peak learning rate.")
@click.option(
    "--warmup",
    type=click.IntRange(0),
    default=None,
    help="Linear warm-up steps, then cosine decay to lr/10 [default: steps/10, at most 100].",
)
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help="Random seed.")
@click.option(
    "--eval-tokens",
    type=Size(TOKENS_RANGE),
    default="32k",
    show_default=True,
    help="Held-out tokens of the smallest head to evaluate (all heads get the same text).",
)
@click.option(
    "--eval-bytes",
    type=Size(BYTES_RANGE),
    default=None,
    help="Instead of --eval-tokens: the held-out part's first bytes of text, the same text "
    "whatever the tokenizer (to compare runs at different V).",
)
@click.option(
    "--impl",
    type=click.Choice(["auto", "xla", "chunked"]),
    default="auto",
    show_default=True,
    help="linear_cross_entropy implementation.",
)
@click.option(
    "--checkpoint-every",
    type=click.IntRange(0),
    default=100,
    show_default=True,
    help="Steps between checkpoints (0: only at the end).",
)
@click.option(
    "--compute-dtype",
    type=click.Choice(["f32", "bf16"]),
    default=None,
    help="Matmul dtype (parameters and optimizer state stay f32) [default: f32; the "
    "--init-from run's].",
)
@click.option(
    "--heads-kind",
    type=click.Choice(["nested", "separate"]),
    default="nested",
    show_default=True,
    help="nested: each head is a prefix W[:V] of one matrix; separate: one matrix per head on "
    "the shared backbone.",
)
@click.option(
    "--align-weight",
    type=Float(0.0),
    default=0.0,
    show_default=True,
    help="With --heads-kind separate: weight of the loss that pulls the heads' rows of the same "
    "token together (their relative squared distance, averaged over pairs of heads; 0 equal, "
    "about 2 unrelated), added to the mean cross-entropy.",
)
@click.option(
    "--mesh",
    type=_Parsed("data=N[,model=M]", lambda text, what: _mesh_spec(text)),
    help="Train on N x M of jax.devices(): each step's windows split over data, the embedding "
    "and head matrices split along V over model (docs/training.md) [default: one device].",
)
@click.option(
    "--init-from",
    type=click.Path(file_okay=False),
    help="Start from this run (trained at a larger V): its embedding and head rows gathered "
    "through the pruned tokenizer's id map, the rest copied (the paper's pruned initialisation).",
)
@click.option(
    "--prune-to",
    type=Size(VOCAB_RANGE),
    help="With --init-from: the vocabulary to train at. Without --tokenizer, the run's "
    "tokenizer is pruned to it on the corpus's train part (into OUT/tokenizer); with one, "
    "--tokenizer is a `tokenizer prune` output of the run's tokenizer.",
)
@format_option
@click.pass_context
def train_command(ctx, out, resume, fmt, **options):
    """Train a GPT with nested vocabulary heads; measure held-out bits per byte and tokens/s
    per head into OUT/training.json (for sweep --training).

    \b
    Example:
        python cli.py train --out runs/tiny                   # tiny model, heads 1k,2k,4k
        python cli.py train --tokenizer tok --heads 8k,16k,32k --model paper-100m \\
            --steps 2000 --out runs/100m
        python cli.py train --out runs/100m --steps 4000 --resume
        python cli.py sweep --training runs/tiny/training.json --vocab 1k,2k,4k
        python cli.py train --init-from runs/tiny --prune-to 2k --steps 100 --out runs/pruned
        python cli.py train --mesh data=4 --batch 16 --out runs/dp   # 4 devices, data-parallel
    """
    from click.core import ParameterSource

    from vocabjax.train import RunConfig, resume_config, train

    mesh = options.pop("mesh")
    for name in ("tokenizer", "init_from"):
        if options[name] is not None:
            options[name] = str(Path(options[name]).absolute())
    if options["heads"] is not None:
        options["heads"] = tuple(sorted(options["heads"]))
    if options["model"] is not None:
        options["model"] = load_shape(options["model"])
    settings = {
        _TRAIN_FIELDS[name]: value
        for name, value in options.items()
        if not resume or ctx.get_parameter_source(name) != ParameterSource.DEFAULT
    }
    config = resume_config(out, settings) if resume else RunConfig.from_settings(settings)
    result = train(config, out, resume=resume, progress=log, mesh=mesh)
    if fmt == "json":
        emit(render.json_text(result.to_json()))
        return
    columns = ["vocab", "train_loss", "bpb", "tokens_per_s", "bytes_per_token", "eval_tokens"]
    if fmt != "csv":
        emit(
            f"{result.config.shape.name} after {result.step} steps on {result.device}; "
            f"held-out bits per byte and training tokens/s per head (tokens/s from "
            f"{result.timing})"
        )
    rows = result.rows()
    if fmt != "csv":
        rows = [{**r, "tokens_per_s": round(r["tokens_per_s"])} for r in rows]
    emit(render.rows(rows, fmt, columns=columns))


# ---- serving: generate, serve --------------------------------------------------------------


def _sampling_options(f):
    """--temperature and --top-k, as generate and serve take them."""
    f = click.option(
        "--top-k", type=click.IntRange(1), help="Sample among the k most likely tokens."
    )(f)
    return click.option(
        "--temperature",
        type=click.FloatRange(0),
        default=0.0,
        show_default=True,
        help="0: greedy (argmax); above 0: sample softmax(logits / temperature).",
    )(f)


def _parse_head(text: str, *, what: str = "head"):
    """``auto`` or a size (``4k``, ``4096``)."""
    if str(text).strip().lower() == "auto":
        return "auto"
    return parse_size(text, what=what, minimum=VOCAB_RANGE[0], maximum=VOCAB_RANGE[1])


@main.command("generate", context_settings=CONTEXT)
@click.option(
    "--run",
    "run_dir",
    type=click.Path(file_okay=False),
    required=True,
    help="Run directory written by `train` (run.json, checkpoint/, tokenizer).",
)
@click.option(
    "--prompt",
    "prompts",
    multiple=True,
    required=True,
    help="Text to continue; repeat for a batch (one sequence each).",
)
@click.option(
    "--head",
    type=_Parsed("auto|SIZE", _parse_head),
    default="auto",
    show_default=True,
    help="Head vocabulary size, one of the run's heads; auto: the policy's route for this "
    "batch size, or the largest head.",
)
@click.option(
    "--policy",
    type=click.Path(dir_okay=False),
    help="Policy .json (`plan --out`): with --head auto, its batch route picks the head.",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(1),
    default=64,
    show_default=True,
    help="Most tokens generated per prompt (fewer at <|endoftext|> or the run's seq-len).",
)
@_sampling_options
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help="Sampling seed.")
@format_option
def generate(run_dir, prompts, head, policy, max_new_tokens, temperature, top_k, seed, fmt):
    """Continue prompts with a trained run at one of its nested heads (jitted KV-cache decode).

    \b
    Example:
        python cli.py train --out runs/tiny
        python cli.py generate --run runs/tiny --prompt "def main(" --max-new-tokens 32
        python cli.py generate --run runs/tiny --prompt "import " --prompt "class " --head 1k \\
            --temperature 0.8 --top-k 40 --seed 1 --format json
        python cli.py generate --run runs/tiny --prompt "x = " --policy policy.json
    """
    from vocabjax.serving import Engine, Sampling, load_policy, load_run
    from vocabjax.serving import generate as generate_batch

    sampling = Sampling(temperature=temperature, top_k=top_k, seed=seed)
    routes = load_policy(policy) if policy else None
    run = load_run(run_dir)
    if policy and head != "auto":
        log(f"note: --head {head} given; the policy's routes are not used")
    out = generate_batch(
        Engine(run), prompts, head=head, routes=routes, max_new_tokens=max_new_tokens,
        sampling=sampling, progress=log,
    )  # fmt: skip
    if fmt == "json":
        emit(render.json_text(out.to_json()))
        return
    t = out.generation.timing()
    rows = out.rows()
    if fmt == "table":
        for i, r in enumerate(rows, 1):
            emit(
                f"[{i}] head {r['head']}: {r['prompt_tokens']} prompt tokens, "
                f"{r['new_tokens']} new (stop: {r['stop']})"
            )
            emit(r["prompt"] + r["text"])
            emit("")
        rate = t["decode_tokens_per_s"]
        emit(
            f"prefill {t['prefill_ms']:.2f} ms; decode "
            + ("-" if rate is None else f"{rate:,.0f} tokens/s")
            + f" (B={t['batch']}, after compiling)"
        )
        return
    if fmt == "markdown":  # one line per cell
        rows = [
            {k: v.replace("|", "\\|").replace("\n", "\\n") if isinstance(v, str) else v
             for k, v in r.items()}
            for r in rows
        ]  # fmt: skip
    emit(render.rows([{**r, **_timing_columns(t)} for r in rows], fmt))


def _timing_columns(t: dict) -> dict:
    return {"prefill_ms": t["prefill_ms"], "decode_tokens_per_s": t["decode_tokens_per_s"]}


@main.command("serve", context_settings=CONTEXT)
@click.option(
    "--run",
    "run_dir",
    type=click.Path(file_okay=False),
    required=True,
    help="Run directory written by `train` (run.json, checkpoint/, tokenizer).",
)
@click.option(
    "--policy",
    type=click.Path(dir_okay=False),
    required=True,
    help="Policy .json (`plan --out`): its batch routes pick the head for each batch size.",
)
@click.option(
    "--trace",
    type=click.Path(dir_okay=False),
    help="Requests, JSONL: {id, arrival_s, prompt, max_new_tokens} per line [default: --demo].",
)
@click.option(
    "--demo",
    is_flag=True,
    help="Serve a demo trace built from the builtin corpus (the default without --trace).",
)
@click.option(
    "--save-trace",
    type=OutputFile(),
    help="Also write the served trace (the demo's, say) as JSONL for --trace.",
)
@click.option(
    "--max-batch",
    type=click.IntRange(1),
    default=DEFAULT_MAX_BATCH,
    show_default=True,
    help="Most requests in one batch (static) or running at one head (continuous).",
)
@click.option(
    "--batching",
    type=click.Choice(BATCHING),
    default="continuous",
    show_default=True,
    help="continuous: requests join a running batch between decode steps and leave when they "
    "stop; static: a batch runs to its end before the next is admitted.",
)
@click.option(
    "--memory",
    type=_Parsed("SIZE", lambda text, what: parse_size(text, what=what, maximum=BYTES_MAX)),
    help="Memory budget of the KV plan that continuous batching admits within (2g, 80g) "
    "[default: the device's memory; 2g on a CPU].",
)
@click.option(
    "--mixing",
    type=click.Choice(MIXING),
    default=MIXING[0],
    help="Continuous batching: requests at different heads share one decode step (each row "
    "over its own prefix of W) or run as separate groups [default: auto: whichever the cost "
    "model prices cheaper for the mix].",
)
@click.option(
    "--device",
    "device_spec",
    help="Device profile (builtin name or .json) that prices --mixing auto [default: "
    "$VOCABJAX_DEVICE_PROFILE, else the a100-80gb datasheet].",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(1),
    default=DEFAULT_MAX_NEW_TOKENS,
    show_default=True,
    help="Tokens generated per request unless its trace line says.",
)
@click.option(
    "--window",
    type=click.IntRange(1),
    default=DEFAULT_WINDOW,
    show_default=True,
    help="Requests in the quality controller's windowed bits per byte.",
)
@click.option(
    "--bpb-high",
    type=Float(0.0, 1e6),
    help="Move a level up above this windowed BPB [default: (1 + band) x the run's largest "
    "held-out BPB].",
)
@click.option(
    "--bpb-low",
    type=Float(0.0, 1e6),
    help="Move a level down below this windowed BPB [default: (1 - band) x the run's smallest "
    "held-out BPB].",
)
@click.option(
    "--bpb-band",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=DEFAULT_BAND,
    show_default=True,
    help="Relative band around the held-out BPB for the default thresholds.",
)
@click.option(
    "--no-prompt-scoring",
    "score_prompts",
    flag_value=False,
    default=True,
    help="Do not score prompts (an unembedding of every prompt position in each prefill): no "
    "prompt bits per byte, and so no quality controller.",
)
@click.option(
    "--prefill-ahead",
    type=click.IntRange(0),
    default=16,
    show_default=True,
    help="Continuous batching (a trace or --port): when more requests wait than rows are free, "
    "prefill up to this many together, staging those without a row until rows free (0: only "
    "those with a row).",
)
@click.option(
    "--first-stop",
    "priced_stops",
    flag_value=False,
    default=True,
    help="Continuous batching (a trace or --port): end every decode call at the first row "
    "that stops, instead of waiting for as many stops as the cost model prices worth one "
    "return to the host (--device's round trip against the rows left idle).",
)
@_sampling_options
@click.option(
    "--seed",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Seed of the demo trace and of sampling.",
)
@click.option(
    "--plot", type=OutputFile(figure=True), help="Write a figure (.png): head and BPB over time."
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    help="Serve HTTP on this port (POST /v1/completions, GET /health, /metrics; needs the serve "
    "extra) instead of replaying a trace; the trace or demo then sizes the KV plan.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address --port listens on.")
@click.option(
    "--warmup",
    type=click.Choice(["greedy", "sampled"]),
    is_flag=False,
    flag_value="greedy",
    help="With --port: compile every device call greedy requests can need (each head, row "
    "bucket, prompt length, attention window and stage size) before the port opens, so that no "
    "request waits for the compiler (minutes on a CPU). '--warmup sampled' also compiles those "
    "of requests sampled at any temperature (half as many shapes again); a top_k's bucket (16, "
    "64, 256, ...) compiles when first met.",
)
@click.option(
    "--compile-cache",
    type=click.Path(file_okay=False),
    help="With --port: keep compiled shapes in this directory (JAX's persistent compilation "
    "cache) so that a restarted server's --warmup loads them instead of compiling again.",
)
@format_option
def serve(
    run_dir, policy, trace, demo, save_trace, plot, fmt, port, host, warmup, compile_cache,
    **options,
):  # fmt: skip
    """Serve a trace of requests with a trained run on a virtual clock: requests join running
    batches (continuous batching, within the KV plan of --memory), the policy's router picks a
    head per admission, the quality controller moves it a level up or down on the prompts' bits
    per byte.

    \b
    Example:
        python cli.py train --out runs/tiny
        python cli.py plan --model tiny --vocab 1k,2k,4k --lam 100 --out policy.json \\
            --workload "edge:b=1:share=0.5,dc:b=256:share=0.5"
        python cli.py serve --run runs/tiny --policy policy.json --demo
        python cli.py serve --run runs/tiny --policy policy.json --trace trace.jsonl --format json
        python cli.py serve --run runs/tiny --policy policy.json --batching static
        python cli.py serve --run runs/tiny --policy policy.json --port 8000
        curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
            -d '{"prompt": "def main(", "max_tokens": 16}'
    """
    from vocabjax.serving import Engine, ServeConfig, load_serve_inputs, write_trace
    from vocabjax.serving import serve as serve_trace

    if trace and demo:
        raise UserError("give --trace FILE or --demo, not both")
    if port is not None and (plot or options["batching"] == "static"):
        raise UserError(
            "--port serves live traffic with continuous batching: no --plot or --batching static"
        )
    if port is None and (warmup or compile_cache):
        raise click.UsageError("--warmup and --compile-cache are for --port: give --port")
    if compile_cache:
        use_compile_cache(compile_cache)
    if port is not None and not options["score_prompts"]:
        raise UserError("--port reports windowed bits per byte in /metrics: no --no-prompt-scoring")
    config = ServeConfig.from_options(options)
    inputs = load_serve_inputs(
        run_dir, policy, trace=trace, seed=options["seed"], max_new_tokens=config.max_new_tokens,
        bpb_high=options["bpb_high"], bpb_low=options["bpb_low"], bpb_band=options["bpb_band"],
        progress=log,
    )  # fmt: skip
    requests, thresholds = inputs.requests, inputs.thresholds
    if not config.score_prompts:
        thresholds = None  # the controller reads the prompts' scores
    if trace:
        log(f"trace {trace}: {_trace_note(requests)}")
    else:
        note = "" if demo else " (no --trace given)"
        log(f"demo trace{note}: {_trace_note(requests)} from the builtin corpus's held-out part")
    if save_trace:
        log(f"wrote {write_trace(save_trace, requests)}")
    log(_controller_note(thresholds, config))
    if port is not None:
        _serve_port(inputs, config, host, port, warmup)
        return
    result = serve_trace(
        Engine(inputs.run), requests, inputs.routes, config, thresholds=thresholds, progress=log
    )
    if plot:
        from vocabjax.plots import plot_serve

        plot_serve(result, plot, caption="python cli.py " + " ".join(sys.argv[1:]))
        log(f"wrote {plot}")
    device, priced = _priced(inputs.run, result)
    if fmt == "json":
        doc = result.to_json(**inputs.context())
        doc["priced"] = {"device": calibration_note(device), "calls": [p.row() for p in priced]}
        emit(render.json_text(doc))
    elif fmt != "table":
        emit(render.rows([b.row() for b in result.batches], fmt))
    else:
        _serve_table(result)
        emit(f"\ndevice calls against the cost model's price ({calibration_note(device)})")
        emit(render.rows([p.row() for p in priced], "table"))


def _priced(run, result):
    """The device the served calls are priced on (serve's --device, else the one mixing is
    priced on) and each kind of call, measured against predicted, then all together."""
    from vocabjax.serving.mixing import default_device
    from vocabjax.serving.pricing import CallPricer, total

    device = result.config.device or default_device()[0]
    priced = CallPricer.of(run, device).served(result)
    return device, [*priced, total(priced)]


def _serve_port(inputs, config, host: str, port: int, warmup: str | None) -> None:
    """``serve --port``: the HTTP endpoint until Ctrl-C has drained it; ``warmup``: every shape
    greedy (or also sampled) requests can need compiled first (``LiveServer.compile_shapes``)."""
    try:
        from vocabjax.serving.http import serve_http
    except ImportError as exc:
        raise UserError(
            f"serve --port needs FastAPI and uvicorn ({exc.name} is missing): "
            "pip install 'vocabjax[serve]'"
        ) from None
    from vocabjax.serving import live_server

    log("the KV plan is sized for traffic like that trace")
    live = live_server(inputs, config, progress=log)
    if warmup:
        what = "greedy" if warmup == "greedy" else "greedy and sampled"
        log(f"warm-up: compiling every shape {what} requests can need, before the port opens")
        shapes, seconds = live.compile_shapes(sampled=warmup == "sampled")
        log(f"warm-up: {shapes} shapes compiled in {seconds:.1f} s")
    serve_http(live, host=host, port=port, log=log)


def use_compile_cache(directory: str) -> None:
    """JAX's persistent compilation cache in ``directory``, for every compile however short (a
    serving shape compiles in well under JAX's default threshold of a second)."""
    import jax

    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _controller_note(thresholds, config) -> str:
    if not config.score_prompts:
        return "quality controller off: prompts are not scored (--no-prompt-scoring)"
    if thresholds is None:
        return (
            "quality controller off: the run has no held-out bits per byte (training.json) "
            "and --bpb-high/--bpb-low are not given"
        )
    return (
        f"quality controller: up above {thresholds.high:.3f}, down below "
        f"{thresholds.low:.3f} bits per byte over {config.window} requests "
        f"({thresholds.source})"
    )


def _serve_table(result) -> None:
    """``serve``'s table: the summary in four lines, then per head, per phase and switches."""
    s = result.summary()
    emit(
        f"served {s['requests']} requests in {s['batches']} batches "
        f"({s['generated_tokens']:,} tokens generated)"
    )
    emit(
        f"virtual clock: {s['makespan_s']:.2f} s from the first arrival to the last finish, "
        f"{s['busy_s']:.3f} s of it busy: {_rate(s['tokens_per_s'])} tokens/s over the span, "
        f"{_rate(s['busy_tokens_per_s'])} while busy (compiling {s['compile_s']:.1f} s, not on "
        "the clock)"
    )
    emit(
        f"latency p50 {1e3 * s['latency_p50_s']:.1f} ms, p95 {1e3 * s['latency_p95_s']:.1f} ms; "
        f"mean queue wait {1e3 * s['queue_mean_s']:.1f} ms; mean prompt BPB "
        + ("not scored" if s["mean_prompt_bpb"] is None else f"{s['mean_prompt_bpb']:.3f}")
    )
    emit(
        f"switches: {s['router_switches']} by the router, {s['controller_moves']} by the controller"
    )
    emit(_batching_line(result))
    emit("\nper head")
    emit(render.rows(result.head_rows(), "table"))
    if result.phase_rows():
        emit("\nper phase")
        emit(render.rows(result.phase_rows(), "table"))
    if result.switches:
        emit("\nswitches")
        rows = [
            {"time_s": round(w.time_s, 3), "batch": w.batch, "from": w.from_head,
             "to": w.to_head, "by": w.by, "why": w.reason}
            for w in result.switches
        ]  # fmt: skip
        emit(render.rows(rows, "table"))


def _batching_line(result) -> str:
    """How the requests shared the device: running batch, queue wait and, for continuous
    batching, the memory they waited for."""
    s = result.summary()
    line = (
        f"{s['batching']} batching: running batch mean {s['running_mean']:.1f}, max "
        f"{s['running_max']}; queue wait p95 {1e3 * s['queue_p95_s']:.1f} ms"
    )
    if result.memory is None:
        return line
    from vocabjax.serving.admission import human_bytes

    mixed = f"; {s['mixed_steps']:,} decode steps with heads mixed" if s["mixed_steps"] else ""
    mixed += f"; {s['merges']} group merge(s)" if s["merges"] else ""
    return line + (
        f"; KV cache peak {human_bytes(s['kv_peak_bytes'] or 0)} of "
        f"{human_bytes(result.memory.kv_budget)}; {s['memory_waits']} request(s) waited for memory"
        + mixed
    )


def _rate(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _trace_note(requests) -> str:
    """``136 requests over 63.2 s, prompts of 128-240 bytes``."""
    span = requests[-1].arrival_s - requests[0].arrival_s
    sizes = [len(r.prompt.encode("utf-8")) for r in requests]
    phases = list(dict.fromkeys(r.phase for r in requests if r.phase))
    note = f"{len(requests)} requests arriving over {span:.1f} s, prompts of {min(sizes)}-"
    note += f"{max(sizes)} bytes"
    if phases:
        counts = [sum(r.phase == p for r in requests) for p in phases]
        note += "; phases: " + ", ".join(f"{p} ({n})" for p, n in zip(phases, counts, strict=True))
    return note


# ---- kernels: autotune ----------------------------------------------------------------------


def _op_list(ctx, param, value):
    from vocabjax.unembed import OPS

    if value is None:
        return None
    ops = [v.strip() for v in value.split(",") if v.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise click.BadParameter(f"{', '.join(bad) or repr(value)} (choose from {', '.join(OPS)})")
    return list(dict.fromkeys(ops))


@main.command(context_settings=CONTEXT)
@click.option(
    "--vocab",
    type=SizeList(VOCAB_RANGE),
    help="Vocabulary sizes V [default: 8k..512k; quick 8k,32k,128k].",
)
@click.option(
    "--batch", type=SizeList(BATCH_RANGE), help="Batch sizes B [default: 1..512; quick 1,8,64]."
)
@click.option(
    "--d-model",
    type=Size(D_MODEL_RANGE),
    default=768,
    show_default=True,
    help="d_model of the served model.",
)
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "f32"]),
    default="bf16",
    show_default=True,
    help="Weight dtype of the unembedding.",
)
@click.option(
    "--ops",
    callback=_op_list,
    help="Comma-separated ops to time [default: all five; quick: greedy,linear_cross_entropy].",
)
@click.option("--quick", is_flag=True, help="Small grid and fewer repeats: minutes on a CPU.")
@click.option(
    "--out",
    type=OutputFile(),
    help="Device profile to write (atomically) [default: profiles/<device>.json].",
)
@format_option
def autotune(vocab, batch, d_model, dtype, ops, quick, out, fmt):
    """Measure this device's ceilings and time every unembedding kernel; write a device profile.

    \b
    Example:
        python cli.py autotune --quick                     # CPU: a few minutes
        python cli.py autotune --vocab 32k,128k --batch 1,64 --d-model 2048 --out gpu.json
        python cli.py sweep --device profiles/cpu.json     # uses the measured ceilings and times
    """
    from vocabjax import autotune as at
    from vocabjax.hardware import save_device
    from vocabjax.timing import TimingSettings

    settings = TimingSettings.quick() if quick else TimingSettings()
    out = out or str(check_file_target(at.default_out(), what="--out"))
    run = at.autotune(
        vocabs=vocab or (at.QUICK_VOCABS if quick else at.DEFAULT_VOCABS),
        batches=batch or (at.QUICK_BATCHES if quick else at.DEFAULT_BATCHES),
        d_model=d_model,
        dtype=dtype,
        ops=ops or (at.QUICK_OPS if quick else at.unembed.OPS),
        settings=settings,
        progress=log,
    )
    path = save_device(run.profile, out)
    log(
        f"wrote {path} ({len(run.profile.kernels)} timings, {len(run.failures)} failed checks, "
        f"{len(run.unconfirmed)} winners not confirmed against xla, {run.seconds:.0f} s)"
    )
    for f in run.failures:
        log(f"failed check: {f.op} V={f.vocab} B={f.batch} {f.impl} {f.blocks}: {f.error}")
    if fmt == "json":
        emit(render.json_text(run.profile.to_json()))
        return
    emit(f"ceilings of {run.profile.name} ({run.profile.source})")
    emit(render.rows(run.ceiling_rows(), fmt))
    emit("")
    emit(render.rows(run.table_rows(), fmt))


# ---- validation: validate -------------------------------------------------------------------


@main.command(context_settings=CONTEXT)
@click.option(
    "--device",
    default=None,
    help="Profile the predictions come from: 'measure' (this machine's ceilings, measured "
    "first in a few seconds), a builtin name, or an autotune .json "
    "(python cli.py autotune --quick --dtype f32) [default: measure; with --from, the "
    "profile the saved run priced with].",
)
@click.option("--quick", is_flag=True, help="A small grid: a few minutes on two CPU cores.")
@click.option(
    "--by-shape",
    is_flag=True,
    help="Time each model shape's points as a round-robin of their own, the other shapes' "
    "arrays freed (a point can run slower beside them; docs/validation.md).",
)
@click.option(
    "--warm",
    is_flag=True,
    help="Call each point back to back, the cache not evicted between calls, as a serving "
    "loop calls its steps: fit on such runs to price serving on a CPU whose last-level cache "
    "holds the model (docs/validation.md, 'Warm calls') [default: evicted before every call].",
)
@click.option(
    "--from",
    "saved",
    type=click.Path(dir_okay=False),
    multiple=True,
    help="Time nothing: read a run that --out saved and price its measured points again with "
    "today's cost model (and --fit them). Repeat it to combine runs: each point's median over "
    "the runs that timed it (runs of several grids, full and loops, give their union).",
)
@click.option(
    "--grid",
    "grid_name",
    type=click.Choice(["full", "quick", "loops", "anchor", "gpu", "test"]),
    help="A preset grid by name [default: full; --quick: quick; --anchor: anchor]: loops times "
    "decode loops of 1, 8 and 32 steps a call alone, to fit beside the full grid; anchor a "
    "minute of steps; gpu a Llama-like 1B model for an accelerator (test: seconds, for the "
    "test suite).",
)
@click.option(
    "--fit",
    is_flag=True,
    help="Calibrate the profile on two thirds of the points (efficiency by op size, one-row "
    "matmuls by their rows' bytes, launch and dispatch overheads, attention and training "
    "scales) and report the error on the points the fit never saw, before and after.",
)
@click.option(
    "--fit-on",
    default="steps",
    show_default=True,
    help="With --fit: the families to fit on: steps (decode, prefill, train), ops (backbone, "
    "attention, unembedding alone), all, or a comma list of families.",
)
@click.option(
    "--anchor",
    is_flag=True,
    help="Scale --device's profile to this machine's speed now: time the anchor grid (about a "
    "minute: decode loops, prefills, training steps of three shapes; or the --from runs' "
    "steps), take the median of measured over predicted, and price every time that many "
    "times as long (--save-profile writes it).",
)
@click.option(
    "--save-profile",
    type=OutputFile(),
    help="With --fit or --anchor: write the calibrated (or anchored) device profile here "
    "(sweep, plan, serve read it).",
)
@click.option("--out", type=OutputFile(), help="Write the validation JSON (atomically).")
@click.option(
    "--plot", type=OutputFile(figure=True), help="Write predicted against measured (.png)."
)
@format_option
def validate(
    device,
    quick,
    by_shape,
    warm,
    grid_name,
    saved,
    fit,
    fit_on,
    anchor,
    save_profile,
    out,
    plot,
    fmt,
):
    """Time this project's GPT, serving engine and training step on this machine beside the
    cost model's prediction for each point: decode and prefill steps, training steps, and the
    backbone, attention and unembedding ops alone, over shapes, V, B and context lengths.

    \b
    Example:
        python cli.py validate --quick                         # ceilings measured first
        python cli.py autotune --quick --dtype f32 --out profiles/cpu.json
        python cli.py validate --device profiles/cpu.json --quick --out validation.json \\
            --plot validation.png
        python cli.py validate --quick --fit --save-profile profiles/cpu-calibrated.json
        python cli.py validate --from validation.json --fit      # refit a saved run
        python cli.py validate --from run1.json --from run2.json --from run3.json --fit
        python cli.py validate --grid loops --out loops.json     # decode loops, 1-32 steps
        python cli.py validate --from run1.json --from loops.json --fit
        python cli.py validate --device profiles/cpu-calibrated.json --anchor \\
            --save-profile profiles/cpu-today.json             # the machine's speed today
    """
    from vocabjax import validation
    from vocabjax.hardware import save_device
    from vocabjax.validation.anchor import anchor_of, anchored
    from vocabjax.validation.fit import calibrate, fit_families

    if quick and grid_name not in (None, "quick"):
        raise click.UsageError(f"--quick and --grid {grid_name} clash: give one")
    if saved and (quick or grid_name or by_shape or warm):
        raise click.UsageError(
            "--from prices a saved run's points: --quick, --grid, --by-shape and --warm time "
            "new ones"
        )
    if fit and anchor:
        raise click.UsageError("--fit and --anchor clash: fit a profile, then anchor it")
    if save_profile and not (fit or anchor):
        raise click.UsageError("--save-profile needs --fit or --anchor")
    families = fit_families(fit_on)
    if saved:
        result = validation.read_validations(saved, device)
        what = saved[0] if len(saved) == 1 else f"{len(saved)} runs, each point's median"
        log(f"validate: {len(result.results)} points of {what} ({result.date}) priced again")
        if result.runs > 1:
            log(_runs_spread_line(result))
    else:
        name = grid_name or ("quick" if quick else "anchor" if anchor else "full")
        result = validation.validate(
            device or validation.MEASURE, name, progress=log, by_shape=by_shape, warm=warm
        )
    calibrated = None
    if fit:
        n = sum(r.point.family in families for r in result.results)
        log(f"validate: fitting {result.device.name}'s efficiency on {n} points of {fit_on}")
        calibrated = calibrate(result, families)
        if save_profile:
            save_device(calibrated.fit.profile, save_profile)
            log(f"wrote {save_profile}")
    speed = anchor_of(result) if anchor else None
    if speed is not None:
        log(f"validate: {result.device.name} {speed.line()}")
        if save_profile:
            save_device(anchored(result.device, speed), save_profile)
            log(f"wrote {save_profile}")
    command = "python cli.py " + " ".join(sys.argv[1:])
    doc = validation.document(result, command=command, calibrated=calibrated)
    if speed is not None:
        points = {"labels": list(speed.labels), "ratios": list(speed.ratios)}
        doc["anchor"] = {**speed.record(), **points}
    if out:
        atomic_write_json(out, doc)
        log(f"wrote {out}")
    if plot:
        validation.plot(result, plot, caption=command, calibrated=calibrated)
        log(f"wrote {plot}")
    if fmt == "json":
        emit(render.json_text(doc))
    elif fmt == "csv":
        emit(render.rows(validation.point_rows(result), "csv"))
    else:
        emit(_validation_text(result, calibrated, fmt))
        if speed is not None:
            emit(f"\n{result.device.name}: {speed.line()}")


def _runs_spread_line(result) -> str:
    """How far the combined runs agree: each step point's (max - min) / median over them."""
    import statistics

    from vocabjax.validation.grid import STEP_FAMILIES

    spread = [
        r.runs_spread_pct
        for r in result.results
        if r.point.family in STEP_FAMILIES and r.runs_spread_pct is not None
    ]
    if not spread:
        return f"validate: {result.runs} runs combined"
    return (
        f"validate: {result.runs} runs combined; a step's runs spread (max - min over the "
        f"median) {statistics.median(spread):.1f}% median, {max(spread):.0f}% worst"
    )


def _validation_text(result, calibrated, fmt: str) -> str:
    """A validation as ``validate`` prints it: every point, then the cost model's |error| by
    group, and with a calibration the held-out points' error before and after it."""
    from vocabjax import validation

    out = [validation.headline(result)]
    if result.mismatch:
        out.append(f"note: {result.mismatch}")
    out += [
        "",
        render.rows(validation.point_rows(result), fmt),
        "\n|error| of the cost model, percent of measured",
        render.rows(validation.summary_rows(result), fmt),
    ]
    if calibrated is not None:
        held = calibrated.held_out(result.results)
        after = calibrated.held_out(calibrated.after)
        out += [
            f"\nheld-out points ({len(held)}, not fitted): |error| before calibration",
            render.rows(validation.summary_rows(result, held), fmt),
            "after calibration",
            render.rows(validation.summary_rows(result, after), fmt),
            "\nthe calibrated profile",
            render.rows(validation.profile_rows(calibrated.fit.profile), fmt),
        ]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
