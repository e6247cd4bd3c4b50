"""pytest plugin: fake CPU devices for a test session, and both backends per test.

Installed with jaxstep and loaded by pytest through the ``pytest11`` entry point
``jaxstep`` (disable it with ``-p no:jaxstep``). Before any conftest is imported it
asks JAX, through ``chex.set_n_cpu_devices``, for ``--jaxstep-devices N`` (default 8)
CPU devices and makes CPU JAX's platform (unless ``JAX_PLATFORMS`` is set); nothing
starts a backend until a test does. ``--jaxstep-devices 0`` leaves JAX alone.

Fixtures:
  jaxstep_devices: the session's fake CPU devices (checks their count once).
  jaxstep_backend: ``"shard_map"`` and ``"pmap"``: a test that takes it runs twice.
"""

from __future__ import annotations

from typing import Any

import pytest

DEFAULT_DEVICES = 8
BACKENDS = ("shard_map", "pmap")

_asked: list[int] = []  # the count this process asked for (once)


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


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Before conftest.py files are imported: one of them may already run JAX.
    _setup(early_config.known_args_namespace.jaxstep_devices)


def pytest_configure(config: pytest.Config) -> None:
    # When the plugin comes from a conftest's pytest_plugins, this is its first chance.
    _setup(config.getoption("jaxstep_devices"))


def pytest_report_header(config: pytest.Config) -> str:
    n = config.getoption("jaxstep_devices")
    if not n:
        return "jaxstep: --jaxstep-devices 0, JAX's devices left as they are"
    return f"jaxstep: {n} fake CPU devices (--jaxstep-devices), backends {list(BACKENDS)}"


def _setup(n: Any) -> None:
    if _asked:
        return
    if not isinstance(n, int) or n < 0:
        raise pytest.UsageError(f"--jaxstep-devices must be an int >= 0, got {n!r}")
    _asked.append(n)
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
