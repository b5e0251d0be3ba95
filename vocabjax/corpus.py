"""Streaming text corpora: files, directories and globs of ``.txt``, ``.jsonl`` and ``.parquet``
(optionally ``.gz`` or ``.zst`` compressed), a deterministic train / held-out split by document
hash, and two builtin corpora that every fresh machine can make from what it ships, never
downloaded: ``builtin`` (the running Python's standard library: code-heavy text) and
``builtin-prose`` (documentation in English prose: Python's language reference and docstrings,
installed packages' descriptions, and, where the system ships them, its documentation, licences
and man pages).

Nothing here loads a corpus into memory: documents are yielded one at a time, and a large text
file is cut into documents of at most ``max_document_bytes`` at line boundaries.

    corpus = open_corpus("data/*.jsonl.zst", field="content")
    for text in corpus.texts("train"):
        ...
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import glob
import gzip
import hashlib
import heapq
import io
import json
import os
import re
import sys
import sysconfig
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO, Literal

from vocabjax.errors import UserError
from vocabjax.progress import Progress

BUILTIN = "builtin"
BUILTIN_LABEL = "builtin (Python standard library: code-heavy text)"
PROSE = "builtin-prose"
PROSE_LABEL = (
    "builtin-prose (English prose this machine ships: Python's reference and docstrings, "
    "package descriptions, system docs, licences and man pages; made here, not downloaded)"
)

Split = Literal["train", "heldout", "all"]
SPLITS: tuple[str, ...] = ("train", "heldout", "all")

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
COMPRESSED_SUFFIXES = (".gz", ".zst")
MIB = 1024**2
BUILTIN_MAX_BYTES = 8 * MIB  # the command line's default cap for a builtin corpus: seconds to train


class NotText(UserError):
    """A corpus file that is not UTF-8 text; a corpus skips it, a corpus of only such fails."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A corpus as the user named it; iterate its documents with :meth:`texts`."""

    spec: str  # what the user gave: a file, a directory, a glob, or a builtin corpus's name
    field: str = "text"  # the text field of .jsonl records and the column of .parquet files
    held_out: float = 0.1  # fraction of documents (by content hash) in the held-out part
    max_bytes: int | None = None  # stop after this many UTF-8 bytes of documents (before split)
    max_document_bytes: int = MIB  # a longer text file is cut into documents at line ends

    @property
    def is_builtin(self) -> bool:
        return self.spec in BUILTINS

    @property
    def label(self) -> str:
        """The name every output carries: a builtin corpus says what kind of text it is."""
        base = BUILTINS[self.spec].label if self.is_builtin else self.spec
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
            return list(BUILTINS[self.spec].files())
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
            yield from BUILTINS[self.spec].documents(self.max_document_bytes)
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
    """The command line's default cap: all of a user's corpus, 8 MiB of a builtin one."""
    return BUILTIN_MAX_BYTES if str(spec) in BUILTINS else None


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


