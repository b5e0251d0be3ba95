"""The one validation layer for every file vocabjax reads: the strict parser (size, nesting,
repeated keys, non-finite numbers, binary files), the typed field checks of each schema, each
regression as one exact `Error:` line through the command line, the JSONL round trip of odd line
separators, and a hypothesis fuzzer: a UserError or a valid object, never another exception."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import cli
from vocabjax import profiles
from vocabjax.compression import CompressionCurve, load_compression
from vocabjax.errors import UserError
from vocabjax.hardware import BUILTIN_DEVICES, DeviceProfile, load_device
from vocabjax.profiles import MAX_DEPTH, load_data, parse_json, parse_toml, read_text
from vocabjax.serving import Request, load_policy, load_trace, write_trace
from vocabjax.shapes import ModelShape, load_shape
from vocabjax.train import CorpusSpec, RunConfig
from vocabjax.train.checkpoint import load_checkpoint
from vocabjax.train.config import RUN_FILE, read_run, write_run
from vocabjax.trainprofile import TrainingProfile, load_training
from vocabjax.xp import PyMath

DEEP = 200_000  # nesting that overflows json's recursion today

SHAPE = {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 128}
ROW = {
    "op": "greedy", "vocab": 32768, "batch": 1, "d_model": 768, "dtype": "bf16",
    "impl": "chunked", "blocks": {"block_v": 2048, "min_rows": 2}, "time_s": 1e-3,
    "roofline_fraction": 0.5,
}  # fmt: skip
POLICY = {
    "schema": 1,
    "kind": "policy",
    "batch_routes": [{"max_batch": 4, "head": 300}, {"max_batch": None, "head": 500}],
}
COMPRESSION = {
    "schema": 1,
    "kind": "compression",
    "unit": "bytes_per_token",
    "corpus": "c",
    "points": [{"vocab": 1000, "bytes_per_token": 3.0}, {"vocab": 4000, "bytes_per_token": 3.5}],
}
TRAINING = {
    "schema": 1,
    "kind": "training",
    "points": [
        {"vocab": 1000, "tokens_per_s": 900.0, "bpb": 1.2},
        {"vocab": 4000, "tokens_per_s": 700.0, "bpb": 1.1},
    ],
}
TRACE = [
    {"id": "a", "arrival_s": 0.0, "prompt": "def main(", "max_new_tokens": 4},
    {"arrival_s": 0.5, "prompt": "import os", "phase": "p"},
]


def device_doc() -> dict:
    doc = {**BUILTIN_DEVICES["a100-80gb"].to_json(), "kernels": [ROW], "best": [ROW]}
    return json.loads(json.dumps(doc))  # a fresh copy: the fuzzer edits it in place


def run_config(tokenizer: str = "tokenizer") -> RunConfig:
    shape = ModelShape("micro", d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64)
    return RunConfig(
        shape=shape,
        heads=(300, 500),
        tokenizer=tokenizer,
        corpus=CorpusSpec("builtin", max_bytes=256 * 1024),
        steps=6,
        seq_len=16,
        batch=2,
        warmup=2,
        eval_tokens=256,
        checkpoint_every=0,
    )


def write(path: Path, content: str | bytes | dict | list) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def one_error(*args: str) -> str:
    """The command's single `Error:` line (exit code 1, no traceback)."""
    result = CliRunner().invoke(cli.main, list(args), catch_exceptions=False)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert result.output.strip().splitlines()[-1] == errors[0]
    return errors[0]


