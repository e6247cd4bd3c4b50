"""8 fake CPU devices before anything starts a JAX backend (tests and doctests)."""

import os

import jax
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(params=["shard_map", "pmap"])
def backend(request):
    return request.param
