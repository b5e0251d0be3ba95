"""vocabjax command line: parse, call the library, render. No logic lives here.

    python cli.py sweep                       # V* over (V, B, lambda) on builtin defaults
    python cli.py sweep --device h100-sxm --model llama-8b --format json
"""

from __future__ import annotations

import sys

import click

import vocabjax
from vocabjax import render
from vocabjax.errors import UserError
from vocabjax.units import parse_float_list, parse_size, parse_size_list

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class _Group(click.Group):
    """A click group that turns the library's UserError into one ``Error: ...`` line."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            raise click.ClickException(str(exc)) from None


class SizeList(click.ParamType):
    """``8k,32k,262k`` -> [8192, 32768, 262144]."""

    name = "LIST"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            return parse_size_list(value, what=param.name if param else "size")
        except UserError as exc:
            self.fail(str(exc), param, ctx)


class Size(click.ParamType):
    """``8k``, ``65536``, ``1m``."""

    name = "N"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_size(value, what=param.name if param else "size")
        except UserError as exc:
            self.fail(str(exc), param, ctx)


class FloatList(click.ParamType):
    """``0,1,10,100`` -> [0.0, 1.0, 10.0, 100.0]; finite and >= 0."""

    name = "LIST"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            return parse_float_list(value, what=param.name if param else "value")
        except UserError as exc:
            self.fail(str(exc), param, ctx)


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

# ---- tokenizers: tokenizer train / measure / prune ------------------------------------------

# ---- kernels: autotune ----------------------------------------------------------------------


if __name__ == "__main__":
    sys.exit(main())
