"""Request traces for ``serve``: read and check a JSONL trace, write one, or build the demo.

A trace is JSON Lines, one request per line (blank lines are skipped):

    {"id": "a1", "arrival_s": 0.0, "prompt": "def main(", "max_new_tokens": 16}
    {"arrival_s": 0.5, "prompt": "import os"}

``arrival_s`` (a number >= 0: when the request reaches the server, in seconds of the serving
clock) and ``prompt`` (non-empty text) are required; ``id`` (text, unique; default ``r<line>``),
``max_new_tokens`` (a positive integer; default the command's) and ``phase`` (a label that the
output groups by) are optional, and any other field is an error (a misspelt one would
otherwise be dropped without a word). The lines need not be sorted: requests are served in
order of arrival, ties in file order.

The demo trace (``demo_trace``) is built from the builtin corpus, the running Python's
standard library, so it needs no download; it takes the corpus's held-out part (documents by
content hash, as ``train`` splits them), so a run trained on the builtin corpus has not seen
its prompts. Its phases are made to exercise the router and the quality controller: code
arriving one request at a time (batches of B = 1), a burst of code arriving together (large
B), then prose (docstrings, whose bits per byte under a code-heavy model differ from code's)
one at a time, and code one at a time again. A Poisson trace (``poisson_trace``) draws its
prompts from the same passages: single requests and bursts arriving at random, with prompts
and output lengths of many sizes, for measuring a loaded server (``benchmarks/serve.py``).
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import math
import random
import tokenize
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from vocabjax.corpus import BUILTIN, Corpus, default_max_bytes
from vocabjax.errors import UserError
from vocabjax.outputs import atomic_write_text
from vocabjax.profiles import field_name, integer, parse_json, read_text, show

FIELDS = ("id", "arrival_s", "prompt", "max_new_tokens", "phase")
TOKENS_MAX = 2**31 - 1  # token positions are int32


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of a trace."""

    id: str  # unique within the trace
    arrival_s: float  # when it reaches the server (seconds of the serving clock, >= 0)
    prompt: str  # the text to continue
    max_new_tokens: int | None = None  # None: the server's default
    phase: str | None = None  # a label the summary groups by (the demo's phases)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "arrival_s": self.arrival_s, "prompt": self.prompt}
        if self.max_new_tokens is not None:
            out["max_new_tokens"] = self.max_new_tokens
        if self.phase is not None:
            out["phase"] = self.phase
        return out


def load_trace(path: str | Path) -> tuple[Request, ...]:
    """The requests of a JSONL trace, sorted by arrival (stable); each problem is one
    UserError naming the file and line.

    Lines end at "\\n" only (a "\\r" before it is dropped): U+2028, U+2029, U+0085 and form
    feeds are text inside a prompt, which ``write_trace`` writes raw."""
    path = Path(path)
    text = read_text(path, what=f"trace {str(path)!r}")
    requests = _parse((line.removesuffix("\r") for line in text.split("\n")), str(path))
    if not requests:
        raise UserError(f"trace {path} holds no requests (one JSON object per line)")
    return tuple(sorted(requests, key=lambda r: r.arrival_s))


def _parse(lines: Iterable[str], where: str) -> list[Request]:
    out: list[Request] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        at = f"{where}:{lineno}"
        record = parse_json(line, where=at, invalid="is not a JSON line")
        request = _request(record, at, default_id=f"r{lineno}")
        if request.id in seen:
            raise UserError(f"{at}: id {request.id!r} is already used on line {seen[request.id]}")
        seen[request.id] = lineno
        out.append(request)
    return out


