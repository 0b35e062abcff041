import importlib
import os
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Under pytest-xdist (the README's `-n 2`) several test processes may share one GPU: each takes memory as it needs
# it instead of JAX's default 75% up front (set before any test imports jax).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# On a host without a GPU, XLA's backend (LLVM) optimizations are off for the tests: they took about a third of
# the CPU suite's time (compiles of tiny programs that run in microseconds either way). XLA's HLO passes (fusion,
# simplification, layout) still run, so the tests exercise the same HLO programs. Set before any test imports jax;
# the servers, scripts and sharded checks the tests start as subprocesses inherit it. A GPU host's runs verify the
# kernels as served and keep them on, as does FNX_TEST_FULL_OPT=1.
if not shutil.which("nvidia-smi") and not os.environ.get("FNX_TEST_FULL_OPT"):
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# Compiling is most of the CPU suite's time, and many tests (in other files, other workers, the subprocesses they
# start) compile the same programs of the same tiny checkpoints: JAX's persistent compilation cache, shared by
# them all through one directory, compiles each once. Its key covers the program, the JAX version, the backend and
# the flags, so a stale entry is never used. On a host without a GPU only (the GPU runs verify the kernels as
# compiled there); FNX_TEST_JAX_CACHE=0 turns it off, a JAX_COMPILATION_CACHE_DIR of one's own takes its place.
if not shutil.which("nvidia-smi") and os.environ.get("FNX_TEST_JAX_CACHE", "1") != "0":
    import tempfile
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"fnx-test-jax-cache-{os.getuid()}"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def load_script(name: str):
    """Import scripts/<name>.py as a module. scripts/ is not a package: it goes on sys.path, as it is for a script
    run by path (its own folder first), so the scripts import one another by name either way."""
    folder = str(ROOT / "scripts")
    if folder not in sys.path:
        sys.path.append(folder)
    return importlib.import_module(name)


EXTENDED_ENV = "FNX_EXTENDED_TESTS"


def pytest_collection_modifyitems(config, items):
    import jax
    gpu = jax.default_backend() == "gpu"
    if not gpu:
        skip = pytest.mark.skip(reason="needs a GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    # `extended`: more cases of kernel variants the served defaults do not take (measured and not kept, or kept
    # as knobs); a representative case of each stays in every run. They all run on a GPU host (the compiled
    # kernels are what they check there) and with FNX_EXTENDED_TESTS=1.
    if not gpu and os.environ.get(EXTENDED_ENV) != "1":
        skip = pytest.mark.skip(reason=f"an extended case: {EXTENDED_ENV}=1 (or a GPU) runs it")
        for item in items:
            if "extended" in item.keywords:
                item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test in a module that draws a random `_seed` per run reports it (FNX_TEST_SEED replays it)."""
    outcome = yield
    rep = outcome.get_result()
    seed = getattr(getattr(item, "module", None), "_seed", None)
    if rep.failed and seed is not None:
        rep.sections.append(("random seed", f"_seed = {seed}: FNX_TEST_SEED={seed} replays this module's draws"))


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop JAX's compiled programs after each test module: one pytest process compiles hundreds of programs over
    the suite, and keeping them all alive grows memory (a CI run once segfaulted inside XLA's CPU compiler late in
    the suite)."""
    yield
    import gc

    import jax
    jax.clear_caches()
    gc.collect()
