"""Sizes, float lists and workloads as the command line parses them: exact values, bounds named
in the message, and a fuzz test that any text is a value in bounds or one UserError."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vocabjax.errors import UserError
from vocabjax.planning import parse_workload
from vocabjax.units import (
    BATCH_RANGE,
    BYTES_MAX,
    LAM_MAX,
    SIZE_MAX,
    VOCAB_RANGE,
    parse_float,
    parse_float_list,
    parse_size,
    parse_size_list,
)

VOCAB = dict(minimum=VOCAB_RANGE[0], maximum=VOCAB_RANGE[1])
NINES = "9" * 400


@pytest.mark.parametrize(
    "text, value",
    [
        ("2147483647", 2**31 - 1),
        ("9223372036854775807", SIZE_MAX),  # exact: a float would round it to 2**63
        ("0" * 400 + "12", 12),
        ("1.0", 1),
        ("1.5g", 1536 * 1024**2),
        ("0.5k", 512),
        ("3k", 3072),  # not within 3% of a power of two: exact
        ("1.999k", 2048),  # within 3% of 2048: snaps
        (" 64 k ", 65536),
        (50257, 50257),
    ],
)
def test_parse_size_is_exact(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize(
    "text, kw, message",
    [
        ("1", VOCAB, "vocab 1 is out of range 2..2147483647"),
        ("2147483648", VOCAB, "vocab 2147483648 is out of range 2..2147483647"),
        ("1" + "0" * 21, VOCAB, "vocab 1000000000000000000000 is out of range 2..2147483647"),
        ("1000000000000g", VOCAB, "vocab 1073741824000000000000 is out of range 2..2147483647"),
        (NINES, VOCAB, "vocab 999999...(400 digits) is out of range 2..2147483647"),
        (NINES + "k", VOCAB, "vocab 999999...(400 digits)k is out of range 2..2147483647"),
        ("9223372036854775808", {}, "vocab 9223372036854775808 is out of range "),
        ("1e21", VOCAB, "vocab '1e21' is not a size (examples: 8k, 65536, 262k, 1m)"),
        ("0", VOCAB, "vocab must be positive, got '0'"),
        ("0.0001k", VOCAB, "vocab must be positive, got '0.0001k'"),
        ("0.000122k", {}, "vocab must be positive, got '0.000122k'"),  # not 0.125
        ("1." + "0" * 5000 + "1k", {}, "has more than 30 decimal places"),
        (NINES + ".5", {}, "must be a whole number"),
        ("1" + "0" * 5000, {}, "vocab 100000...(5001 digits) is out of range"),
        pytest.param(
            10**5000, {}, "vocab <an integer of 16610 bits> is out of range", id="huge-int"
        ),
        pytest.param(
            -(10**5000),
            {},
            "vocab must be positive, got <an integer of 16610 bits>",
            id="huge-negative-int",
        ),
        ("٣", {}, "is not a size"),  # ASCII digits only
        (True, {}, "vocab 'True' is not a size"),
    ],
)
def test_parse_size_bounds_and_overflow(text, kw, message):
    with pytest.raises(UserError) as info:
        parse_size(text, what="vocab", **kw)
    assert str(info.value).startswith(message) or message in str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 200


def test_parse_size_list_bounds_every_item():
    assert parse_size_list("2,8k,8k", what="vocab", **VOCAB) == [2, 8192]
    with pytest.raises(UserError, match=r"^vocab 1 is out of range 2\.\.2147483647$"):
        parse_size_list("8k,1", what="vocab", **VOCAB)
    with pytest.raises(UserError, match="batch list ' , ' is empty"):
        parse_size_list(" , ", what="batch")
    with pytest.raises(ValueError, match="bounds"):
        parse_size("8", minimum=9, maximum=8)


def test_parse_float_bounds():
    assert parse_float_list("0, 1e12,1", what="lam", maximum=LAM_MAX) == [0.0, 1e12, 1.0]
    for text, message in [
        ("1e13", "lam must be <= 1e+12, got '1e13'"),
        (NINES, "lam must be finite, got '9999999999999999'... (400 characters)"),
        ("-inf", "lam must be finite, got '-inf'"),
        ("-1", "lam must be >= 0, got '-1'"),
        ("1,x", "lam 'x' is not a number"),
    ]:
        with pytest.raises(UserError) as info:
            parse_float_list(text, what="lam", maximum=LAM_MAX)
        assert str(info.value) == message
    with pytest.raises(UserError, match=r"^prompt_bytes must be <= 1125899906842624, got '1e300'$"):
        parse_float("1e300", what="prompt_bytes", maximum=BYTES_MAX)


@pytest.mark.parametrize(
    "text, message",
    [
        ("a:b=1:b=64:share=1", "workload class 'a' gives b= twice ('b=1' and 'b=64')"),
        ("a:b=1:batch=64:share=1", "workload class 'a' gives batch= twice ('b=1' and 'batch=64')"),
        ("a:b=1:share=0.5:share=0.5", "workload class 'a' gives share= twice"),
        ("a:b=1:share=1:in=5:in=6", "workload class 'a' gives in= twice"),
        (f"a:b={NINES}:share=1", "workload 'a' batch 999999...(400 digits) is out of range 1.."),
        ("a:b=16777217:share=1", "workload 'a' batch 16777217 is out of range 1..16777216"),
        ("a:b=1:share=nan", "workload class 'a': share='nan' is out of range 0..1"),
        ("a:b=1:share=-0.5,b:b=1:share=1.5", "share='-0.5' is out of range 0..1"),
        ("a:b=1:share=inf", "share='inf' is out of range 0..1"),
        ("a:b=1:share=1:out=1e300", "out='1e300' is out of range; bytes must be > 0 and <="),
        ("a:b=1:share=1:in=0", "in='0' is out of range"),
        ("a:b=1:share=.5,a:b=2:share=.5", "workload class names must be unique ('a' twice)"),
    ],
)
def test_bad_workloads_name_the_problem(text, message):
    with pytest.raises(UserError) as info:
        parse_workload(text)
    assert str(info.value).startswith(message) or message in str(info.value)


# ---- fuzz: any text is a value in bounds or one UserError, never another exception -----------

_SIZE_CHARS = "0123456789.kmgKMGe+-x ,\t"
_texts = st.one_of(
    st.text(max_size=60),
    st.text(alphabet=_SIZE_CHARS, max_size=500),
    st.integers(min_value=-(10**450), max_value=10**450).map(str),
    st.tuples(
        st.integers(min_value=0, max_value=10**40),
        st.integers(min_value=0, max_value=10**40),
        st.sampled_from(["", "k", "m", "g", "K"]),
    ).map(lambda t: f"{t[0]}.{t[1]}{t[2]}"),
)
_bounds = st.integers(min_value=1, max_value=2**40).flatmap(
    lambda lo: st.tuples(st.just(lo), st.integers(min_value=lo, max_value=SIZE_MAX))
)
_float_texts = st.one_of(
    st.text(alphabet="0123456789.eE+-_,naifINF ", max_size=300),
    st.lists(st.floats().map(repr), max_size=4).map(",".join),
    st.text(max_size=40),
)


def _workload_field() -> st.SearchStrategy[str]:
    key = st.sampled_from(["b", "batch", "share", "in", "out", "q", "", " b"])
    value = st.one_of(
        st.sampled_from(["1", "0", "0.5", "1.0", "nan", "-1", "inf", "64k", "1e300", NINES]),
        _texts,
    )
    sep = st.sampled_from(["=", "", "=="])
    return st.tuples(key, sep, value).map("".join)


_workloads = st.one_of(
    st.text(max_size=60),
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "", "edge", "x y"]), st.lists(_workload_field())),
        max_size=4,
    ).map(lambda classes: ",".join(":".join([n, *fs]) for n, fs in classes)),
    st.integers(min_value=1, max_value=2**25).map(lambda b: f"a:b={b}:share=1"),
)


def _check_size(text: str, bounds: tuple[int, int]) -> None:
    lo, hi = bounds
    try:
        value = parse_size(text, what="size", minimum=lo, maximum=hi)
    except UserError as exc:
        assert "\n" not in str(exc)
        return
    assert type(value) is int and lo <= value <= hi


def _check_size_list(text: str, bounds: tuple[int, int]) -> None:
    lo, hi = bounds
    try:
        values = parse_size_list(text, what="size", minimum=lo, maximum=hi)
    except UserError:
        return
    assert values and all(type(v) is int and lo <= v <= hi for v in values)
    assert len(set(values)) == len(values)


def _check_float_list(text: str) -> None:
    try:
        values = parse_float_list(text, what="lam", maximum=LAM_MAX)
    except UserError:
        return
    assert values and all(math.isfinite(v) and 0.0 <= v <= LAM_MAX for v in values)


def _check_workload(text: str) -> None:
    try:
        classes = parse_workload(text)
    except UserError:
        return
    assert classes and len({c.name for c in classes}) == len(classes)
    assert abs(sum(c.share for c in classes) - 1.0) <= 1e-6
    for c in classes:
        assert type(c.batch) is int and BATCH_RANGE[0] <= c.batch <= BATCH_RANGE[1]
        assert math.isfinite(c.share) and 0.0 <= c.share <= 1.0
        for b in (c.prompt_bytes, c.output_bytes):
            assert b is None or 0.0 < b <= BYTES_MAX


def _fuzz(size, bounds, size_list, floats, workload):
    _check_size(size, bounds)
    _check_size_list(size_list, bounds)
    _check_size_list(size, VOCAB_RANGE)
    _check_float_list(floats)
    _check_workload(workload)


_fuzz_args = dict(
    size=_texts,
    bounds=_bounds,
    size_list=st.lists(_texts, max_size=4).map(",".join),
    floats=_float_texts,
    workload=_workloads,
)


@pytest.mark.slow
@given(**_fuzz_args)
def test_parsers_fuzz(size, bounds, size_list, floats, workload):
    _fuzz(size, bounds, size_list, floats, workload)


@pytest.mark.slow
@settings(max_examples=800)
@given(**_fuzz_args)
def test_parsers_fuzz_more(size, bounds, size_list, floats, workload):
    _fuzz(size, bounds, size_list, floats, workload)


@given(st.integers(min_value=1, max_value=SIZE_MAX))
def test_plain_integers_round_trip_exactly(n):
    assert parse_size(str(n)) == n
    assert parse_size(f"{n:0>30}") == n  # leading zeros


@given(st.integers(min_value=1, max_value=2**33))
def test_suffixed_sizes_snap_only_near_a_power_of_two(n):
    raw = n * 1024
    value = parse_size(f"{n}k")
    if value != raw:
        assert value & (value - 1) == 0 and abs(value - raw) <= 0.03 * value


def test_a_user_error_names_a_setting_by_its_library_name_and_the_cli_by_its_flag():
    import cli
    from vocabjax.errors import UserError

    exc = UserError(
        "{resume}: {shape} x differs; lower {lr} or {corpus.field} {max_new_tokens} {other}",
        settings=["resume", "shape", "lr", "corpus.field", "max_new_tokens"],
    )
    assert str(exc) == ("resume: shape x differs; lower lr or corpus.field max_new_tokens {other}")
    assert exc.render(cli.flag) == (
        "--resume: --model x differs; lower --lr or --field --max-new-tokens {other}"
    )
    plain = UserError("a {brace} stays")
    assert str(plain) == plain.render(cli.flag) == "a {brace} stays"