def _request(record: Any, at: str, *, default_id: str) -> Request:
    if not isinstance(record, dict):
        raise UserError(f"{at} is not a JSON object")
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        raise UserError(
            f"{at}: unknown field(s) {', '.join(map(field_name, unknown))} (a request has "
            f"{', '.join(FIELDS)})"
        )
    for name in ("arrival_s", "prompt"):
        if name not in record:
            raise UserError(f"{at}: missing {name!r}")
    arrival = record["arrival_s"]
    if isinstance(arrival, bool) or not isinstance(arrival, int | float):
        raise UserError(f"{at}: arrival_s must be a number of seconds, got {show(arrival)}")
    try:
        seconds = float(arrival)
    except OverflowError:  # an int past float's range (parse_json refuses those already)
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise UserError(f"{at}: arrival_s must be finite and >= 0, got {show(arrival)}")
    prompt = record["prompt"]
    if not isinstance(prompt, str) or not prompt:
        raise UserError(f"{at}: prompt must be non-empty text, got {show(prompt)}")
    rid = record.get("id", default_id)
    if not isinstance(rid, str) or not rid:
        raise UserError(f"{at}: id must be non-empty text, got {show(rid)}")
    limit = record.get("max_new_tokens")
    if limit is not None:
        integer(limit, where=f"{at}: max_new_tokens", maximum=TOKENS_MAX)
    phase = record.get("phase")
    if phase is not None and not isinstance(phase, str):
        raise UserError(f"{at}: phase must be text, got {show(phase)}")
    return Request(rid, seconds, prompt, limit, phase)


def write_trace(path: str | Path, requests: Sequence[Request]) -> Path:
    """Write requests as a JSONL trace (atomically) that ``load_trace`` reads back."""
    text = "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in requests)
    return atomic_write_text(path, text)


# ---- the demo trace -----------------------------------------------------------------------------

Kind = Literal["code", "prose"]


@dataclasses.dataclass(frozen=True)
class DemoPhase:
    """A stretch of the demo trace."""

    name: str  # the label of its requests
    kind: Kind  # code: source lines outside docstrings; prose: docstrings
    requests: int  # how many
    gap_s: float  # mean seconds between arrivals (0: all arrive at the phase's start)


DEMO_PHASES: tuple[DemoPhase, ...] = (
    DemoPhase("code, one at a time", "code", 24, 1.0),
    DemoPhase("code, burst", "code", 64, 0.0),
    DemoPhase("prose, one at a time", "prose", 24, 1.0),
    DemoPhase("code again, one at a time", "code", 24, 1.0),
)
DEMO_PROMPT_BYTES = (128, 240)  # a demo prompt's bytes: at least (see demo_trace), at most


@dataclasses.dataclass(frozen=True)
class PromptRoom:
    """How many tokens a prompt may have: the server leaves room for the generation."""

    tokens: Callable[[str], int]  # a prompt's tokens (the most over the heads, separator too)
    max_tokens: int  # the most a prompt may have


