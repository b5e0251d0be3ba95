"""The output policy (vocabjax/outputs.py): never overwrite a user's files, check every output
path before the work, atomic writes that survive kill -9, usual permissions, one Error line."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

import cli
from vocabjax import outputs
from vocabjax.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
TEXT = "def f(x):\n    return x + 1\n\nThe quick brown fox jumps over the lazy dog.\n" * 40


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


def one_error(result, pattern: str, *, code: int | None = None) -> None:
    """Exactly one ``Error:`` line matching ``pattern``, no traceback, a non-zero exit."""
    assert result.exit_code != 0 and (code is None or result.exit_code == code), result.output
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), result.output


def tree(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text(TEXT)
    return d


def train_tok(corpus: Path, out: Path, *extra):
    return invoke(
        "tokenizer", "train", "--corpus", corpus, "--vocab", 300, "--out", out,
        "--format", "json", *extra,
    )  # fmt: skip


# ---- output directories -------------------------------------------------------------------------


def test_tokenizer_train_refuses_a_directory_of_other_files(tmp_path, corpus):
    d = tmp_path / "d"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    one_error(train_tok(corpus, d), r"holds other files .*force", code=1)
    assert tree(d) == {"notes.txt": b"mine"}
    # its own corpus is never replaced, not even with --force
    one_error(train_tok(corpus, corpus, "--force"), r"would replace its own input", code=1)
    assert tree(corpus) == {"a.txt": TEXT.encode()}
    # --force replaces a directory of other files on purpose
    assert train_tok(corpus, d, "--force").exit_code == 0
    assert "notes.txt" not in tree(d) and "manifest.json" in tree(d)


def test_an_earlier_output_of_the_same_kind_is_replaced(tmp_path, corpus):
    out = tmp_path / "tok"
    assert train_tok(corpus, out).exit_code == 0
    first = tree(out)
    result = invoke("tokenizer", "train", "--corpus", corpus, "--vocab", "290,300", "--out", out)
    assert result.exit_code == 0, result.output
    assert tree(out) != first and "v290/tokenizer.json" in tree(out)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_prune_never_replaces_its_source(tmp_path, corpus):
    tok = tmp_path / "tok"
    assert train_tok(corpus, tok).exit_code == 0
    before = tree(tok)
    for extra in ((), ("--force",)):
        result = invoke(
            "tokenizer", "prune", "--tokenizer", tok, "--corpus", corpus, "--vocab", 290,
            "--out", tok, *extra,
        )  # fmt: skip
        one_error(result, r"would replace its own input", code=1)
    assert tree(tok) == before
    pruned = tmp_path / "pruned"
    args = ("tokenizer", "prune", "--tokenizer", tok, "--corpus", corpus, "--vocab", 290)
    assert invoke(*args, "--out", pruned).exit_code == 0
    assert invoke(*args, "--out", pruned).exit_code == 0  # an earlier pruning: replaced
    one_error(invoke(*args, "--out", tok / "v300"), r"would replace its own input")


def test_out_dot_and_parents_are_refused(tmp_path, corpus, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for out in (".", "..", str(work)):
        one_error(train_tok(corpus, out), r"current directory or one above it", code=1)
    assert list(work.iterdir()) == []


# ---- output files: checked before the work, one Error line --------------------------------------


def _unwritable(tmp_path: Path) -> list[tuple[str, str]]:
    """(path, expected message) for outputs no process can write, root included."""
    regular = tmp_path / "file"
    regular.write_text("x")
    taken = tmp_path / "taken.json"
    taken.mkdir()
    for d in ("taken.png", "taken.json"):
        (tmp_path / d).mkdir(exist_ok=True)
    return [
        (str(regular / "out.json"), r"is not a directory"),
        ("/proc/vocabjax-out.json", r"cannot write '/proc/vocabjax-out.json'"),
        (str(taken), r"is a directory"),
    ]


@pytest.mark.parametrize(
    "command",
    [
        ["plan", "--workload", "a:b=1:share=1", "--lam", "1", "--out"],
        ["sweep", "--vocab", "8k", "--batch", "1", "--lam", "0", "--plot"],
        ["tokenizer", "measure", "--tokenizer", "x", "--corpus", "builtin", "--out"],
        ["autotune", "--quick", "--out"],
        ["serve", "--run", "x", "--policy", "x", "--demo", "--save-trace"],
        ["serve", "--run", "x", "--policy", "x", "--demo", "--plot"],
    ],
    ids=["plan", "sweep-plot", "measure", "autotune", "save-trace", "serve-plot"],
)
def test_an_unwritable_output_fails_before_any_work(command, tmp_path, monkeypatch):
    from vocabjax import autotune

    def no_work(*a, **kw):
        raise AssertionError("the work started before the output was checked")

    monkeypatch.setattr(autotune, "autotune", no_work)
    for path, message in _unwritable(tmp_path):
        if command[-1] == "--plot":
            path, message = path.replace(".json", ".png"), message.replace(".json", ".png")
        before = sorted(p.name for p in tmp_path.iterdir())
        one_error(invoke(*command, path), message, code=2)
        assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_train_checks_its_run_directory_before_any_work(tmp_path, monkeypatch):
    from vocabjax.train import run as run_module

    def no_work(*a, **kw):
        raise AssertionError("training started before the run directory was checked")

    monkeypatch.setattr(run_module._Session, "prepare", no_work)
    regular = tmp_path / "file"
    regular.write_text("x")
    cases = [
        (str(regular / "run"), r"/file' is not a directory"),
        ("/proc/vocabjax-run", "cannot write '/proc/vocabjax-run'"),
    ]
    for path, message in cases:
        one_error(invoke("train", "--steps", "1", "--out", path), message, code=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_an_immutable_directory_is_one_error_line(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        result = invoke("plan", "--workload", "a:b=1:share=1", "--lam", "1", "--out", locked / "p")
        one_error(result, r"cannot write .*Operation not permitted", code=2)
        with pytest.raises(UserError, match="cannot write"):
            outputs.atomic_write_text(locked / "p.txt", "x")
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)
    assert list(locked.iterdir()) == []


@pytest.mark.slow
def test_a_late_os_error_is_one_line_naming_the_path(tmp_path, monkeypatch):
    def full(tmp, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outputs, "_commit_file", full)
    out = tmp_path / "p.json"
    result = invoke("plan", "--workload", "a:b=1:share=1", "--lam", "1", "--out", out)
    one_error(result, rf"cannot write '{re.escape(str(out))}': No space left on device", code=1)
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone too


# ---- atomic writes ------------------------------------------------------------------------------


def test_concurrent_writers_of_one_path_all_succeed(tmp_path):
    """Unique temporary names: writers that overlap in time do not take each other's file."""
    path = tmp_path / "figure.png"
    n = 3
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        def write(f):
            f.write(b"%d" % i * 1000)
            barrier.wait(timeout=10)  # every writer holds its temporary file at once

        try:
            outputs.atomic_write(path, write)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert path.read_bytes() in {b"%d" % i * 1000 for i in range(n)}
    assert [p.name for p in tmp_path.iterdir()] == ["figure.png"]


