"""Corpus streaming: formats, compression, the split, the cap, the builtin corpora, bad input."""

from __future__ import annotations

import errno
import gzip
import io
import json
import os
import sys
import sysconfig
from pathlib import Path

import pytest

from vocabjax import corpus as corpus_module
from vocabjax.corpus import (
    BUILTIN_LABEL,
    PROSE,
    PROSE_LABEL,
    batches,
    default_max_bytes,
    is_held_out,
    open_corpus,
    read_file,
)
from vocabjax.errors import UserError

DOCS = ["first document\nwith two lines\n", "zweites Dokument: Grüße 🙂\n", "third\n"]


def _write_jsonl(path, docs, field="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")


def test_text_directory_and_glob(tmp_path):
    for i, d in enumerate(DOCS):
        (tmp_path / f"{i}.txt").write_text(d, encoding="utf-8")
    (tmp_path / "notes.bin").write_bytes(b"\x00\x01")  # not a corpus format: skipped in a dir
    (tmp_path / ".hidden.txt").write_text("hidden", encoding="utf-8")
    assert list(open_corpus(tmp_path).documents()) == DOCS
    assert list(open_corpus(str(tmp_path / "*.txt")).documents()) == DOCS
    assert list(open_corpus(tmp_path / "1.txt").documents()) == [DOCS[1]]


def test_jsonl_field_and_compression(tmp_path):
    import zstandard

    _write_jsonl(tmp_path / "a.jsonl", DOCS)
    _write_jsonl(tmp_path / "b.jsonl.gz", DOCS, field="content", opener=gzip.open)
    data = "".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode()
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    (tmp_path / "d.txt.gz").write_bytes(gzip.compress(DOCS[0].encode()))
    assert list(open_corpus(tmp_path / "a.jsonl").documents()) == DOCS
    assert list(open_corpus(tmp_path / "b.jsonl.gz", field="content").documents()) == DOCS
    assert list(open_corpus(tmp_path / "c.jsonl.zst").documents()) == DOCS
    assert list(open_corpus(tmp_path / "d.txt.gz").documents()) == [DOCS[0]]


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": DOCS + [None], "n": [1, 2, 3, 4]}), tmp_path / "x.parquet")
    assert list(open_corpus(tmp_path / "x.parquet", field="body").documents()) == DOCS
    with pytest.raises(UserError, match=r"has no column 'text' \(columns: body, n\)"):
        list(open_corpus(tmp_path / "x.parquet").documents())


def test_long_text_file_is_cut_at_line_ends(tmp_path):
    lines = [f"line {i} " + "x" * (i % 50) + "\n" for i in range(3000)]
    (tmp_path / "big.txt").write_text("".join(lines), encoding="utf-8")
    docs = list(read_file(tmp_path / "big.txt", max_document_bytes=4096))
    assert len(docs) > 10
    assert "".join(docs) == "".join(lines)
    assert all(d.endswith("\n") for d in docs)
    assert max(len(d.encode()) for d in docs) <= 1024 + 60  # max/4 characters plus one line


def test_split_is_a_deterministic_partition_by_content(tmp_path):
    docs = [f"document number {i}\n" for i in range(400)]
    _write_jsonl(tmp_path / "a.jsonl", docs)
    _write_jsonl(tmp_path / "b.jsonl", docs[::-1])
    a = open_corpus(tmp_path / "a.jsonl", held_out=0.25)
    train, held = list(a.documents("train")), list(a.documents("heldout"))
    assert sorted(train + held) == sorted(docs) and not set(train) & set(held)
    assert 60 < len(held) < 140  # about a quarter
    b = open_corpus(tmp_path / "b.jsonl", held_out=0.25)
    assert set(b.documents("heldout")) == set(held)  # order does not matter, content does
    assert not is_held_out(b"x", 0.0) and is_held_out(b"x", 1.0)


def test_max_bytes_caps_before_the_split(tmp_path):
    docs = [f"doc {i:04d}\n" for i in range(100)]  # 9 bytes each
    _write_jsonl(tmp_path / "a.jsonl", docs)
    capped = open_corpus(tmp_path / "a.jsonl", max_bytes=90)
    assert list(capped.documents()) == docs[:10]
    full_held = set(open_corpus(tmp_path / "a.jsonl").documents("heldout"))
    assert set(capped.documents("heldout")) == full_held & set(docs[:10])
    assert "first" in capped.label


def test_builtin_corpus_is_labelled_and_deterministic():
    corpus = open_corpus("builtin", max_bytes=200_000)
    docs = list(corpus.documents())
    assert docs == list(open_corpus("builtin", max_bytes=200_000).documents())
    # the cap stops before the first document that would pass it (sizes differ by Python version)
    more = list(open_corpus("builtin", max_bytes=400_000).documents())
    assert more[: len(docs)] == docs and len(more) > len(docs)
    total = sum(len(d.encode()) for d in docs)
    assert total <= 200_000 < total + len(more[len(docs)].encode())
    assert corpus.label.startswith(BUILTIN_LABEL) and "code-heavy" in corpus.describe("train")
    assert any("def " in d for d in open_corpus("builtin", max_bytes=2_000_000).documents())
    files = corpus.files()
    root = sysconfig.get_paths()["stdlib"]
    assert len(files) > 100
    assert files == sorted(files, key=lambda p: p.relative_to(root).as_posix())
    assert not any("site-packages" in p.parts for p in files)