# ---- the parser ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"a": 1, "a": 2}', "x: key 'a' appears twice in one object"),
        ('[{"b": {"c": 1, "c": 1}}]', "x: key 'c' appears twice in one object"),
        ('{"a": NaN}', "x: NaN is not a number vocabjax reads (numbers must be finite)"),
        ('{"a": Infinity}', "x: Infinity is not a number vocabjax reads"),
        ("[-Infinity]", "x: -Infinity is not a number vocabjax reads"),
        ('{"a": 1e400}', "x: the number 1e400 overflows a float (numbers must be finite)"),
        ('{"a": -1e400}', "x: the number -1e400 overflows a float"),
        ("1" + "0" * 400, "x: the integer 100000000000000000000000... (401 characters) does not"),
        ("9" * 5000, "(5000 characters) does not fit in 64 bits"),
        (str(2**64), "does not fit in 64 bits"),
        ("[" * DEEP + "]" * DEEP, f"x nests arrays or objects more than {MAX_DEPTH} deep"),
        ('{"a": ' * DEEP + "1" + "}" * DEEP, "more than 32 deep"),
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "more than 32 deep"),
        ("{oops", "x is not valid JSON (Expecting property name"),
    ],
)
def test_the_json_parser_refuses_with_one_line(text, message):
    with pytest.raises(UserError) as err:
        parse_json(text, where="x")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_json_parser_takes_what_vocabjax_writes():
    nested = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert parse_json(nested, where="x") is not None
    # Brackets inside strings are text, however many: a prompt of code may hold them.
    doc = {"prompt": "[" * DEEP + "{" * 10 + '\\"]', "n": [2**63 - 1, -(2**63), 2**64 - 1]}
    assert parse_json(json.dumps(doc), where="x") == doc
    assert parse_json('{"a": 1.5e300, "b": -0.0, "c": "\u2028"}', where="x")["a"] == 1.5e300


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a = nan", "x: the number nan overflows a float"),
        ("a = -inf", "x: the number -inf overflows"),
        ("a = 1\na = 2", "x is not valid TOML (Cannot overwrite a value"),
        ("a = " + "1" * 5000, "x is not valid TOML (Exceeds the limit"),
        ("a = 99999999999999999999999", "x: the integer 99999999999999999999999 does not fit"),
        ("a = " + "[" * 5000 + "]" * 5000, "x nests arrays or objects more than 32 deep"),
        ("a = " + "[" * 40 + "]" * 40, "x nests arrays or objects more than 32 deep"),
    ],
)
def test_the_toml_parser_refuses_with_one_line(text, message):
    with pytest.raises(UserError) as err:
        parse_toml(text, where="x")
    assert message in str(err.value)


