"""Test set-up: four forced CPU devices (for sharded sweeps), strict dtype promotion, and the
tiny trained run the serving tests share (``served_run_dir``).

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

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
if not os.environ.get("VOCABJAX_TEST_GPU"):
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=50)
settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))


@pytest.fixture(scope="session")
def served_run_dir(tmp_path_factory):
    """The tiny trained run (its own tokenizer, 6 steps) that the serving, serve and generate
    tests share: trained once per session (per worker under xdist) and only read."""
    from serving_testing import make_run

    return make_run(tmp_path_factory.mktemp("served_run"))
