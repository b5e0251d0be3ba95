"""The `gpu` validation grid that benchmarks/gpu_check.py times on a lent card, checked here where
no card is: every point is kept, the points fit a card's memory, and enough of them fall in the
fit split to calibrate on; each card is priced on its own builtin profile; and on a GPU the f32
matmuls run at the f32 precision they are priced at, not JAX's default TF32."""

import importlib.util
import types
from pathlib import Path

import jax

from vocabjax.calibration import MIN_FIT_SAMPLES, is_held_out
from vocabjax.hardware import BUILTIN_DEVICES, load_device
from vocabjax.validation import MEASURE, Result, call_flops, get_grid, predict
from vocabjax.validation.fit import sample
from vocabjax.validation.grid import STEP_FAMILIES
from vocabjax.validation.run import matmuls_as_priced
from vocabjax.validation.timing import resident_bytes

GPU_CHECK = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_the_gpu_grid_keeps_every_point_fits_a_card_and_can_be_fitted():
    grid, card = get_grid("gpu"), load_device("h100-sxm")
    points = grid.points()
    priced = [(p, predict(p, card, decode_steps=grid.decode_steps)) for p in points]
    assert all(call_flops(p, q, grid.decode_steps) <= grid.max_flops for p, q in priced)
    (shape,) = {p.shape for p in points}
    # validate's own check: 70% of what the device reports, on a GPU the 75% of its memory
    # JAX's allocator takes by default (XLA_PYTHON_CLIENT_MEM_FRACTION)
    assert resident_bytes(shape, points, grid) <= 0.7 * 0.75 * card.memory_bytes
    steps = [
        sample(Result(p, q, q.predicted_s, 0.0)) for p, q in priced if p.family in STEP_FAMILIES
    ]
    fitted = [s for s in steps if not is_held_out(s.split_key)]
    assert MIN_FIT_SAMPLES <= len(fitted) < len(steps)  # some held out, enough left to fit


def test_each_card_is_priced_on_its_builtin_profile():
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    for kind, name in [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA L4", MEASURE),
        ("cpu", MEASURE),
    ]:
        assert gpu_check.card_profile(types.SimpleNamespace(device_kind=kind)) == name
    assert all(name in BUILTIN_DEVICES for _, name in gpu_check.CARD_PROFILES)


def test_on_a_gpu_validate_runs_f32_matmuls_at_f32_as_it_prices_them(monkeypatch):
    default = jax.config.jax_default_matmul_precision
    with matmuls_as_priced():  # this CPU: as it was
        assert jax.config.jax_default_matmul_precision == default
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with matmuls_as_priced():
        assert jax.config.jax_default_matmul_precision == "float32"
    assert jax.config.jax_default_matmul_precision == default
