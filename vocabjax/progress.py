"""How long-running calls (autotune, training, validation, serving a trace, reading a corpus)
report progress: a callable given one line of text at a time; the CLI passes one that writes
to stderr, the library's default says nothing."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str], None]