def _pydoc_topics() -> Iterator[str]:
    """pydoc's topics (the language reference), one document per topic."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    for key in sorted(topics):
        if topics[key].strip():
            yield topics[key]


def _c_module_docs() -> Iterator[str]:
    """The docstrings of the C modules compiled into this interpreter, one document each."""
    for name in sorted(sys.builtin_module_names):
        module = sys.modules.get(name)
        if module is None:
            # read for its docstrings only: a module's own deprecation (spwd on 3.12) is not ours
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
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
    yield from _pydoc_topics()
    yield from _c_module_docs()
    for path in _builtin_files():
        try:
            yield from read_file(path, max_document_bytes=max_document_bytes)
        except NotText:
            continue  # a few test files are deliberately not UTF-8; skip them, deterministically


# ---- the builtin prose corpus ---------------------------------------------------------------

SHARE = Path("/usr/share")  # where a Unix system keeps its documentation (absent elsewhere)
DOC_NAMES = ("readme", "news", "faq", "todo", "howto", "intro")  # /usr/share/doc names read
DOC_SUFFIXES = (".txt", ".md", ".rst")
MAN_SECTIONS = ("man1", "man5", "man7", "man8")  # commands, formats, overviews, admin
MIN_LETTER_SHARE = 0.7  # below this share of letters and spaces a text is a table or data
_TEST_DIRS = ("site-packages", "__pycache__", "test", "tests", "idlelib")


@functools.cache
def _prose_paths() -> dict[str, tuple[Path, ...]]:
    """The files each file-backed prose source reads, sorted; missing roots give none."""
    stdlib = _stdlib()
    docs = [
        p
        for p in _walk(SHARE / "doc")
        if _doc_name(p.name.removesuffix(".gz").lower()) and not p.is_symlink()
    ]
    licences = [p for p in _walk(SHARE / "common-licenses") if not p.is_symlink()]
    licences += [p for p in (stdlib / "LICENSE.txt",) if p.is_file()]
    man = [
        p
        for section in MAN_SECTIONS
        for p in _walk(SHARE / "man" / section)
        if p.name.endswith(".gz") and not p.is_symlink()
    ]
    packages = {
        Path(p) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])
    }
    metadata = [m for root in sorted(packages) for m in sorted(root.glob("*.dist-info/METADATA"))]
    code = [p for p in _builtin_files() if not set(p.relative_to(stdlib).parts) & set(_TEST_DIRS)]
    return {
        "docs": tuple(docs),
        "licences": tuple(licences),
        "man": tuple(man),
        "packages": tuple(metadata),
        "docstrings": tuple(code),
    }


def _walk(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [Path(d, f) for d, _, files in os.walk(root) for f in files]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _doc_name(name: str) -> bool:
    return name.startswith(DOC_NAMES) or name.endswith(DOC_SUFFIXES)


def _prose_files() -> list[Path]:
    return sorted({p for paths in _prose_paths().values() for p in paths})


def _read_shipped(path: Path) -> str | None:
    """A shipped file's text (gunzipped), or None when it is not UTF-8 text or not readable:
    what a system ships is not the user's mistake, so it is skipped, not reported."""
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        text = data.decode("utf-8")
    except (OSError, EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError):
        return None
    return None if "\x00" in text else text


def _shipped(paths: Iterable[Path], convert: Callable[[str], str] = str) -> Iterator[str]:
    for path in paths:
        text = _read_shipped(path)
        if text is not None:
            yield convert(text)


def _package_description(metadata: str) -> str:
    """The body of a METADATA file (its long description: the package's README)."""
    _, _, body = metadata.partition("\n\n")
    return body


def _docstrings(paths: Iterable[Path]) -> Iterator[str]:
    """The docstrings of each module, class and function of a file, read by ``ast`` (never
    imported: importing some standard modules has side effects), one document per file."""
    for path in paths:
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docs = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds)]
        text = "\n\n".join(d for d in docs if d and d.strip())
        if text:
            yield text + "\n"


_ROFF_TEXT_MACROS = {"SH", "SS", "B", "I", "BR", "RB", "IR", "RI", "BI", "IB", "SM", "SB", "IP"}
_ROFF_BREAKS = {"PP", "LP", "P", "TP", "HP", "sp", "br", "SH", "SS", "IP"}
_ROFF_GLYPHS = {"em": "--", "en": "-", "hy": "-", "bu": "*", "lq": '"', "rq": '"', "aq": "'"}
_ROFF_ESCAPE = re.compile(
    r"\\f(?:\[[^\]]*\]|\(..|.)"  # font changes
    r"|\\\((..)"  # a named glyph: \(em
    r"|\\\[([^\]]*)\]"  # a named glyph: \[em]
    r"|\\\*(?:\[[^\]]*\]|\(..|.)"  # a string: \*(L"
    r"|\\[sv]'?[-+]?\d+'?"  # size and vertical motion
    r"|\\(.)"  # any other escaped character
)


