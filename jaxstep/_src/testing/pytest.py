"""The pytest plugin's hooks and fixtures; its face is :mod:`jaxstep.testing.pytest`
(what it does for a test session is said there)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Generator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

DEFAULT_DEVICES = 8
BACKENDS = ("shard_map", "pmap")
_BACKEND_CHOICES = ("both", *BACKENDS)
_PACKAGE = Path(__file__).resolve().parents[2]  # jaxstep/

_asked: list[int] = []  # the count this process asked for (once)
_temporary: list[str] = []  # cache directories to remove at the end of the session


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("jaxstep", "jaxstep fake devices")
    devices_help = (
        f"fake CPU devices for JAX (default {DEFAULT_DEVICES}); 0 leaves JAX's "
        "platforms and devices alone"
    )
    group.addoption(
        "--jaxstep-devices",
        dest="jaxstep_devices",
        type=int,
        default=None,
        metavar="N",
        help=f"{devices_help} (ini: jaxstep_devices)",
    )
    parser.addini("jaxstep_devices", devices_help, default=str(DEFAULT_DEVICES))
    backend_help = (
        "the backends a test taking jaxstep_backend runs under: 'both' (default), "
        "'shard_map' or 'pmap'"
    )
    group.addoption(
        "--jaxstep-backend",
        dest="jaxstep_backend",
        default=None,
        choices=_BACKEND_CHOICES,
        help=f"{backend_help} (ini: jaxstep_backend)",
    )
    parser.addini("jaxstep_backend", backend_help, default="both")
    cache_help = (
        "JAX's persistent compilation cache, so that tests that build the same step "
        "compile it once: 'session' (default: a temporary directory for this run), "
        "a directory to keep across runs, or 'off'. A cache directory already set "
        "(JAX_COMPILATION_CACHE_DIR) is left as it is"
    )
    group.addoption(
        "--jaxstep-compile-cache",
        dest="jaxstep_compile_cache",
        default=None,
        metavar="DIR",
        help=f"{cache_help} (ini: jaxstep_compile_cache)",
    )
    parser.addini("jaxstep_compile_cache", cache_help, default="session")


def _option(config: pytest.Config, name: str) -> Any:
    """The command line's value, else the ini file's (a string), else the default."""
    # Before pytest_configure the command line is parsed only into known_args_namespace.
    value = getattr(config.option, name, None)
    if value is None:
        value = getattr(getattr(config, "known_args_namespace", None), name, None)
    return config.getini(name) if value is None else value


def _devices(config: pytest.Config) -> int:
    value = _option(config, "jaxstep_devices")
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise pytest.UsageError(f"jaxstep_devices must be an int >= 0, got {value!r}")
    return n


def _backends(config: pytest.Config) -> tuple[str, ...]:
    value = str(_option(config, "jaxstep_backend")).strip()
    if value not in _BACKEND_CHOICES:
        raise pytest.UsageError(
            f"jaxstep_backend must be one of {', '.join(_BACKEND_CHOICES)}, got {value!r}"
        )
    return BACKENDS if value == "both" else (value,)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Before conftest.py files are imported: one of them may already run JAX.
    _setup(_devices(early_config), str(_option(early_config, "jaxstep_compile_cache")))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: a slow test (deselect with -m 'not slow'); registered by jaxstep"
    )
    _backends(config)  # a wrong value is a usage error now, not in every test
    # When the plugin comes from a conftest's pytest_plugins, this is its first chance.
    _setup(_devices(config), str(_option(config, "jaxstep_compile_cache")))


def pytest_unconfigure(config: pytest.Config) -> None:
    for directory in _temporary:
        shutil.rmtree(directory, ignore_errors=True)
    _temporary.clear()


def pytest_report_header(config: pytest.Config) -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version

    try:
        release = version("jaxstep")
    except PackageNotFoundError:  # run from a source tree that was never installed
        release = "(not installed)"
    where = f"jaxstep {release} from {_PACKAGE}"
    import jax

    n = _devices(config)
    cache = f"compile cache {jax.config.values['jax_compilation_cache_dir'] or 'off'}"
    backends = _backends(config)
    if len(backends) == 1:
        cache += f"; backend {backends[0]} only (jaxstep_backend)"
    if not n:
        return f"{where}: --jaxstep-devices 0, JAX's devices left as they are; {cache}"
    return f"{where}: {n} fake CPU devices (--jaxstep-devices); {cache}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # jaxstep_backend's parameters come from the options, so they are set here.
    if "jaxstep_backend" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if "jaxstep_backend" in names:
            return  # the test parametrizes it itself
    backends = _backends(metafunc.config)
    metafunc.parametrize("jaxstep_backend", backends, indirect=True, ids=list(backends))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    # A TrainingWorkerError raised through fit would print the loop's frames (their
    # code, batches and state) before its message: report it at the test's lines.
    excinfo = call.excinfo
    if excinfo is not None and not item.config.getoption("fulltrace", False):
        from jaxstep._src.core import TrainingWorkerError

        if excinfo.errisinstance(TrainingWorkerError) and excinfo.tb is not None:
            kept = _without_jaxstep(excinfo.tb)
            if kept is not None:
                excinfo.traceback = type(excinfo.traceback)(kept)  # pytest's Traceback
    return (yield)


def _without_jaxstep(tb: TracebackType) -> TracebackType | None:
    """A copy of the chain ``tb`` without jaxstep's frames. pytest cuts a traceback
    at the test's frame by following ``tb_next``: the frames must leave the chain."""
    frames: list[TracebackType] = []
    at: TracebackType | None = tb
    while at is not None:
        if not _in_jaxstep(at.tb_frame.f_code.co_filename):
            frames.append(at)
        at = at.tb_next
    chain = None
    for frame in reversed(frames):
        chain = TracebackType(chain, frame.tb_frame, frame.tb_lasti, frame.tb_lineno)
    return chain


