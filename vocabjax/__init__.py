"""vocabjax: choose the tokenizer vocabulary size for how the model will be served.

    import vocabjax as vj
    res = vj.sweep(device="a10g", model="paper-100m", batch=[1, 256], lam=[0, 100])
    res.v_star                    # [B, lam] vocabulary sizes, vj.NO_VOCAB (0) where none fits

The stable surface (docs/api.md): ``sweep``, ``objective``, ``plan``, ``cost_model``,
``load_device``, ``load_shape``, ``load_run``, ``Engine``, ``unembed``. Each name is imported on
first use (PEP 562), so ``import vocabjax`` loads neither jax nor flax and compiles nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> (module, attribute); attribute None: the module itself
_LAZY: dict[str, tuple[str, str | None]] = {
    "sweep": ("vocabjax.api", "sweep"),
    "objective": ("vocabjax.api", "objective"),
    "plan": ("vocabjax.api", "plan"),
    "cost_model": ("vocabjax.api", "cost_model"),
    "Sweep": ("vocabjax.api", "Sweep"),
    "Deployment": ("vocabjax.api", "Deployment"),
    "NO_VOCAB": ("vocabjax.lifecycle", "NO_VOCAB"),
    "TrafficClass": ("vocabjax.planning", "TrafficClass"),
    "DeviceProfile": ("vocabjax.hardware", "DeviceProfile"),
    "ModelShape": ("vocabjax.shapes", "ModelShape"),
    "UserError": ("vocabjax.errors", "UserError"),
    "load_device": ("vocabjax.hardware", "load_device"),
    "load_shape": ("vocabjax.shapes", "load_shape"),
    "load_compression": ("vocabjax.compression", "load_compression"),
    "load_training": ("vocabjax.trainprofile", "load_training"),
    "load_run": ("vocabjax.serving", "load_run"),
    "Engine": ("vocabjax.serving", "Engine"),
    "unembed": ("vocabjax.unembed", None),
}

__all__ = [  # the keys of _LAZY, spelled out so that linters and editors see them
    "Deployment",
    "DeviceProfile",
    "Engine",
    "ModelShape",
    "NO_VOCAB",
    "Sweep",
    "TrafficClass",
    "UserError",
    "__version__",
    "cost_model",
    "load_compression",
    "load_device",
    "load_run",
    "load_shape",
    "load_training",
    "objective",
    "plan",
    "sweep",
    "unembed",
]


def _load(name: str) -> Any:
    module, attr = _LAZY[name]
    mod = importlib.import_module(module)
    return mod if attr is None else getattr(mod, attr)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'vocabjax' has no attribute {name!r}")
    value = _load(name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from vocabjax import unembed
    from vocabjax.api import (
        Deployment,
        Sweep,
        cost_model,
        objective,
        plan,
        sweep,
    )
    from vocabjax.compression import load_compression
    from vocabjax.errors import UserError
    from vocabjax.hardware import DeviceProfile, load_device
    from vocabjax.lifecycle import NO_VOCAB
    from vocabjax.planning import TrafficClass
    from vocabjax.serving import Engine, load_run
    from vocabjax.shapes import ModelShape, load_shape
    from vocabjax.trainprofile import load_training