def _roff_escape(m: re.Match) -> str:
    glyph = m[1] or m[2]
    if glyph is not None:
        return _ROFF_GLYPHS.get(glyph, "")
    char = m[3]
    if char is None:
        return ""
    return {"-": "-", "e": "\\", " ": " ", "~": " ", "0": " "}.get(char, "")


def _roff_text(source: str) -> str:
    """The running text of a man page: macro lines reduced to their words (headings,
    fonts), requests, comments and macro definitions dropped, escapes resolved."""
    out: list[str] = []
    defining = False
    for line in source.splitlines():
        if defining:
            defining = line.strip() != ".."
            continue
        line = line.split('\\"', 1)[0]  # a comment runs to the end of its line
        if line.startswith((".", "'")) and not line[1:].strip():
            continue
        if line.startswith((".", "'")):
            name, _, args = line[1:].strip().partition(" ")
            if name in ("de", "de1", "am"):
                defining = True
                continue
            if name in _ROFF_BREAKS and out and out[-1]:
                out.append("")
            if name not in _ROFF_TEXT_MACROS:
                continue
            line = " ".join(word.strip('"') for word in args.split())
        out.append(_ROFF_ESCAPE.sub(_roff_escape, line))
    return "\n".join(out).strip() + "\n"


def _is_prose(text: str) -> bool:
    """Whether most of a text (its first 4k characters) is letters and spaces, not a table,
    data or markup."""
    head = text[:4096]
    return bool(head) and len(_LETTERS_OR_SPACE.findall(head)) >= MIN_LETTER_SHARE * len(head)


_LETTERS_OR_SPACE = re.compile(r"[^\W\d_]|\s")


def _prose_sources() -> list[Iterator[str]]:
    """Each prose source's documents: Python's reference, installed packages' descriptions,
    the standard library's docstrings, and what /usr/share holds (docs, licences, man pages)."""
    paths = _prose_paths()
    return [
        _pydoc_topics(),
        _shipped(paths["packages"], _package_description),
        _docstrings(paths["docstrings"]),
        _shipped(paths["docs"]),
        _shipped(paths["licences"]),
        _shipped(paths["man"], _roff_text),
    ]


def _interleave(sources: Iterable[Iterator[str]]) -> Iterator[str]:
    """Documents of all sources, next from the one that has given the fewest bytes, so that a
    cap on the corpus takes a like share of each source."""
    queue = [(0, i, it) for i, it in enumerate(sources)]
    heapq.heapify(queue)
    while queue:
        given, i, it = heapq.heappop(queue)
        text = next(it, None)
        if text is not None:
            yield text
            heapq.heappush(queue, (given + len(text.encode("utf-8")), i, it))


def _prose_documents(max_document_bytes: int) -> Iterator[str]:
    """Prose documents, each at most ``max_document_bytes`` (cut at line ends), each text once."""
    seen: set[bytes] = set()
    for text in _interleave(_prose_sources()):
        for piece in _read_text(io.StringIO(text), Path(PROSE), max_document_bytes):
            digest = hashlib.blake2b(piece.encode("utf-8"), digest_size=16).digest()
            if digest not in seen and _is_prose(piece):
                seen.add(digest)
                yield piece


@dataclasses.dataclass(frozen=True)
class Builtin:
    """A corpus every machine makes from what it ships, named by a ``spec`` of its own."""

    name: str  # the spec that names it
    label: str  # what every output says it is
    files: Callable[[], list[Path]]  # the files it reads (sorted)
    documents: Callable[[int], Iterator[str]]  # its documents, given max_document_bytes


BUILTINS: Mapping[str, Builtin] = {
    b.name: b
    for b in (
        Builtin(BUILTIN, BUILTIN_LABEL, _builtin_files, _builtin_documents),
        Builtin(PROSE, PROSE_LABEL, _prose_files, _prose_documents),
    )
}
