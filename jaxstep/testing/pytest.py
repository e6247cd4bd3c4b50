"""pytest plugin: fake CPU devices for a test session, and both backends per test.

Installed with jaxstep and loaded by pytest through the ``pytest11`` entry point
``jaxstep`` (disable it with ``-p no:jaxstep``). Before any conftest is imported it
asks JAX, through ``chex.set_n_cpu_devices``, for ``--jaxstep-devices N`` (default 8)
CPU devices and makes CPU JAX's platform (unless ``JAX_PLATFORMS`` is set); nothing
starts a backend until a test does. ``--jaxstep-devices 0`` leaves JAX alone.
It also turns on JAX's persistent compilation cache (``--jaxstep-compile-cache``), in
a temporary directory by default: tests that build the same step (same model, same
options, same shapes) then compile it once per session, not once per test.

Every option is also an ini key (``jaxstep_devices``, ``jaxstep_backend``,
``jaxstep_compile_cache`` under ``[tool.pytest.ini_options]``); the command line wins.
A ``TrainingWorkerError`` that fails a test is reported at the test's own lines,
without jaxstep's frames (``--fulltrace`` shows them). The ``slow`` marker is
registered for the users' slow tests.

Fixtures:
  jaxstep_devices: the session's fake CPU devices (checks their count once).
  jaxstep_backend: ``"shard_map"`` and ``"pmap"`` (``--jaxstep-backend`` picks one):
    a test that takes it runs once per backend.
  jaxstep_tiny_step: a :class:`jaxstep.testing.TinyStep` on that backend.
"""

from jaxstep._src.testing.pytest import jaxstep_backend as jaxstep_backend
from jaxstep._src.testing.pytest import jaxstep_devices as jaxstep_devices
from jaxstep._src.testing.pytest import jaxstep_tiny_step as jaxstep_tiny_step
from jaxstep._src.testing.pytest import pytest_addoption as pytest_addoption
from jaxstep._src.testing.pytest import pytest_configure as pytest_configure
from jaxstep._src.testing.pytest import pytest_generate_tests as pytest_generate_tests
from jaxstep._src.testing.pytest import (
    pytest_load_initial_conftests as pytest_load_initial_conftests,
)
from jaxstep._src.testing.pytest import pytest_report_header as pytest_report_header
from jaxstep._src.testing.pytest import pytest_runtest_makereport as pytest_runtest_makereport
from jaxstep._src.testing.pytest import pytest_unconfigure as pytest_unconfigure

__all__ = [
    "jaxstep_backend",
    "jaxstep_devices",
    "jaxstep_tiny_step",
    "pytest_addoption",
    "pytest_configure",
    "pytest_generate_tests",
    "pytest_load_initial_conftests",
    "pytest_report_header",
    "pytest_runtest_makereport",
    "pytest_unconfigure",
]