def test_files_are_refused_before_parsing(tmp_path, monkeypatch):
    what = "thing 'f'"
    cases = [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00", "thing 'f' is not text (a NUL byte at offset 8: "),
        ('{"a": 1}'.encode("utf-16"), "thing 'f' is not text (a NUL byte at offset 3"),
        (b'{"a": "\xff"}', "thing 'f' is not UTF-8 text (invalid start byte at byte 7)"),
        (b'{"a": "\xc3"}', "thing 'f' is not UTF-8 text (invalid continuation byte at byte 7)"),
    ]
    for content, message in cases:
        with pytest.raises(UserError) as err:
            read_text(write(tmp_path / "f", content), what=what)
        assert str(err.value).startswith(message)
    assert read_text(write(tmp_path / "f", '\ufeff{"a": 1}'), what=what) == '{"a": 1}'
    with pytest.raises(UserError, match="^thing 'f' is not a regular file$"):
        read_text(tmp_path, what=what)
    with pytest.raises(UserError, match="^thing 'f' does not exist$"):
        read_text(tmp_path / "nope", what=what)
    monkeypatch.setattr(profiles, "MAX_FILE_BYTES", 2**20)
    write(tmp_path / "big.json", "[" + "0," * 2**19 + "0]")
    with pytest.raises(
        UserError, match="^thing 'f' is larger than 1 MiB, the most vocabjax reads$"
    ):
        load_data(tmp_path / "big.json", what=what)


def test_the_file_size_limit_is_stated():
    assert profiles.MAX_FILE_BYTES == 32 * 2**20 and "32 MiB" in profiles.__doc__


# ---- each schema, through the command that reads the file ---------------------------------------


def test_device_profiles(tmp_path):
    def error(doc) -> str:
        return one_error("sweep", "--device", str(write(tmp_path / "d.json", doc)))

    d = str(tmp_path / "d.json")
    doc = device_doc()
    doc["efficiency"]["compute"] = "abc"
    assert error(doc) == f"Error: {d}: efficiency.compute must be a number, got 'abc'"
    doc["efficiency"]["compute"] = 1.5
    assert error(doc) == f"Error: {d}: efficiency.compute must be in (0, 1], got 1.5"
    doc = device_doc()
    doc["kernels"][0] = {**ROW, "blocks": {"tile": "big"}}
    assert error(doc) == (
        f"Error: {d}: kernels[0].blocks.tile must be a positive integer, got 'big'"
    )
    doc["kernels"][0] = {**ROW, "blocks": None}
    assert error(doc) == f"Error: {d}: kernels[0].blocks must be an object, got null"
    doc["kernels"][0] = {**ROW, "blocks": {"tiled": 2}}
    assert error(doc) == f"Error: {d}: kernels[0].blocks.tiled must be at most 1, got 2"
    doc["kernels"][0] = {**ROW, "impl": "cuda"}
    assert error(doc) == (
        f"Error: {d}: kernels[0].impl must be one of xla, chunked, pallas, got 'cuda'"
    )
    doc["kernels"][0] = {**ROW, "time": 1}
    assert error(doc).startswith(f"Error: {d}: kernels[0]: unknown field(s) time (known: op, ")
    doc = {**device_doc(), "efficency": {}}
    assert error(doc).startswith(f"Error: {d}: unknown field(s) efficency (known: schema, ")
    doc = device_doc()
    doc["measured"] = "yes"
    assert error(doc) == f"Error: {d}: measured must be true or false, got 'yes'"
    doc = device_doc()
    doc["ceilings"]["peak_flops"] = {}
    assert error(doc) == f"Error: {d}: ceilings.peak_flops needs at least one dtype"
    assert error("[" * DEEP + "]" * DEEP) == (
        f"Error: device profile '{d}' nests arrays or objects more than 32 deep"
    )
    assert error('{"schema": 1, "schema": 1}') == (
        f"Error: device profile '{d}': key 'schema' appears twice in one object"
    )
    assert load_device(write(tmp_path / "ok.json", device_doc())).best[0].blocks == ROW["blocks"]


def test_profile_blocks_that_a_tile_class_lacks_are_one_error():
    import jax.numpy as jnp

    from vocabjax import unembed

    h, w = jnp.ones((2, 8), jnp.float32), jnp.ones((64, 8), jnp.float32)
    for blocks, message in [
        ({"tile": 1}, "impl='pallas' blocks {'tile': 1} name tile, which DecodeBlocks lacks"),
        ({"tiled": 1, "block_v": 3}, "impl='pallas' TiledBlocks: block_v=3 must be a positive"),
        ({"block_v": "x"}, "impl='pallas' blocks {'block_v': 'x'}: block_v must be an integer"),
    ]:
        with pytest.raises(UserError) as err:
            unembed.greedy(h, w, impl="pallas", blocks=blocks, interpret=True)
        assert str(err.value).startswith(message)
    with pytest.raises(UserError, match="impl='chunked' blocks {'block_v': 'x'}: block_v must"):
        unembed.greedy(h, w, impl="chunked", blocks={"block_v": "x"})


def test_shapes(tmp_path):
    def error(content, name="s.json") -> str:
        return one_error("sweep", "--model", str(write(tmp_path / name, content)))

    s = f"model file '{tmp_path / 's.json'}'"
    assert error({**SHAPE, "glu": "false"}) == f"Error: {s}: glu must be true or false, got 'false'"
    assert error({**SHAPE, "head_dim": -64}) == (
        f"Error: {s}: head_dim must be a positive integer, got -64"
    )
    assert error({**SHAPE, "head_dim": "x"}) == (
        f"Error: {s}: head_dim must be a positive integer, got 'x'"
    )
    assert error({**SHAPE, "d_model": 2**40}) == (
        f"Error: {s}: d_model must be at most 2147483647, got 1099511627776"
    )
    assert error({**SHAPE, "n_heads": 3}) == (
        f"Error: {s}: d_model=64 is not divisible by n_heads=3; give head_dim"
    )
    assert error({**SHAPE, "kind": "device"}).startswith(f"Error: {s}: expected a model shape")
    assert error(b"\x89PNG\r\n\x1a\n\x00\x00") == (
        f"Error: {s} is not text (a NUL byte at offset 8: a binary or UTF-16 file)"
    )
    assert error("[" * DEEP + "]" * DEEP) == f"Error: {s} nests arrays or objects more than 32 deep"
    t = f"model file '{tmp_path / 's.toml'}'"
    assert error("d_model = nan\n", "s.toml") == (
        f"Error: {t}: the number nan overflows a float (numbers must be finite)"
    )
    assert error('d_model = 64\nn_layers = 2\nn_heads = 4\nd_ff = 8\nglu = "no"\n', "s.toml") == (
        f"Error: {t}: glu must be true or false, got 'no'"
    )
    with pytest.raises(UserError, match="model 'm': glu must be true or false, got 'false'"):
        ModelShape("m", 64, 2, 4, 4, 128, glu="false")


def test_compression_and_training_profiles(tmp_path):
    c = str(tmp_path / "c.json")
    points = [{"vocab": 1000, "bytes_per_token": 1e300}, {"vocab": 2000, "bytes_per_token": 1e300}]
    write(tmp_path / "c.json", {**COMPRESSION, "points": points})
    assert one_error("sweep", "--compression", c) == (
        f"Error: {c}: points[0].bytes_per_token must be in (0, 1000000], got 1e+300"
    )
    write(tmp_path / "c.json", {**COMPRESSION, "points": [COMPRESSION["points"][0]] * 2})
    assert one_error("sweep", "--compression", c) == f"Error: {c}: two points have the same vocab"
    write(tmp_path / "c.json", {**COMPRESSION, "points": [{"vocab": 2**40, "bytes_per_token": 3}]})
    assert one_error("sweep", "--compression", c) == (
        f"Error: {c}: points[0].vocab must be at most 2147483647, got 1099511627776"
    )
    assert load_compression(write(tmp_path / "ok.json", COMPRESSION)).vocab == (1000, 4000)
    t = str(tmp_path / "t.json")
    write(tmp_path / "t.json", {**TRAINING, "name": ["x"]})
    assert one_error("sweep", "--training", t) == f"Error: {t}: name must be text, got ['x']"
    assert load_training(write(tmp_path / "t.json", TRAINING)).vocab == (1000, 4000)


def test_policies(tmp_path):
    p = tmp_path / "p.json"
    where = f"policy '{p}'"
    for routes, message in [
        ([{"max_batch": 4, "head": 300}, {"max_batch": 2, "head": 500}],
         "batch_routes[1].max_batch=2 must be above the previous route's (4): routes go in "
         "increasing max_batch, null last"),
        ([{"max_batch": None, "head": 300}, {"max_batch": 8, "head": 500}],
         "batch_routes[0].max_batch is null (every larger batch) but is not the last"),
        ([{"head": 300, "when": 1}], "batch_routes[0]: unknown field(s) when (known: "),
        ([{"max_batch": 0, "head": 300}], "batch_routes[0].max_batch must be a positive integer"),
        ([], "batch_routes must be a non-empty list, got []"),
    ]:  # fmt: skip
        write(p, {**POLICY, "batch_routes": routes})
        with pytest.raises(UserError) as err:
            load_policy(p)
        assert str(err.value).startswith(f"{where}: {message}")
    assert load_policy(write(p, POLICY)) == [(4, 300), (None, 500)]


def _lines(path: Path, *records) -> Path:
    return write(
        path, "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    )


def test_traces_through_serve(tmp_path):
    policy = str(write(tmp_path / "p.json", POLICY))
    # serve reads the policy and the trace before the run: no trained run is needed here.
    args = ("serve", "--run", str(tmp_path / "run"), "--policy", policy, "--trace")
    t = tmp_path / "t.jsonl"
    _lines(t, TRACE[0], '{"arrival_s": 1' + "0" * 400 + ', "prompt": "x"}')
    assert one_error(*args, str(t)) == (
        f"Error: {t}:2: the integer 100000000000000000000000... (401 characters) does not fit in "
        "64 bits"
    )
    _lines(t, '{"arrival_s": 1' + "0" * 400 + '.5, "prompt": "x"}')
    assert one_error(*args, str(t)).startswith(f"Error: {t}:1: the number 1000000000")
    _lines(t, '{"arrival_s": 0, "prompt": "x", "prompt": "y"}')
    assert one_error(*args, str(t)) == f"Error: {t}:1: key 'prompt' appears twice in one object"
    write(t, "[" * DEEP + "]" * DEEP + "\n")
    assert one_error(*args, str(t)) == f"Error: {t}:1 nests arrays or objects more than 32 deep"
    write(t, b'{"arrival_s": 0, "prompt": "\xff"}\n')
    assert one_error(*args, str(t)) == (
        f"Error: trace '{t}' is not UTF-8 text (invalid start byte at byte 28)"
    )


def test_jsonl_lines_end_at_newline_only(tmp_path):
    odd = "a\u2028b\u2029c\x85d\x0ce\x0bf\x1cg\x1dh\x1ei\r"
    requests = [Request("r1", 0.0, odd), Request("r\u2028", 1.0, "x\u2029", 3, "\x85")]
    path = write_trace(tmp_path / "t.jsonl", requests)
    assert "\u2028" in path.read_text(encoding="utf-8")  # written raw (ensure_ascii=False)
    assert load_trace(path) == tuple(requests)
    crlf = tmp_path / "crlf.jsonl"
    write(crlf, "\r\n".join(json.dumps(r) for r in TRACE) + "\r\n")
    assert [r.prompt for r in load_trace(crlf)] == ["def main(", "import os"]


def test_run_json_through_generate(tmp_path):
    run = tmp_path / "run"
    write_run(run, run_config())
    where = str(run / RUN_FILE)
    assert read_run(run) == run_config()
    good = json.loads((run / RUN_FILE).read_text())
    for change, message in [
        ({"heads": "abc"}, "heads must be a non-empty list, got 'abc'"),
        ({"heads": [300, "x"]}, "heads[1] must be a positive integer, got 'x'"),
        ({"heads": [500, 300]}, "heads=[500, 300] must be distinct and increasing"),
        ({"lr": "fast"}, "lr must be a number, got 'fast'"),
        ({"tie_embeddings": "no"}, "tie_embeddings must be true or false, got 'no'"),
        ({"impl": "cuda"}, "impl must be one of auto, xla, chunked, pallas, got 'cuda'"),
        ({"corpus": {"spec": "x", "held_out": 1.5}}, "corpus.held_out must be in (0, 1), got 1.5"),
        ({"shape": {**good["shape"], "glu": "false"}}, "shape: glu must be true or false"),
        ({"steps": None}, "steps must be a positive integer, got null"),
        ({"epochs": 3}, "unknown field(s) epochs (known: shape, heads, "),
    ]:
        (run / RUN_FILE).write_text(json.dumps({**good, **change}))
        line = one_error("generate", "--run", str(run), "--prompt", "x")
        assert line.startswith(f"Error: {where}: {message}"), line
    del good["heads"]
    (run / RUN_FILE).write_text(json.dumps(good))
    with pytest.raises(UserError, match=r"run.json: missing field\(s\) heads$"):
        read_run(run)


def _checkpoint(run: Path, meta: dict) -> None:
    (run / "checkpoint").mkdir(parents=True, exist_ok=True)
    write(run / "checkpoint" / "meta.json", {"schema": 1, "kind": "checkpoint", **meta})
    (run / "checkpoint" / "state.npz").write_bytes(b"")


def test_checkpoint_meta(tmp_path):
    meta = tmp_path / "checkpoint" / "meta.json"
    for change, message in [
        ({}, r"missing field\(s\) step$"),
        ({"step": "five"}, "step must be an integer >= 0, got 'five'$"),
        (
            {"step": 2, "recent_losses": [[1.0], [1.0, 2.0]]},
            "recent_losses holds steps with different",
        ),
        ({"step": 2, "recent_losses": [["x"]]}, r"recent_losses\[0\]\[0\] must be a number"),
        ({"step": 2, "train_tokens": [1, -1]}, r"train_tokens\[1\] must be an integer >= 0"),
    ]:
        _checkpoint(tmp_path, change)
        with pytest.raises(UserError, match=f"^{meta}: {message}"):
            load_checkpoint(tmp_path)


def test_checkpoint_meta_through_train_resume(tmp_path):
    from vocab_testing import nested

    from vocabjax.vocab import save_nested

    save_nested(nested(), tmp_path / "tok", corpus="test")
    run = tmp_path / "run"
    write_run(run, run_config(tokenizer=str(tmp_path / "tok")))
    meta = run / "checkpoint" / "meta.json"
    _checkpoint(run, {"seed": 0})
    assert one_error("train", "--out", str(run), "--resume") == (
        f"Error: {meta}: missing field(s) step"
    )
    _checkpoint(run, {"step": "five"})
    assert one_error("train", "--out", str(run), "--resume") == (
        f"Error: {meta}: step must be an integer >= 0, got 'five'"
    )


# ---- the fuzzer ---------------------------------------------------------------------------------

KEYS = sorted(
    {*device_doc(), *device_doc()["ceilings"], *ROW, *SHAPE, *COMPRESSION, *TRAINING["points"][0]}
    | {*TRACE[0], *TRACE[1], "batch_routes", "max_batch", "head", "glu", "head_dim"}
    | {*run_config().to_json(), "spec", "held_out", "tiled", "block_v"}
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, 300, 500])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["bf16", "f32", "xla", "chunked", "pallas", "device", "shape", "policy"])
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=5)
    ),
    max_leaves=16,
)
SNIPPETS = [
    b"NaN", b"Infinity", b"-Infinity", b"1e400", b"1" * 400, b"[" * 40, b"]", b"{", b"}", b'"',
    b"\\", b",", b":", b"\x00", b"\xff", b"\xc3", b"\xef\xbb\xbf", b"\n", b"\r", b"\xe2\x80\xa8",
    b"null", b"true", b"-0", b"1e-400", b'"x":1,', b'"x":1,"x":2',
]  # fmt: skip


