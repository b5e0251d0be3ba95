"""Streaming text corpora: files, directories and globs of ``.txt``, ``.jsonl`` and ``.parquet``
(optionally ``.gz`` or ``.zst`` compressed), a deterministic train / held-out split by document
hash, and the ``builtin`` corpus that every fresh machine has (the running Python's standard
library).

Nothing here loads a corpus into memory: documents are yielded one at a time, and a large text
file is cut into documents of at most ``max_document_bytes`` at line boundaries.

    corpus = open_corpus("data/*.jsonl.zst", field="content")
    for text in corpus.texts("train"):
        ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import gzip
import hashlib
import io
import json
import os
import sys
import sysconfig
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Literal

from vocabjax.errors import UserError
from vocabjax.progress import Progress

BUILTIN = "builtin"
BUILTIN_LABEL = "builtin (Python standard library: code-heavy text)"

Split = Literal["train", "heldout", "all"]
SPLITS: tuple[str, ...] = ("train", "heldout", "all")

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
COMPRESSED_SUFFIXES = (".gz", ".zst")
MIB = 1024**2
BUILTIN_MAX_BYTES = 8 * MIB  # the command line's default cap for builtin: a training in seconds


class NotText(UserError):
    """A corpus file that is not UTF-8 text; a corpus skips it, a corpus of only such fails."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A corpus as the user named it; iterate its documents with :meth:`texts`."""

    spec: str  # what the user gave: a file, a directory, a glob, or "builtin"
    field: str = "text"  # the text field of .jsonl records and the column of .parquet files
    held_out: float = 0.1  # fraction of documents (by content hash) in the held-out part
    max_bytes: int | None = None  # stop after this many UTF-8 bytes of documents (before split)
    max_document_bytes: int = MIB  # a longer text file is cut into documents at line ends

    @property
    def is_builtin(self) -> bool:
        return self.spec == BUILTIN

    @property
    def label(self) -> str:
        """The name every output carries: the builtin corpus says that it is code-heavy text."""
        base = BUILTIN_LABEL if self.is_builtin else self.spec
        if self.max_bytes is not None:
            base += f", first {self.max_bytes / MIB:.3g} MiB"
        return base

    def describe(self, split: Split) -> str:
        """The label plus which part of the corpus was used."""
        part = {"train": "train part", "heldout": "held-out part", "all": "all documents"}[split]
        if split == "all":
            return f"{self.label}; {part}"
        return f"{self.label}; {part} ({self.held_out:.0%} held out by document hash)"

    def files(self) -> list[Path]:
        """The files a path corpus reads, in the order it reads them (sorted)."""
        if self.is_builtin:
            return list(_builtin_files())
        return _resolve(self.spec)

    def documents(
        self, split: Split = "all", on_skip: Callable[[NotText], None] | None = None
    ) -> Iterator[str]:
        """Every non-empty document of ``split``; fails with a UserError if there is none.

        A file that is not UTF-8 text (binary, another encoding) is skipped, and reported to
        ``on_skip``; a corpus with no text left is an error that names the first one.
        """
        if split not in SPLITS:
            raise UserError(f"split {split!r} must be one of {', '.join(SPLITS)}")
        if not 0.0 <= self.held_out <= 1.0:
            raise UserError(f"held_out={self.held_out} must be in [0, 1]")
        total_docs = total_bytes = kept = 0
        skipped: list[NotText] = []

        def skip(exc: NotText) -> None:
            skipped.append(exc)
            if on_skip:
                on_skip(exc)

        for text in self._all_documents(skip):
            data = text.encode("utf-8")
            if self.max_bytes is not None and total_bytes + len(data) > self.max_bytes:
                if total_docs:
                    break
                # The first document alone is larger than the cap: keep a prefix of it.
                text = data[: self.max_bytes].decode("utf-8", errors="ignore")
                data = text.encode("utf-8")
            total_docs += 1
            total_bytes += len(data)
            if split == "all" or (split == "heldout") == is_held_out(data, self.held_out):
                kept += 1
                yield text
        if total_docs == 0:
            why = ""
            if skipped:
                why = (
                    f" ({len(skipped)} file(s) skipped, first: {skipped[0]}; a corpus is UTF-8 "
                    ".txt, .jsonl or .parquet)"
                )
            raise UserError(f"corpus {self.spec!r} holds no text{why}")
        if kept == 0:
            raise UserError(
                f"the {split} part of corpus {self.spec!r} is empty ({total_docs} document(s) in "
                f"all, held_out={self.held_out}); give more documents or another split"
            )

    def texts(self, split: Split = "all", progress: Progress | None = None) -> Iterator[str]:
        """:meth:`documents`, reporting bytes read to ``progress`` every few MiB."""
        if progress is None:
            yield from self.documents(split)
            return
        done = docs = 0
        step = 16 * MIB
        next_report = step
        for text in self.documents(split, on_skip=lambda exc: progress(f"  skipped {exc}")):
            done += len(text.encode("utf-8"))
            docs += 1
            if done >= next_report:
                progress(f"  read {done / MIB:.1f} MiB, {docs} documents")
                next_report += step
            yield text
        progress(f"  read {done / MIB:.1f} MiB, {docs} documents ({split})")

    def _all_documents(self, skip: Callable[[NotText], None]) -> Iterator[str]:
        if self.is_builtin:
            yield from _builtin_documents(self.max_document_bytes)
            return
        for path in self.files():
            try:
                yield from read_file(
                    path, field=self.field, max_document_bytes=self.max_document_bytes
                )
            except NotText as exc:
                skip(exc)