def test_save_figure_writes_through_a_unique_temporary_file(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from vocabjax.plots import _pyplot, save_figure

    plt = _pyplot()
    seen = []
    real = outputs._commit_file
    monkeypatch.setattr(outputs, "_commit_file", lambda t, p: (seen.append(t), real(t, p)))
    for _ in range(2):
        fig = plt.figure()
        save_figure(fig, tmp_path / "f.png")
        plt.close(fig)
    assert len(set(seen)) == 2 and (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("mask", [0o022, 0o007])
def test_outputs_honour_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        f = outputs.atomic_write_json(tmp_path / "p.json", {"schema": 1, "kind": "x"})
        with outputs.atomic_directory(tmp_path / "d") as d:
            (d / "inner").mkdir()
    finally:
        os.umask(old)
    assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o777 & ~mask


def test_no_bare_writes_outside_the_output_module():
    """Every write goes through vocabjax/outputs.py (atomic, checked, one error line)."""
    bare = re.compile(
        r"open\([^)]*['\"](w|wb|a|ab|x|w\+|r\+)['\"]|\.write_text\(|\.write_bytes\(|savefig\("
        r"|np\.savez|json\.dump\(|\.to_file\("
    )
    hits = []
    for folder in ("vocabjax", "pallas_kernels", "sims", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "outputs.py" and path.parent.name == "vocabjax":
                continue
            for i, line in enumerate(path.read_text().splitlines(), start=1):
                if bare.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    for i, line in enumerate((ROOT / "cli.py").read_text().splitlines(), start=1):
        if bare.search(line):
            hits.append(f"cli.py:{i}: {line.strip()}")
    assert hits == []


# ---- kill -9 ------------------------------------------------------------------------------------


def kill_at(moment: str, target: Path, *args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "tests" / "kill_driver.py"), moment, str(target), "--"]
    proc = subprocess.run(
        cmd + [str(a) for a in args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["write", "commit", "committed"])
def test_tokenizer_train_killed_leaves_the_earlier_output_or_the_new_one(moment, tmp_path, corpus):
    out = tmp_path / "tok"
    assert train_tok(corpus, out).exit_code == 0
    before = tree(out)
    kill_at(moment, out, "tokenizer", "train", "--corpus", corpus, "--vocab", "290,300",
            "--out", out)  # fmt: skip
    after = tree(out)
    if moment == "committed":
        assert "v290/tokenizer.json" in after
        manifest = json.loads(after["manifest.json"])
        assert [level["vocab"] for level in manifest["levels"]] == [290, 300]
    else:
        assert after == before
    # a kill leaves no half-written output at the name; only hidden temporaries beside it
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")} == {"corpus", "tok"}


@pytest.fixture(scope="module")
def served_run(tmp_path_factory):
    from serving_testing import make_run

    base = tmp_path_factory.mktemp("kill-serve")
    policy = base / "policy.json"
    outputs.atomic_write_json(
        policy,
        {"schema": 2, "kind": "policy", "batch_routes": [{"max_batch": None, "head": 500}]},
    )
    return make_run(base), policy


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["write", "commit", "committed"])
def test_serve_save_trace_killed_leaves_the_earlier_trace_or_the_new_one(
    moment, tmp_path, served_run
):
    run, policy = served_run
    given = tmp_path / "in.jsonl"
    prompts = [f"def f{i}(x):" for i in range(12)]
    given.write_text("".join(json.dumps({"arrival_s": i, "prompt": p}) + "\n"
                             for i, p in enumerate(prompts)))  # fmt: skip
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt": "earlier"}\n')
    kill_at(moment, trace, "serve", "--run", run, "--policy", policy, "--trace", given,
            "--max-new-tokens", 2, "--save-trace", trace)  # fmt: skip
    text = trace.read_text()
    if moment == "committed":
        assert [json.loads(line)["prompt"] for line in text.splitlines()] == prompts
    else:
        assert text == '{"arrival_s": 0, "prompt": "earlier"}\n'
    names = {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")}
    assert names == {"in.jsonl", "trace.jsonl"}