SAME_TYPE = {
    bool: st.booleans(),
    int: st.integers(-4, 2**16) | st.integers(-(2**65), 2**65),
    float: st.floats(allow_nan=False) | st.floats(-1.0, 2.0),
    str: st.text(max_size=12),
}


def _paths(doc, path=()):
    yield path
    items = (
        doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    )
    for k, v in items:
        yield from _paths(v, (*path, k))


def _mutate(doc, data):
    """``doc`` with one value replaced, one key deleted or one key added."""
    paths = list(_paths(doc))[1:]  # not the root: "arbitrary" replaces the whole document
    if not paths:
        return data.draw(values)
    path = data.draw(st.sampled_from(paths))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    op = data.draw(st.sampled_from(["replace", "same type", "delete", "add"]))
    if op == "replace":
        parent[path[-1]] = data.draw(values)
    elif op == "same type":  # a value the field's type allows, often out of its range
        parent[path[-1]] = data.draw(SAME_TYPE.get(type(parent[path[-1]]), values))
    elif op == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    elif op == "delete":
        parent.pop(path[-1])
    elif isinstance(parent, dict):
        parent[data.draw(st.sampled_from(KEYS) | st.text(max_size=6))] = data.draw(values)
    else:
        parent.append(data.draw(values))
    return doc


