"""What every benchmark prints first: when, on what device, and the command that made it."""

from __future__ import annotations

import datetime
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import jax


def header(script: str, argv: Sequence[str] | None, details: str) -> dict[str, str]:
    """Print ``# <UTC time>; device <kind (backend), processor, jax version>; <details>`` and
    ``# command: python benchmarks/<script> <args>``; return them as date, device, command."""
    device = jax.devices()[0]
    backend = jax.default_backend()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    where = (
        f"{getattr(device, 'device_kind', backend)} ({backend}), "
        f"{platform.processor() or platform.machine()}, jax {jax.__version__}"
    )
    args = " ".join(argv or sys.argv[1:])
    command = f"python benchmarks/{Path(script).name} {args}".strip()
    print(f"# {stamp}; device {where}; {details}")
    print(f"# command: {command}")
    return {"date": stamp, "device": where, "command": command}