def open_corpus(
    spec: str | Path,
    *,
    field: str = "text",
    held_out: float = 0.1,
    max_bytes: int | None = None,
) -> Corpus:
    """Check that ``spec`` names something readable (``builtin`` or existing paths) now."""
    spec = str(spec)
    if not 0.0 <= held_out <= 1.0:
        raise UserError(f"held_out={held_out} must be in [0, 1]")
    if max_bytes is not None and max_bytes <= 0:
        raise UserError(f"max_bytes={max_bytes} must be positive")
    if not field:
        raise UserError("field must be a non-empty name")
    corpus = Corpus(spec=spec, field=field, held_out=held_out, max_bytes=max_bytes)
    corpus.files()  # raises for a missing path or an empty directory / glob
    return corpus


def default_max_bytes(spec: str | Path) -> int | None:
    """The command line's default cap: all of a user's corpus, 8 MiB of the builtin one."""
    return BUILTIN_MAX_BYTES if str(spec) == BUILTIN else None


def is_held_out(data: bytes, held_out: float) -> bool:
    """Whether a document (its UTF-8 bytes) falls in the held-out part: a hash of its content,
    so the split does not depend on order, file layout or the size cap, and duplicates stay on
    one side."""
    if held_out <= 0.0:
        return False
    if held_out >= 1.0:
        return True
    digest = hashlib.blake2b(data, digest_size=8, person=b"vocabjax-split").digest()
    return int.from_bytes(digest, "big") < held_out * 2**64


def batches(texts: Iterable[str], *, max_docs: int, max_chars: int) -> Iterator[list[str]]:
    """Group a document stream into lists of at most ``max_docs`` documents or about
    ``max_chars`` characters, for batch encoding."""
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if len(batch) >= max_docs or size >= max_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# ---- paths ----------------------------------------------------------------------------------