def test_batches():
    assert list(batches(iter("abcde"), max_docs=2, max_chars=100)) == [
        ["a", "b"],
        ["c", "d"],
        ["e"],
    ]
    assert list(batches(iter(["xx", "yy", "z"]), max_docs=9, max_chars=3)) == [["xx", "yy"], ["z"]]


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: None, r"corpus '.*missing' does not exist"),
        (lambda p: (p / "missing").mkdir(), r"has no \.txt, \.jsonl or \.parquet files"),
    ],
)
def test_missing_path_and_empty_directory(tmp_path, setup, message):
    setup(tmp_path)
    with pytest.raises(UserError, match=message):
        open_corpus(tmp_path / "missing")
    with pytest.raises(UserError, match="no files match"):
        open_corpus(str(tmp_path / "nothing-*.txt"))


def test_empty_corpus_and_empty_split(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n\n", encoding="utf-8")
    with pytest.raises(UserError, match="holds no text"):
        list(open_corpus(tmp_path / "empty.txt").documents())
    (tmp_path / "one.txt").write_text("one document", encoding="utf-8")
    with pytest.raises(UserError, match="the heldout part of corpus .* is empty"):
        list(open_corpus(tmp_path / "one.txt", held_out=0.0).documents("heldout"))


def test_binary_junk(tmp_path):
    (tmp_path / "junk.txt").write_bytes(os.urandom(4096))
    with pytest.raises(
        UserError, match=r"holds no text \(1 file\(s\) skipped, first: .*junk.txt is"
    ):
        list(open_corpus(tmp_path / "junk.txt").documents())
    (tmp_path / "nul.txt").write_bytes(b"abc\x00\x00\x00def" * 10)
    with pytest.raises(UserError, match="nul.txt looks like binary data"):
        list(open_corpus(tmp_path / "nul.txt").documents())
    # in a corpus of several files, a file that is not text is skipped and reported
    (tmp_path / "good.txt").write_text("good text\n", encoding="utf-8")
    skipped = []
    docs = list(open_corpus(str(tmp_path / "*.txt")).documents(on_skip=skipped.append))
    assert docs == ["good text\n"] and len(skipped) == 2
    (tmp_path / "junk.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(UserError, match="is not a valid .gz file"):
        list(open_corpus(tmp_path / "junk.jsonl.gz").documents())
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 nope")
    with pytest.raises(UserError, match="is not a readable parquet file"):
        list(open_corpus(tmp_path / "junk.parquet").documents())


def test_bad_jsonl(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"a.jsonl:2 has no 'text' field \(fields: body\)"):
        list(open_corpus(tmp_path / "a.jsonl").documents())
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n{oops\n', encoding="utf-8")
    with pytest.raises(UserError, match="b.jsonl:2 is not a JSON line"):
        list(open_corpus(tmp_path / "b.jsonl").documents())
    (tmp_path / "c.jsonl").write_text('{"text": 3}\n', encoding="utf-8")
    with pytest.raises(UserError, match="field 'text' is int, not text"):
        list(open_corpus(tmp_path / "c.jsonl").documents())


def test_missing_optional_packages_say_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"")
    (tmp_path / "x.txt.zst").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(UserError, match="needs pyarrow: pip install pyarrow"):
        list(open_corpus(tmp_path / "x.parquet").documents())
    with pytest.raises(UserError, match="needs the zstandard package: pip install zstandard"):
        list(open_corpus(tmp_path / "x.txt.zst").documents())


def test_bad_arguments():
    with pytest.raises(UserError, match="held_out=1.5 must be in"):
        open_corpus("builtin", held_out=1.5)
    with pytest.raises(UserError, match="max_bytes=0 must be positive"):
        open_corpus("builtin", max_bytes=0)


# ---- OS errors while listing or reading: one UserError naming the file ----------------------


class _FailingRaw(io.RawIOBase):
    """A file whose reads fail as a failing disk does (EIO), after ``good`` bytes."""

    def __init__(self, good: bytes = b"") -> None:
        self._good = good

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._good:
            n = min(len(buffer), len(self._good))
            buffer[:n], self._good = self._good[:n], self._good[n:]
            return n
        raise OSError(errno.EIO, os.strerror(errno.EIO))


@pytest.mark.parametrize("name", ["a.txt", "a.jsonl"])
@pytest.mark.parametrize("when", ["open", "read"])
def test_io_errors_name_the_file(tmp_path, monkeypatch, name, when):
    path = tmp_path / name
    path.write_text('{"text": "a document"}\n', encoding="utf-8")

    def failing_open(file, mode="r", *args, **kwargs):
        if when == "open":
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(file))
        return io.BufferedReader(_FailingRaw(b'{"text": "first"}\n' * 3))

    corpus = open_corpus(path)
    monkeypatch.setattr(corpus_module, "open", failing_open, raising=False)
    with pytest.raises(UserError) as info:
        list(corpus.documents())
    assert str(info.value) == f"cannot read '{path}': Input/output error"


def test_a_directory_where_a_file_is_expected(tmp_path):
    (tmp_path / "d.txt").mkdir()
    with pytest.raises(UserError) as info:
        list(read_file(tmp_path / "d.txt"))
    assert str(info.value) == f"cannot read '{tmp_path / 'd.txt'}': Is a directory"


def test_errors_while_listing_name_the_directory(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("text", encoding="utf-8")

    def failing_rglob(self, pattern):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    monkeypatch.setattr(Path, "rglob", failing_rglob)
    with pytest.raises(UserError) as info:
        open_corpus(tmp_path)
    assert str(info.value) == f"cannot read '{tmp_path}': Permission denied"


def _proc_mem_fails() -> bool:
    try:
        with open("/proc/self/mem", "rb") as f:
            f.read(1)
    except OSError:
        return True
    return False


@pytest.mark.skipif(not _proc_mem_fails(), reason="needs /proc/self/mem, whose read fails (EIO)")
def test_proc_self_mem_is_one_error():
    # a regular file by stat whose first read fails: EIO without any set-up, and no wait
    with pytest.raises(UserError, match=r"^cannot read '/proc/self/mem': Input/output error$"):
        list(open_corpus("/proc/self/mem").documents())


# ---- the builtin prose corpus -----------------------------------------------------------------


@pytest.fixture
def fake_share(tmp_path, monkeypatch):
    """A /usr/share of one README, one licence and one man page, in place of the system's."""
    (tmp_path / "doc" / "pkg").mkdir(parents=True)
    (tmp_path / "doc" / "pkg" / "README.gz").write_bytes(
        gzip.compress(b"This package reads words aloud and writes them down again.\n")
    )
    (tmp_path / "doc" / "pkg" / "logo.png").write_bytes(b"\x89PNG not text")
    (tmp_path / "common-licenses").mkdir()
    (tmp_path / "common-licenses" / "Fair").write_text(
        "Usage of the works is permitted provided that this instrument is retained.\n"
    )
    (tmp_path / "man" / "man1").mkdir(parents=True)
    page = (
        '.\\" a comment\n.de XX\n.ft B\n..\n.TH GREET 1\n.SH NAME\ngreet \\- say hello\n'
        ".SH DESCRIPTION\n.B greet\nprints a \\fIfriendly\\fR greeting\\(emonce.\n"
    )
    (tmp_path / "man" / "man1" / "greet.1.gz").write_bytes(gzip.compress(page.encode()))
    monkeypatch.setattr(corpus_module, "SHARE", tmp_path)
    corpus_module._prose_paths.cache_clear()
    yield tmp_path
    corpus_module._prose_paths.cache_clear()


def test_prose_is_made_here_from_what_is_shipped_and_labelled(fake_share, monkeypatch):
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError("the prose corpus tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    corpus = open_corpus(PROSE, max_bytes=300_000)  # sources interleave: the fakes come early
    docs = list(corpus.documents())
    assert "This package reads words aloud and writes them down again.\n" in docs
    assert any("Usage of the works is permitted" in d for d in docs)
    assert (
        "NAME\ngreet - say hello\n\nDESCRIPTION\ngreet\nprints a friendly greeting--once.\n" in docs
    )
    assert not any("not text" in d for d in docs)
    assert any("assert" in d for d in docs)  # Python's reference: on every machine
    assert len(docs) == len(set(docs))  # each text once
    assert corpus.label.startswith(PROSE_LABEL) and "prose" in corpus.describe("heldout")
    assert "not downloaded" in corpus.label and corpus.is_builtin
    assert fake_share / "man" / "man1" / "greet.1.gz" in corpus.files()
    assert default_max_bytes(PROSE) == default_max_bytes("builtin")


@pytest.mark.slow
def test_prose_is_deterministic_and_mixes_its_sources():
    a = list(open_corpus(PROSE, max_bytes=600_000).documents())
    assert a == list(open_corpus(PROSE, max_bytes=600_000).documents())
    assert len(a) == len(set(a))
    # interleaved by bytes: a small cap already holds Python's reference and docstrings
    assert any(d.startswith('The "assert" statement') for d in a)
    assert any("Return" in d and "def " not in d for d in a)
    train, held = list(open_corpus(PROSE, max_bytes=600_000).documents("train")), []
    held = list(open_corpus(PROSE, max_bytes=600_000).documents("heldout"))
    assert sorted(train + held) == sorted(a) and held


@pytest.mark.slow
def test_prose_holds_enough_text_for_a_16k_tokenizer():
    from vocabjax.vocab import train_nested

    cap = 2**20
    docs = list(open_corpus(PROSE, max_bytes=cap).documents("train"))
    assert sum(len(d.encode()) for d in docs) > 0.8 * cap
    assert train_nested(docs, [16384], stop_short=True).vocab_sizes == (16384,)