def _in_jaxstep(path: str) -> bool:
    try:
        return Path(path).resolve().is_relative_to(_PACKAGE)
    except (ValueError, OSError):
        return False


def _setup(n: int, cache: str) -> None:
    if _asked:
        return
    _asked.append(n)
    import jax

    if cache != "off" and jax.config.values["jax_compilation_cache_dir"] is None:
        if cache == "session":
            cache = tempfile.mkdtemp(prefix="jaxstep-compile-cache-")
            _temporary.append(cache)
        jax.config.update("jax_compilation_cache_dir", cache)
    if cache != "off" and "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        # A step compiles in about a second on CPU, under JAX's 1 s default: cache
        # every program (also in a directory set by JAX_COMPILATION_CACHE_DIR).
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if n == 0:
        return
    from jaxstep._src.testing.devices import request_cpu_devices
    from jaxstep._src.testing.devices import use_cpu_platform

    use_cpu_platform()
    request_cpu_devices(n)


@pytest.fixture(scope="session")
def jaxstep_devices(pytestconfig: pytest.Config) -> list[Any]:
    """The session's fake CPU devices, ``jax.devices()`` when JAX's platform is CPU.

    Fails the test (once per session) when JAX started with another device count.
    """
    import jax

    from jaxstep._src.testing.devices import check_cpu_devices

    n = _devices(pytestconfig)
    if not n:
        return jax.devices()
    try:
        return check_cpu_devices(n)
    except RuntimeError as err:
        pytest.fail(f"{err}; the jaxstep plugin asked before conftest.py files were imported")


@pytest.fixture
def jaxstep_backend(request: pytest.FixtureRequest, jaxstep_devices: list[Any]) -> str:
    """``"shard_map"``, then ``"pmap"`` (or the one ``--jaxstep-backend`` names):
    pass it as ``make_train_step(..., backend=jaxstep_backend)``."""
    backend = getattr(request, "param", None)
    if backend is None:
        pytest.fail("jaxstep_backend is parametrized at collection: take it as an argument")
    return str(backend)


@pytest.fixture
def jaxstep_tiny_step(jaxstep_backend: str) -> Any:
    """A small linear regression on this test's backend, ready to train: ``.step``,
    ``.params()``, ``.state()``, ``.batches(num)`` (see :class:`jaxstep.testing.TinyStep`)."""
    from jaxstep._src.testing.tiny import tiny_step

    backend: Any = jaxstep_backend  # "shard_map" or "pmap", checked at collection
    return tiny_step(backend=backend)