def demo_trace(
    seed: int = 0,
    *,
    room: PromptRoom | None = None,
    phases: Sequence[DemoPhase] = DEMO_PHASES,
    prompt_bytes: tuple[int, int] = DEMO_PROMPT_BYTES,
) -> tuple[Request, ...]:
    """A deterministic trace (for a given ``seed`` and Python installation) from the held-out
    part of the builtin corpus. Each prompt is a passage of its phase's kind (no passage twice),
    cut at a line (code) or word (prose) boundary to at most ``prompt_bytes[1]`` bytes and
    ``room``'s tokens, and used when the cut keeps at least ``prompt_bytes[0]`` bytes; a run
    whose room holds fewer (its positions minus the generation, at the passages' median bytes
    per token) takes passages of 60% of its room, so that it still gets a demo (short prompts
    give noisier bits per byte). Arrivals in a phase with ``gap_s`` > 0 are spaced by ``gap_s``
    times a uniform draw in [0.5, 1.5]; a burst arrives at one instant; a phase starts
    ``max(gap_s, 1)`` seconds after the last arrival of the one before.

    One function, longer than most: the phases draw from one random stream, one set of used
    passages and one clock in order, and the trace for a seed depends on that order."""
    rng = random.Random(seed)
    pools = _demo_passages()
    shortest, longest = prompt_bytes
    if room is not None:
        if room.max_tokens < 2:
            raise UserError(
                f"the run leaves room for prompts of {room.max_tokens} token(s) after the "
                "generation: give a smaller {max_new_tokens}",
                settings=["max_new_tokens"],
            )
        sample = [p for kind in sorted(pools) for p in pools[kind][:32]]
        per_token = sorted(len(p.encode("utf-8")) / room.tokens(p) for p in sample)
        shortest = min(shortest, int(0.6 * per_token[len(per_token) // 2] * room.max_tokens))

    def fits(text: str) -> bool:
        return room is None or room.tokens(text) <= room.max_tokens

    out: list[Request] = []
    used: set[tuple[Kind, int]] = set()
    clock = 0.0
    for phase in phases:
        pool = pools[phase.kind]
        taken = 0
        for i in rng.sample(range(len(pool)), len(pool)):
            if taken == phase.requests:
                break
            if (phase.kind, i) in used:
                continue
            prompt = _cut(pool[i], phase.kind, longest, fits)
            if len(prompt.encode("utf-8")) < max(shortest, 1):
                continue
            used.add((phase.kind, i))
            if taken and phase.gap_s > 0:
                clock += phase.gap_s * rng.uniform(0.5, 1.5)
            out.append(Request(f"d{len(out) + 1}", round(clock, 6), prompt, phase=phase.name))
            taken += 1
        if taken < phase.requests:
            raise UserError(
                f"demo phase {phase.name!r}: the builtin corpus's held-out part has only "
                f"{taken} unused {phase.kind} passages of >= {shortest} bytes that fit the run "
                f"(prompt and generation within its positions), not {phase.requests}; serve "
                "a {trace} instead",
                settings=["trace"],
            )
        clock += max(phase.gap_s, 1.0)
    return tuple(out)


# ---- a Poisson trace ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PoissonMix:
    """What a Poisson trace mixes (``poisson_trace``)."""

    requests: int = 400  # requests in all
    rate: float = 60.0  # arrivals (a single request or a burst) per second of the serving clock
    burst_share: float = 0.25  # the share of arrivals that are bursts
    burst_size: tuple[int, int] = (4, 16)  # requests in a burst: uniform, both ends included
    prose_share: float = 0.2  # the share of prompts that are prose (docstrings), the rest code
    prompt_bytes: tuple[int, int] = (32, 240)  # a prompt's bytes at most: log-uniform
    new_tokens: tuple[int, int] = (4, 64)  # a request's max_new_tokens: log-uniform

    def __post_init__(self) -> None:
        if self.requests < 1 or not (math.isfinite(self.rate) and self.rate > 0):
            raise UserError(f"a Poisson trace needs requests >= 1 and a rate > 0, got {self}")
        for name in ("burst_size", "prompt_bytes", "new_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise UserError(f"{name}={(low, high)} must be 1 <= low <= high")
        for name in ("burst_share", "prose_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise UserError(f"{name}={getattr(self, name)} must be in [0, 1]")


def poisson_trace(
    seed: int = 0,
    *,
    room: Callable[[int], PromptRoom] | None = None,
    mix: PoissonMix = PoissonMix(),
) -> tuple[Request, ...]:
    """A deterministic trace (for a given ``seed`` and Python installation) of ``mix.requests``
    requests from the held-out builtin corpus, as ``demo_trace`` draws its prompts: arrivals
    (a Poisson process of ``mix.rate`` per second: exponential gaps) each of one request
    (phase "single") or, with probability ``burst_share``, of a burst of ``burst_size``
    requests at one instant (phase "burst"); each request a code or prose prompt cut to a
    log-uniform number of bytes in ``prompt_bytes`` (at a line or word boundary; at least 16
    bytes) and a log-uniform ``max_new_tokens`` in ``new_tokens``, its prompt within
    ``room(max_new_tokens)`` (the run's positions less the generation). No passage twice
    (though two passages cut short may begin alike)."""
    rng = random.Random(seed)
    pools = _demo_passages()
    order = {kind: rng.sample(range(len(pool)), len(pool)) for kind, pool in pools.items()}

    def log_uniform(low: int, high: int) -> int:
        return round(math.exp(rng.uniform(math.log(low), math.log(high + 0.5) - 1e-9)) - 0.5)

    def prompt(kind: Kind, longest: int, limit: int) -> str:
        fits = (lambda _text: True) if room is None else _fits(room(limit))
        while order[kind]:
            text = _cut(pools[kind][order[kind].pop()], kind, longest, fits)
            if len(text.encode("utf-8")) >= min(16, longest):
                return text
        raise UserError(
            f"a Poisson trace of {mix.requests} requests: the builtin corpus's held-out part "
            f"has too few unused {kind} passages that fit the run; ask for fewer requests"
        )

    out: list[Request] = []
    clock = 0.0
    while len(out) < mix.requests:
        clock += rng.expovariate(mix.rate) if out else 0.0
        burst = rng.random() < mix.burst_share
        n = rng.randint(*mix.burst_size) if burst else 1
        for _ in range(min(n, mix.requests - len(out))):
            kind: Kind = "prose" if rng.random() < mix.prose_share else "code"
            limit = max(log_uniform(*mix.new_tokens), 1)
            text = prompt(kind, log_uniform(*mix.prompt_bytes), limit)
            phase = "burst" if burst else "single"
            out.append(Request(f"p{len(out) + 1}", round(clock, 6), text, limit, phase))
    return tuple(out)


def _fits(room: PromptRoom) -> Callable[[str], bool]:
    return lambda text: room.tokens(text) <= room.max_tokens


def _cut(passage: str, kind: Kind, longest: int, fits: Callable[[str], bool]) -> str:
    """The longest prefix of whole lines (code) or words (prose) within ``longest`` bytes
    that ``fits``."""
    parts = passage.split("\n") if kind == "code" else passage.split(" ")
    joiner = "\n" if kind == "code" else " "
    best = ""
    for n in range(1, len(parts) + 1):
        text = joiner.join(parts[:n]).rstrip()
        if len(text.encode("utf-8")) > longest or not fits(text):
            break
        best = text
    return best


def _demo_passages() -> dict[Kind, list[str]]:
    """Code passages (runs of source lines that are mostly code, see ``_code_lines``) and
    prose passages (docstrings) of the held-out builtin documents that parse as Python."""
    corpus = Corpus(BUILTIN, max_bytes=default_max_bytes(BUILTIN))
    code: list[str] = []
    prose: list[str] = []
    for text in corpus.documents("heldout"):
        try:
            tree = ast.parse(text)
            is_code = _code_lines(text)
        except (SyntaxError, ValueError, tokenize.TokenError):
            continue  # the corpus's prose documents (pydoc topics) and odd files
        prose += [ast.get_docstring(node, clean=True) or "" for node in _with_docstring(tree)]
        code += list(_runs(text.splitlines(), is_code))
    # Unique passages, in first-seen order (a few files repeat one another).
    return {"code": list(dict.fromkeys(code)), "prose": list(dict.fromkeys(filter(None, prose)))}


def _with_docstring(tree: ast.Module) -> Iterator[ast.AST]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _code_lines(text: str) -> list[bool]:
    """Per source line: whether it is code, i.e. not inside a string that spans lines (a
    docstring, embedded data) and with at most a third of its non-blank characters in string
    literals and comments. So a codec's table of escapes and names, or XML held in a string,
    is not "code" for the demo, whose code phases should read like the code a model of the
    standard library was trained on."""
    lines = text.splitlines()
    text_chars = [0] * (len(lines) + 2)
    spanned: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            (row, col), (end_row, end_col) = tok.start, tok.end
            if end_row > row:
                spanned.update(range(row, end_row + 1))
            else:
                text_chars[row] += end_col - col
    out = []
    for i, line in enumerate(lines, start=1):
        chars = len(line.strip().replace(" ", ""))
        out.append(i not in spanned and chars > 0 and 3 * text_chars[i] <= chars)
    return out


def _runs(lines: list[str], keep: list[bool], *, length: int = 12) -> Iterator[str]:
    """Passages of up to ``length`` consecutive kept lines (blank lines between them stay),
    right-stripped, each starting at a kept line."""
    run: list[str] = []
    for line, ok in zip(lines, keep, strict=True):
        if not ok and line.strip():
            if run:
                yield "\n".join(run).rstrip()
                run = []
            continue
        if ok or run:
            run.append(line.rstrip())
        if len(run) == length:
            yield "\n".join(run).rstrip()
            run = []
    if run:
        yield "\n".join(run).rstrip()
