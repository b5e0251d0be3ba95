"""Data-parallel and sharded training on JAX's own sharding: a ``(data, model)`` mesh over
``jax.devices()``, each step's windows split over ``data``, the token tables (embedding and
head matrices) split along V over ``model``, everything else replicated. XLA's SPMD partitioner
inserts the collectives (the gradient all-reduce over ``data``, the gathers of table rows and
the logit reductions over ``model``); the maths is the one-device step's, so results agree to
float rounding.

    spec = MeshSpec.parse("data=2,model=2")
    train(config, "runs/x", mesh=spec)

Multi-host: every process runs the same command after ``jax.distributed.initialize()``; the
data order is a pure function of (seed, step), so each process builds the same global batch and
hands its devices their slices (``jax.make_array_from_callback``); process 0 writes the run
directory from arrays gathered to it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from vocabjax.errors import UserError

AXES = ("data", "model")
_SPEC = re.compile(r"^data=(\d+)(?:,model=(\d+))?$")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """How many devices split the batch and the token tables."""

    data: int = 1  # devices the windows of each step are split over
    model: int = 1  # devices the embedding and head matrices are split over, along V

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(
                    f"{{mesh}} {axis}={value!r} must be a positive integer", settings=["mesh"]
                )

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """``data=N`` or ``data=N,model=M``."""
        m = _SPEC.match(text.replace(" ", ""))
        if m is None:
            raise UserError(
                f"{{mesh}} {text!r} must read data=N or data=N,model=M", settings=["mesh"]
            )
        return cls(int(m[1]), int(m[2] or 1))

    @property
    def size(self) -> int:
        return self.data * self.model

    def __str__(self) -> str:
        return f"data={self.data},model={self.model}"

    def check_devices(self, devices: int) -> None:
        if devices % self.size:
            raise UserError(
                f"{{mesh}} {self} ({self.size} devices) does not divide the {devices} devices",
                settings=["mesh"],
            )

    def check(self, *, batch: int, tables: Iterable[tuple[str, int]], devices: int) -> None:
        """One UserError for a mesh that does not divide the devices, the batch, or the rows
        of a token table (``(name, rows)``) it splits."""
        self.check_devices(devices)
        if batch % self.data:
            raise UserError(
                f"{{mesh}} {self} does not divide {{batch}} {batch}: each of the {self.data} "
                "data devices takes an equal share of the windows",
                settings=["mesh", "batch"],
            )
        for name, rows in tables:
            if rows % self.model:
                raise UserError(
                    f"{{mesh}} {self} does not divide the {rows} rows of {name}: give a head "
                    f"size that model={self.model} divides, or model=1",
                    settings=["mesh"],
                )

    def make(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        devices = list(jax.devices() if devices is None else devices)
        self.check_devices(len(devices))
        return Mesh(np.array(devices[: self.size]).reshape(self.data, self.model), AXES)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a run's arrays live on a mesh: ``tables`` (parameter names) split along their rows
    over ``model``, batches split over ``data``, the rest replicated."""

    mesh: Mesh
    tables: frozenset[str]  # parameters whose rows are token ids

    def _table(self, path: tuple[Any, ...]) -> bool:
        return any(getattr(k, "key", None) in self.tables for k in path)

    def like(self, tree) -> Any:
        """The sharding of each leaf of a parameter tree, or of an optimizer state whose
        moments are keyed by parameter name."""
        rows = NamedSharding(self.mesh, PartitionSpec("model", None))
        whole = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree_util.tree_map_with_path(
            lambda path, x: rows if self._table(path) and np.ndim(x) == 2 else whole, tree
        )

    @property
    def batch(self) -> NamedSharding:
        """Windows (..., B, T) split over ``data`` along B."""
        return NamedSharding(self.mesh, PartitionSpec(None, "data", None))

    @property
    def rows(self) -> NamedSharding:
        """Evaluation windows (B, T) split over ``data`` along B."""
        return NamedSharding(self.mesh, PartitionSpec("data", None))

    @property
    def whole(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def put(self, tree, shardings=None) -> Any:
        """A tree of host or device arrays laid out as ``shardings`` (default ``like(tree)``);
        every process holds the whole value and gives its devices their slices."""
        shardings = self.like(tree) if shardings is None else shardings
        return jax.tree.map(_place, tree, shardings)


def _place(x, sharding: NamedSharding) -> jax.Array:
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(x) -> np.ndarray:
    """A (possibly sharded, possibly multi-host) array as one numpy array on this process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
