"""Every file and directory vocabjax writes goes through this module.

The promises (docs/reliability.md):
- a write is atomic: built under a unique temporary name in the target's own directory, then
  renamed into place, so a kill leaves the previous output or none, never a half-written one;
- an output directory that holds anything but an earlier output of the same kind is refused
  unless the caller asks to replace it (``force``), and an output never replaces its own input;
- an output path is checked before the work that fills it starts (``check_file_target``,
  ``check_output_dir``), and every OS error while writing is one ``UserError`` naming the path;
- files and directories get the usual permissions (0666 / 0777 less the umask), as ``open``
  and ``mkdir`` would give, not the 0600 / 0700 of ``mkstemp`` and ``mkdtemp``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from vocabjax.errors import UserError

SCHEMA = 1  # of every profile, except where a kind has moved on (KIND_SCHEMAS)
# kind -> the schemas a reader accepts, newest (the one written) last. Policy 2: a break-even
# that never comes is null (as in sweep's JSON), and the KV plan's gain has a fixed key.
KIND_SCHEMAS: dict[str, tuple[int, ...]] = {"policy": (1, 2)}


def schemas(kind: str) -> tuple[int, ...]:
    """The schemas of ``kind`` vocabjax reads; the last is the one it writes."""
    return KIND_SCHEMAS.get(kind, (SCHEMA,))


_umask_lock = threading.Lock()


def _umask() -> int:
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def os_error(exc: OSError, path: str | os.PathLike, *, doing: str = "write") -> UserError:
    """One line for an OS error on ``path``: ``cannot write 'x/y.json': Permission denied``."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    return UserError(f"cannot {doing} {str(path)!r}: {reason}")


def _nearest_existing(path: Path) -> Path:
    probe = path
    while not os.path.lexists(probe):
        if probe.parent == probe:
            break
        probe = probe.parent
    return probe


def _probe_directory(directory: Path, target: Path) -> None:
    """Create and remove a uniquely named file in ``directory``: the one check of write access
    that also holds for root, read-only mounts, immutable directories and /proc."""
    try:
        fd, name = tempfile.mkstemp(prefix=".vocabjax-probe.", dir=directory)
    except OSError as exc:
        raise os_error(exc, target) from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)


def _check_parent(path: Path) -> None:
    """The nearest existing ancestor of ``path`` is a directory this process can write in."""
    ancestor = _nearest_existing(path.parent)
    if not ancestor.is_dir():
        raise UserError(f"cannot write {str(path)!r}: {str(ancestor)!r} is not a directory")
    _probe_directory(ancestor, path)


def check_file_target(path: str | os.PathLike, *, what: str = "output") -> Path:
    """Fail before any work on an output file that cannot be written; creates nothing."""
    path = Path(path)
    if not path.name or path.name in (".", ".."):
        raise UserError(f"{what} {str(path)!r} names a directory, not a file")
    if path.is_dir():
        raise UserError(f"{what} {str(path)!r} is a directory, not a file")
    if os.path.lexists(path) and not path.is_file():
        raise UserError(f"{what} {str(path)!r} exists and is not a regular file")
    _check_parent(path)
    return path


def check_target_dir(path: str | os.PathLike, *, what: str = "output") -> Path:
    """Fail before any work on a directory that files will be written into (a training run):
    it exists and takes a new file, or can be created; creates nothing."""
    path = Path(path)
    if os.path.lexists(path) and not path.is_dir():
        raise UserError(f"{what} directory {str(path)!r} exists and is not a directory")
    if path.is_dir():
        _probe_directory(path, path)
    else:
        _check_parent(path)
    return path


def _marker_kind(directory: Path, marker: str) -> Any:
    """The ``kind`` of ``directory/marker`` when it is a vocabjax JSON file, else None."""
    try:
        with open(directory / marker, encoding="utf-8") as f:
            data = json.loads(f.read(1 << 20))
    except (OSError, ValueError, RecursionError):
        return None
    return data.get("kind") if isinstance(data, dict) else None


