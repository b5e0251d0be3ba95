"""Run ``cli.py`` and SIGKILL it at one moment of its output write (for tests/test_outputs.py).

    python tests/kill_driver.py MOMENT TARGET -- CLI ARGS...

MOMENT: ``write`` (the first fsync of a temporary file: data written, nothing committed),
``commit`` (just before the temporary file or directory is moved to TARGET) or ``committed``
(just after). The process dies by ``kill -9`` of itself, so no Python clean-up runs.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vocabjax import outputs  # noqa: E402


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    moment, target, sep, *args = sys.argv[1:]
    assert sep == "--" and moment in ("write", "commit", "committed")
    target_path = Path(target).resolve()
    real_fsync = os.fsync

    def fsync(fd):
        real_fsync(fd)
        if moment == "write":
            die()

    def at_commit(real):
        def commit(tmp, path):
            mine = Path(path).resolve() == target_path
            if mine and moment == "commit":
                die()
            real(tmp, path)
            if mine and moment == "committed":
                die()

        return commit

    os.fsync = fsync
    outputs._commit_file = at_commit(outputs._commit_file)
    outputs._commit_dir = at_commit(outputs._commit_dir)
    import cli

    cli.main(args, prog_name="cli.py")


if __name__ == "__main__":
    main()
