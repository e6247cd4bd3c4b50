"""The repo's tests run on the plugin jaxstep ships (``jaxstep._src.testing.pytest``,
loaded through its pytest11 entry point by an installed jaxstep, editable or not):
8 fake CPU devices set through chex before anything starts a backend, and both
backends through ``jaxstep_backend``."""

import signal

import pytest

# A shell starts a background job (``make test &``) with Ctrl-C ignored, and Python then
# never installs its KeyboardInterrupt handler, nor do the processes the tests start:
# the tests of Ctrl-C and SIGINT would see nothing. They test what a terminal gives.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Run by tests/testing/test_user_project.py in its own pytest, against an installed wheel.
collect_ignore = ["tests/user_project"]


@pytest.fixture
def backend(jaxstep_backend: str) -> str:
    """The repo's tests' name for the plugin's ``jaxstep_backend``."""
    return jaxstep_backend
