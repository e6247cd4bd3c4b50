"""The repo's tests run on the plugin jaxstep ships (``jaxstep._src.testing.pytest``,
loaded through its pytest11 entry point by an installed jaxstep, editable or not):
8 fake CPU devices set through chex before anything starts a backend, and both
backends through ``jaxstep_backend``."""

import pytest

# Run by tests/testing/test_user_project.py in its own pytest, against an installed wheel.
collect_ignore = ["tests/user_project"]


@pytest.fixture
def backend(jaxstep_backend: str) -> str:
    """The repo's tests' name for the plugin's ``jaxstep_backend``."""
    return jaxstep_backend
