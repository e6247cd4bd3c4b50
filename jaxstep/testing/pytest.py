"""pytest plugin: fake CPU devices for a test session, and both backends per test.

Installed with jaxstep and loaded by pytest through the ``pytest11`` entry point
``jaxstep`` (disable it with ``-p no:jaxstep``). Before any conftest is imported it
asks JAX, through ``chex.set_n_cpu_devices``, for ``--jaxstep-devices N`` (default 8)
CPU devices and makes CPU JAX's platform (unless ``JAX_PLATFORMS`` is set); nothing
starts a backend until a test does. ``--jaxstep-devices 0`` leaves JAX alone.
It also turns on JAX's persistent compilation cache (``--jaxstep-compile-cache``), in
a temporary directory by default: tests that build the same step (same model, same
options, same shapes) then compile it once per session, not once per test.

Fixtures:
  jaxstep_devices: the session's fake CPU devices (checks their count once).
  jaxstep_backend: ``"shard_map"`` and ``"pmap"``: a test that takes it runs twice.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

DEFAULT_DEVICES = 8
BACKENDS = ("shard_map", "pmap")

_asked: list[int] = []  # the count this process asked for (once)
_temporary: list[str] = []  # cache directories to remove at the end of the session


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("jaxstep", "jaxstep fake devices")
    group.addoption(
        "--jaxstep-devices",
        dest="jaxstep_devices",
        type=int,
        default=DEFAULT_DEVICES,
        metavar="N",
        help=(
            f"fake CPU devices for JAX (default {DEFAULT_DEVICES}); 0 leaves JAX's "
            "platforms and devices alone"
        ),
    )

    group.addoption(
        "--jaxstep-compile-cache",
        dest="jaxstep_compile_cache",
        default="session",
        metavar="DIR",
        help=(
            "JAX's persistent compilation cache, so that tests that build the same step "
            "compile it once: 'session' (default: a temporary directory for this run), "
            "a directory to keep across runs, or 'off'. A cache directory already set "
            "(JAX_COMPILATION_CACHE_DIR) is left as it is"
        ),
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Before conftest.py files are imported: one of them may already run JAX.
    ns = early_config.known_args_namespace
    _setup(ns.jaxstep_devices, ns.jaxstep_compile_cache)


def pytest_configure(config: pytest.Config) -> None:
    # When the plugin comes from a conftest's pytest_plugins, this is its first chance.
    _setup(config.getoption("jaxstep_devices"), config.getoption("jaxstep_compile_cache"))


def pytest_unconfigure(config: pytest.Config) -> None:
    for directory in _temporary:
        shutil.rmtree(directory, ignore_errors=True)
    _temporary.clear()


def pytest_report_header(config: pytest.Config) -> str:
    import jaxstep

    where = f"jaxstep {jaxstep.__version__} from {Path(jaxstep.__file__).parent}"
    import jax

    n = config.getoption("jaxstep_devices")
    cache = f"compile cache {jax.config.values['jax_compilation_cache_dir'] or 'off'}"
    if not n:
        return f"{where}: --jaxstep-devices 0, JAX's devices left as they are; {cache}"
    return f"{where}: {n} fake CPU devices (--jaxstep-devices); {cache}"


def _setup(n: Any, cache: str) -> None:
    if _asked:
        return
    if not isinstance(n, int) or n < 0:
        raise pytest.UsageError(f"--jaxstep-devices must be an int >= 0, got {n!r}")
    _asked.append(n)
    import jax

    if cache != "off" and jax.config.values["jax_compilation_cache_dir"] is None:
        if cache == "session":
            cache = tempfile.mkdtemp(prefix="jaxstep-compile-cache-")
            _temporary.append(cache)
        jax.config.update("jax_compilation_cache_dir", cache)
        # A step compiles in about a second on CPU: cache every program.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if n == 0:
        return
    from jaxstep.testing.devices import request_cpu_devices
    from jaxstep.testing.devices import use_cpu_platform

    use_cpu_platform()
    request_cpu_devices(n)


@pytest.fixture(scope="session")
def jaxstep_devices(pytestconfig: pytest.Config) -> list[Any]:
    """The session's fake CPU devices, ``jax.devices()`` when JAX's platform is CPU.

    Fails the test (once per session) when JAX started with another device count.
    """
    import jax

    from jaxstep.testing.devices import check_cpu_devices

    n = pytestconfig.getoption("jaxstep_devices")
    if not n:
        return jax.devices()
    try:
        return check_cpu_devices(n)
    except RuntimeError as err:
        pytest.fail(f"{err}; the jaxstep plugin asked before conftest.py files were imported")


@pytest.fixture(params=BACKENDS)
def jaxstep_backend(request: pytest.FixtureRequest, jaxstep_devices: list[Any]) -> str:
    """``"shard_map"``, then ``"pmap"``: pass it as ``make_train_step(backend=...)``."""
    return request.param