def _check_device(p: DeviceProfile) -> None:
    assert all(math.isfinite(p.ridge_point(d)) and p.ridge_point(d) > 0 for d in p.peak_flops)
    assert all(r.time_s > 0 and all(isinstance(v, int) for v in r.blocks.values()) for r in p.best)


def _check_shape(m: ModelShape) -> None:
    assert m.n_nonembedding > 0 and m.dh > 0 and isinstance(m.glu, bool)


def _check_curve(c: CompressionCurve) -> None:
    assert all(0 < b <= 1e6 for b in c.bytes_per_token) and list(c.vocab) == sorted(set(c.vocab))
    assert 0 < c.beta(c.vocab[0], xp=PyMath) <= 1e6


def _check_training(t: TrainingProfile) -> None:
    for column in (t.tokens_per_s, t.bpb):
        assert column is None or (len(column) == len(t.vocab) and all(x > 0 for x in column))


def _check_trace(reqs) -> None:
    assert reqs and all(math.isfinite(r.arrival_s) and r.prompt for r in reqs)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)


def _check_policy(routes) -> None:
    bounds = [b for b, _ in routes if b is not None]
    assert bounds == sorted(set(bounds)) and all(h > 0 for _, h in routes)


def _check_run(config: RunConfig) -> None:
    assert dataclasses.replace(config) == config and config.model_config.max_vocab > 0


