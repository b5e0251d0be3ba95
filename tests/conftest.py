"""Test set-up: four forced CPU devices (for sharded sweeps), XLA's lowest backend optimisation
on CPU (faster compiles), strict dtype promotion, and the tiny trained run the serving tests
share (``served_run_dir``).

GPU tests (marker ``gpu``) are deselected by default; on a GPU machine run
``VOCABJAX_TEST_GPU=1 python -m pytest -m gpu``.
"""

import atexit
import os
import shutil
import tempfile

# One persistent compilation cache per test session, shared by the xdist workers (they inherit
# the controller's environment) and removed at its end: tests build fresh jitted functions of the
# same computations (a model per test, a training run per seed), and each such computation then
# compiles once per session instead of once per test. A cache the caller names is used as is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="vocabjax-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    # JAX writes an entry without a lock: one read while another process writes it warns and
    # compiles instead (pyproject's filterwarnings says why); the tests' CLI subprocesses too.
    _quiet = "ignore:Error reading persistent compilation cache entry:UserWarning"
    _before = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = f"{_before},{_quiet}" if _before else _quiet

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=4"
if not os.environ.get("VOCABJAX_TEST_GPU"):
    os.environ["JAX_PLATFORMS"] = "cpu"
    # The suite checks results, not speed, and most of its CPU time is compiling small programs:
    # XLA's lowest backend optimisation compiles them faster (the full suite 7.3 -> 6.6 min on
    # two cores). The CLI, benchmarks and users run at XLA's default. A level the caller sets
    # is kept.
    if "xla_backend_optimization_level" not in _flags:
        _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=50)
settings.load_profile("ci")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """GPU tests skip without a GPU. Tests that share a module- or class-scoped fixture (a
    trained run, a tokenizer, measured ceilings) form one xdist group (``--dist loadgroup``),
    so that one worker builds the fixture once instead of every worker that gets one of them."""
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))
        defs = getattr(item, "_fixtureinfo", None)
        scopes = {
            d.scope
            for ds in (defs.name2fixturedefs.values() if defs is not None else ())
            for d in ds
        }
        if scopes & {"module", "class"}:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(scope="session")
def served_run_dir(tmp_path_factory):
    """The tiny trained run (its own tokenizer, 6 steps) that the serving, serve and generate
    tests share: trained once per session (per worker under xdist) and only read."""
    from serving_testing import make_run

    return make_run(tmp_path_factory.mktemp("served_run"))
