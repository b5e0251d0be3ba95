"""KV-aware admission: how many sequences the engine may hold, from the simulator's KV-cache plan
for a memory budget, and the first-come-first-served rule that keeps within it.

    plan = plan_memory(run, 2 * 1024**3, prompt_bytes=180, max_new_tokens=32,
                       bytes_per_token={1024: 2.6, 2048: 2.9, 4096: 3.2})
    plan.b_max[4096]                                # the largest running batch at head 4096
    n, wait = admit_count(need, held_bytes=..., running=..., cap=..., plan=plan)

The plan is the simulator's KV-cache plan for the run's own shape: B_max(V) = floor((M -
weights) / KV bytes per sequence), ``CostModel.b_max``'s formula, with ``CostModel.
kv_bytes_per_seq`` for a sequence of the served prompts' mean bytes at head V's bytes per token
plus ``max_new_tokens`` generated tokens, and the weights as the run holds them: its nested
heads share one matrix of the largest V, which every head's plan counts (the simulator's
``b_max`` prices a model of vocabulary V alone). A larger head packs the same prompt into fewer
tokens, so its sequences need less cache and more of them fit. That caps each head's running
batch.

The plan is for the mean sequence; the engine also counts what it actually holds: every held
sequence reserves the cache positions it may come to fill (its prompt tokens plus its
``max_new_tokens`` - 1 fed-back tokens, at most max_seq) times the bytes of one position, and
the reservations of all heads together stay within the budget less the run's weights. A request
joins only when both allow it; otherwise it waits, and the server says so.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np

from vocabjax.compression import CompressionCurve
from vocabjax.costmodel import CostModel, Settings
from vocabjax.errors import UserError
from vocabjax.hardware import DeviceProfile
from vocabjax.serving.engine import LoadedRun
from vocabjax.xp import PyMath

CPU_MEMORY = 2 * 1024**3  # the budget on a host without a device memory limit (the CPU)


def default_memory() -> tuple[int, str]:
    """The memory budget when none is given: the first device's memory limit, or 2 GiB on a
    CPU (which reports none); and where it came from."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit:
        return int(limit), f"{jax.devices()[0].device_kind}'s memory"
    return CPU_MEMORY, "the CPU default"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How many sequences the engine may hold."""

    memory_bytes: int  # M: the budget
    weight_bytes: int  # the run's parameters as held (one copy serves every head)
    kv_bytes_per_token: int  # 2 L K Dh k: one cached position of one sequence
    max_seq: int  # positions a sequence may fill
    b_max: Mapping[int, int]  # head -> the simulator's largest batch for the budget
    source: str  # one line: the budget and what the plan assumed

    @property
    def kv_budget(self) -> int:
        """Bytes left for the KV cache beside the weights."""
        return self.memory_bytes - self.weight_bytes

    def sequence_bytes(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The cache a sequence may come to fill: its prompt and every generated token fed back
        (the last one never is), at most max_seq positions."""
        return min(prompt_tokens + max_new_tokens - 1, self.max_seq) * self.kv_bytes_per_token

    def to_json(self) -> dict[str, Any]:
        return {
            "memory_bytes": self.memory_bytes,
            "weight_bytes": self.weight_bytes,
            "kv_budget_bytes": self.kv_budget,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "b_max": [{"head": v, "b_max": b} for v, b in sorted(self.b_max.items())],
            "source": self.source,
        }


def plan_memory(
    run: LoadedRun,
    memory_bytes: int,
    *,
    prompt_bytes: float,
    max_new_tokens: float,
    bytes_per_token: Mapping[int, float],
    where: str = "",
) -> MemoryPlan:
    """The KV plan of ``run``'s shape for a budget of ``memory_bytes``: per head, the largest
    batch of sequences of ``prompt_bytes`` (at the head's ``bytes_per_token``) plus
    ``max_new_tokens`` that fits beside the run's weights; and the weights and bytes per cached
    position, as held."""
    heads = tuple(sorted(run.heads))
    kv_dtype = run.config.model_config.compute_dtype  # the cache is kept in the compute dtype
    weight_bytes = sum(int(x.size) * x.dtype.itemsize for x in run.params.values())
    kv_item = np.dtype(run.model.config.dtype).itemsize
    per_token = run.config.shape.kv_elements_per_token * kv_item
    if memory_bytes <= weight_bytes:
        raise UserError(
            f"{{memory}} {memory_bytes:,} bytes does not hold the run's weights "
            f"({weight_bytes:,} bytes): give a larger budget",
            settings=["memory"],
        )
    # The KV plan reads no speed of a device: these are placeholders.
    device = DeviceProfile(
        name="memory budget",
        peak_flops={"f32": 1.0},
        hbm_bandwidth=1.0,
        memory_bytes=float(memory_bytes),
        launch_overhead_s=0.0,
        source="serve: a memory budget for the KV plan (speeds not read)",
    )
    # A larger nested head never packs fewer bytes per token; a few prompts may say otherwise.
    betas = np.maximum.accumulate([bytes_per_token[v] for v in heads])
    curve = CompressionCurve(f"the served prompts{where}", heads, tuple(map(float, betas)))
    b_max = {}
    for v, beta in zip(heads, betas, strict=True):
        settings = Settings(
            prompt_bytes=float(prompt_bytes),
            output_bytes=float(max_new_tokens * beta),  # max_new_tokens tokens at this head
            weight_dtype="f32",  # parameters are stored in float32
            kv_dtype=kv_dtype,
        )
        per_seq = CostModel(device, run.config.shape, settings, curve).kv_bytes_per_seq(
            float(v), xp=PyMath
        )
        b_max[v] = max(math.floor((memory_bytes - weight_bytes) / per_seq), 0)
    source = (
        f"KV plan of {run.config.shape.name} for prompts of {prompt_bytes:.0f} bytes "
        f"and {max_new_tokens:g} new tokens, bytes per token "
        + ", ".join(f"{v}: {b:.2f}" for v, b in zip(heads, betas, strict=True))
    )
    return MemoryPlan(memory_bytes, weight_bytes, per_token, run.max_seq, b_max, source)


Wait = Literal["rows", "memory"]


def admit_count(
    need_bytes: Sequence[int],
    *,
    held_bytes: int,
    running: int,
    max_batch: int,
    b_max: int,
    kv_budget: int,
) -> tuple[int, Wait | None]:
    """How many of the waiting requests (their ``need_bytes`` at the head, in arrival order)
    join a head that runs ``running`` now, first come first served, and why the next one
    waits: ``"rows"`` (the head holds ``max_batch``) or ``"memory"`` (it holds ``b_max``, or
    the next one's cache would take the reservations of every head past ``kv_budget``)."""
    cap = min(max_batch, b_max)
    n, held = 0, held_bytes
    for need in need_bytes:
        if running + n >= cap:
            return n, "memory" if b_max < max_batch else "rows"
        if held + need > kv_budget:
            return n, "memory"
        n, held = n + 1, held + need
    return n, None


def human_bytes(n: float) -> str:
    """``1.5 MiB``."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError  # the loop returns at GiB