# kind -> (file name, valid document, loader of the written path, check of what it returns)
FUZZ = {
    "device": ("d.json", device_doc, load_device, _check_device),
    "shape": ("s.json", lambda: dict(SHAPE), load_shape, _check_shape),
    "compression": ("c.json", lambda: json.loads(json.dumps(COMPRESSION)), load_compression,
                    _check_curve),
    "training": ("t.json", lambda: json.loads(json.dumps(TRAINING)), load_training,
                 _check_training),
    "trace": ("t.jsonl", lambda: json.loads(json.dumps(TRACE)), load_trace, _check_trace),
    "policy": ("p.json", lambda: json.loads(json.dumps(POLICY)), load_policy, _check_policy),
    "run": (RUN_FILE, lambda: run_config().to_json(), lambda p: read_run(p.parent), _check_run),
}  # fmt: skip


ENVELOPE = {k: ("schema", "kind") for k in FUZZ} | {"shape": (), "trace": ()}


def _encode(kind: str, doc) -> bytes:
    if kind == "trace" and isinstance(doc, list):  # one JSON value per line
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in doc).encode()
    return json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _fuzz_once(kind: str, data, directory: Path) -> None:
    name, valid, load, check = FUZZ[kind]
    how = data.draw(st.sampled_from(["arbitrary", "envelope", "mutated", "bytes"]))
    doc = data.draw(values) if how == "arbitrary" else valid()
    if how == "envelope":  # the right schema and kind around arbitrary fields
        fields = data.draw(st.dictionaries(st.sampled_from(KEYS), values, max_size=6))
        doc = [fields] if kind == "trace" else {**fields, **{k: doc[k] for k in ENVELOPE[kind]}}
    for _ in range(data.draw(st.integers(1, 3)) if how == "mutated" else 0):
        doc = _mutate(doc, data)
    raw = _encode(kind, doc)
    if how == "bytes":  # splice a few byte snippets into the valid file's text
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, len(raw)))
            cut = data.draw(st.integers(0, 3))
            raw = raw[:at] + data.draw(st.sampled_from(SNIPPETS)) + raw[at + cut :]
    path = directory / name
    path.write_bytes(raw)
    try:
        result = load(path)
    except UserError as exc:
        assert str(exc) and "\n" not in str(exc), repr(str(exc))
        return
    check(result)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@pytest.mark.parametrize("kind", sorted(FUZZ))
@given(data=st.data())
def test_fuzz_a_user_error_or_a_valid_object(fuzz_dir, kind, data):
    _fuzz_once(kind, data, fuzz_dir)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(FUZZ))
@settings(max_examples=200)
@given(data=st.data())
def test_fuzz_more_examples(fuzz_dir, kind, data):
    _fuzz_once(kind, data, fuzz_dir)