def _kind(path: Path) -> tuple[str, str]:
    """(format, compression) of a file from its suffixes; unknown formats read as text."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = ""
    if suffixes and suffixes[-1] in COMPRESSED_SUFFIXES:
        compression = suffixes.pop()
    last = suffixes[-1] if suffixes else ""
    if last in JSONL_SUFFIXES:
        return "jsonl", compression
    if last in PARQUET_SUFFIXES:
        return "parquet", compression
    if last in TEXT_SUFFIXES:
        return "txt", compression
    return "", compression


def _resolve(spec: str) -> list[Path]:
    try:
        return _list_files(spec)
    except OSError as exc:  # an unreadable directory or a failing disk while listing
        raise _cannot_read(exc.filename or spec, exc) from None


def _list_files(spec: str) -> list[Path]:
    if any(ch in spec for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not files:
            raise UserError(f"no files match corpus pattern {spec!r}")
        return files
    path = Path(spec)
    if not path.exists():
        raise UserError(f"corpus {spec!r} does not exist (give a file, directory, glob or builtin)")
    if path.is_file():
        return [path]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
        and _kind(p)[0]
    )
    if not files:
        raise UserError(
            f"corpus directory {spec!r} has no .txt, .jsonl or .parquet files "
            "(optionally .gz or .zst compressed)"
        )
    return files


@contextlib.contextmanager
def _open_binary(path: Path, compression: str) -> Iterator[BinaryIO]:
    if compression == ".gz":
        with gzip.open(path, "rb") as f:
            yield f
    elif compression == ".zst":
        try:
            import zstandard
        except ImportError:
            raise UserError(
                f"reading {path} needs the zstandard package: pip install zstandard"
            ) from None
        with open(path, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as f:
            yield f
    else:
        with open(path, "rb") as f:
            yield f


def _decode_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [gzip.BadGzipFile, EOFError, zlib.error]
    with contextlib.suppress(ImportError):
        import zstandard

        errors.append(zstandard.ZstdError)
    return tuple(errors)


def read_file(path: Path, *, field: str = "text", max_document_bytes: int = MIB) -> Iterator[str]:
    """The documents of one corpus file, streamed; format problems and OS errors while reading
    are one UserError line."""
    fmt, compression = _kind(path)
    if fmt == "parquet" and compression:
        raise UserError(f"{path}: compressed parquet files are not read; parquet compresses")
    try:
        if fmt == "parquet":
            yield from _read_parquet(path, field)
            return
        with _open_binary(path, compression) as raw:
            text_io = io.TextIOWrapper(raw, encoding="utf-8", errors="strict", newline="")
            if fmt == "jsonl":
                yield from _read_jsonl(text_io, path, field)
            else:
                yield from _read_text(text_io, path, max_document_bytes)
    except UnicodeDecodeError as exc:
        raise NotText(f"{path} is not UTF-8 text ({exc.reason})") from None
    except _decode_errors() as exc:  # before OSError: gzip.BadGzipFile is one
        raise UserError(f"{path} is not a valid {compression or 'text'} file ({exc})") from None
    except OSError as exc:  # EIO, EISDIR, EACCES, a file removed while listed, ...
        raise _cannot_read(path, exc) from None


def _cannot_read(path: str | Path, exc: OSError) -> UserError:
    return UserError(f"cannot read {str(path)!r}: {exc.strerror or exc}")


def _check_not_binary(chunk: str, path: Path) -> None:
    if "\x00" in chunk:
        raise NotText(f"{path} looks like binary data (it holds NUL bytes)")


def _read_text(f: io.TextIOWrapper, path: Path, max_document_bytes: int) -> Iterator[str]:
    # One document per file; a file longer than max_document_bytes is cut at line ends (a
    # character is at most 4 bytes, so reading max/4 characters never overshoots by much).
    chars = max(1, max_document_bytes // 4)
    first = True
    while True:
        piece = f.read(chars)
        if not piece:
            return
        if not piece.endswith("\n"):
            piece += f.readline()
        if first:
            _check_not_binary(piece, path)
            first = False
        if piece.strip():
            yield piece


def _read_jsonl(f: io.TextIOWrapper, path: Path, field: str) -> Iterator[str]:
    for lineno, line in enumerate(f, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{lineno} is not a JSON line ({exc.msg})") from None
        if not isinstance(record, dict):
            raise UserError(f"{path}:{lineno} is not a JSON object")
        if field not in record:
            fields = ", ".join(sorted(record)[:8]) or "none"
            raise UserError(
                f"{path}:{lineno} has no {field!r} field (fields: {fields}); "
                "choose one with {corpus.field}",
                settings=["corpus.field"],
            )
        value = record[field]
        if value is None:
            continue
        if not isinstance(value, str):
            raise UserError(f"{path}:{lineno} field {field!r} is {type(value).__name__}, not text")
        if value:
            yield value


def _read_parquet(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            f"reading {path} needs pyarrow: pip install pyarrow (or 'vocabjax[parquet]')"
        ) from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a bad file
        raise UserError(f"{path} is not a readable parquet file ({exc})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise UserError(
            f"{path} has no column {field!r} (columns: {', '.join(names[:8])}); "
            "choose one with {corpus.field}",
            settings=["corpus.field"],
        )
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        for value in batch.column(0).to_pylist():
            if value is None:
                continue
            if not isinstance(value, str):
                raise UserError(f"{path} column {field!r} holds {type(value).__name__}, not text")
            if value:
                yield value


# ---- the builtin corpus ---------------------------------------------------------------------


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.cache
def _builtin_files() -> list[Path]:
    """The standard library's .py files (not site-packages), sorted by relative path."""
    root = _stdlib()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "__pycache__")]
        found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _builtin_prose() -> Iterator[str]:
    """pydoc's topics (the language reference), then the docstrings of the C modules compiled
    into this interpreter, one document per topic or module."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    for key in sorted(topics):
        if topics[key].strip():
            yield topics[key]
    for name in sorted(sys.builtin_module_names):
        module = sys.modules.get(name)
        if module is None:
            try:
                module = __import__(name)
            except ImportError:
                continue
        docs = [module.__doc__ or ""]
        for attr in sorted(dir(module)):
            obj = getattr(module, attr, None)
            doc = getattr(obj, "__doc__", None) if callable(obj) else None
            if isinstance(doc, str) and not attr.startswith("_"):
                docs.append(f"{attr}\n{doc}")
        text = "\n\n".join(d for d in docs if d.strip())
        if text:
            yield text


def _builtin_documents(max_document_bytes: int) -> Iterator[str]:
    yield from _builtin_prose()
    for path in _builtin_files():
        try:
            yield from read_file(path, max_document_bytes=max_document_bytes)
        except NotText:
            continue  # a few test files are deliberately not UTF-8; skip them, deterministically