def check_output_dir(
    path: str | os.PathLike,
    *,
    marker: str,
    kind: str,
    what: str,
    force: bool = False,
    inputs: Iterable[str | os.PathLike] = (),
) -> Path:
    """Fail before any work on an output directory that the write would damage.

    ``path`` may be new, empty, or an earlier output of this ``kind`` (its ``marker`` file
    says so); anything else is refused unless ``force``. It may never be, or lie inside, the
    current directory's parents or one of the ``inputs`` it is made from. Creates nothing.
    """
    path = Path(path)
    resolved = path.resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise UserError(
            f"{what} directory {str(path)!r} is the current directory or one above it; "
            "name a new directory"
        )
    for source in inputs:
        src = Path(source).resolve()
        if resolved == src or resolved in src.parents:
            raise UserError(
                f"{what} directory {str(path)!r} would replace its own input {str(source)!r}; "
                "name another directory"
            )
    if os.path.lexists(path) and not path.is_dir():
        raise UserError(f"{what} directory {str(path)!r} exists and is not a directory")
    if path.is_dir():
        try:
            with os.scandir(path) as entries:
                empty = not any(entries)
        except OSError as exc:
            raise os_error(exc, path, doing="read") from None
        if not empty and not force and _marker_kind(path, marker) != kind:
            raise UserError(
                f"{what} directory {str(path)!r} holds other files (no {marker} of kind "
                f"{kind!r}); choose a new directory, or force to replace it"
            )
        _probe_directory(path.parent if path.parent != path else path, path)
    else:
        _check_parent(path)
    return path


def _commit_file(tmp: str | Path, path: Path) -> None:
    os.replace(tmp, path)


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _commit_dir(tmp: Path, path: Path) -> None:
    """Put the finished ``tmp`` at ``path``. A previous ``path`` is swapped out in one step
    where the system can; elsewhere it waits at ``.NAME.old`` between two renames (readers such
    as train.checkpoint fall back to it after a kill between them)."""
    if not path.exists():
        os.replace(tmp, path)
        return
    if _exchange(tmp, path):
        shutil.rmtree(tmp, ignore_errors=True)  # now the previous output
        return
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _mkdirs(directory: Path, target: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error(exc, target) from None


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Call ``write(f)`` on a binary file under a unique temporary name beside ``path``, sync
    it, then rename it over ``path``. On any failure ``path`` is as it was and the temporary
    file is gone; an OS error is one UserError naming ``path``."""
    path = Path(path)
    if not path.name or path.name in (".", ".."):
        raise UserError(f"cannot write {str(path)!r}: it names a directory, not a file")
    parent = path.parent
    _mkdirs(parent, path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise os_error(exc, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        _commit_file(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise os_error(exc, path) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    data = text.encode("utf-8")
    return atomic_write(path, lambda f: f.write(data))


def _check_finite(obj: Any, where: str) -> None:
    if isinstance(obj, float) and not math.isfinite(obj):
        raise UserError(f"{where}: refusing to write a non-finite number ({obj})")
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _check_finite(v, f"{where}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _check_finite(v, f"{where}[{i}]")


def dumps(obj: Mapping[str, Any]) -> str:
    """JSON text of a profile; NaN and infinities are refused rather than written."""
    _check_finite(obj, "profile")
    return json.dumps(obj, indent=2, allow_nan=False) + "\n"


def atomic_write_json(path: str | os.PathLike, obj: Mapping[str, Any]) -> Path:
    """Write a profile dict (which must hold ``schema`` and ``kind``) atomically."""
    if "kind" not in obj or obj.get("schema") != schemas(obj["kind"])[-1]:
        raise ValueError("a profile needs a 'kind' and the newest 'schema' of that kind")
    return atomic_write_text(path, dumps(obj))


def save_npz(path: str | os.PathLike, arrays: Mapping[str, Any]) -> Path:
    """NumPy arrays in one ``.npz`` file, atomically."""
    import numpy as np

    return atomic_write(path, lambda f: np.savez(f, **arrays))


def save_figure(fig, path: str | os.PathLike, *, dpi: int = 120) -> Path:
    """A matplotlib figure, in the format its suffix names, atomically."""
    fmt = Path(path).suffix.lstrip(".").lower()
    return atomic_write(path, lambda f: fig.savefig(f, format=fmt, dpi=dpi, bbox_inches="tight"))


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Build a directory in a temporary sibling and move it into place only on success.

    On any exception the temporary directory is removed and ``path`` is untouched. An existing
    ``path`` is replaced whole: callers check it first with ``check_output_dir``.
    """
    path = Path(path)
    if not path.name or path.name in (".", ".."):
        path = path.resolve()
    if os.path.lexists(path) and not path.is_dir():
        raise UserError(f"{str(path)!r} exists and is not a directory")
    _mkdirs(path.parent, path)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        os.chmod(tmp, 0o777 & ~_umask())
    except OSError as exc:
        raise os_error(exc, path) from None
    try:
        yield tmp
        _commit_dir(tmp, path)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise os_error(exc, path) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
