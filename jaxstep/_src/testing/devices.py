"""Fake CPU devices for tests: ask for them through chex before a backend starts,
and check, once JAX runs, that the ask was heard."""

from __future__ import annotations

import contextlib
import os

import chex
import jax


def request_cpu_devices(n: int) -> None:
    """Asks for ``n`` CPU devices without starting a backend.

    Sets ``XLA_FLAGS`` through ``chex.set_n_cpu_devices`` (so subprocesses inherit it)
    and ``jax_num_cpu_devices`` (which JAX reads when the CPU backend starts). If a
    backend already runs, nothing changes here: :func:`check_cpu_devices` reports it.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"the number of CPU devices must be an int >= 1, got {n!r}")
    # Both raise RuntimeError once a backend runs (chex also when it was started by
    # jax_num_cpu_devices rather than XLA_FLAGS): the count is checked afterwards.
    with contextlib.suppress(RuntimeError):
        chex.set_n_cpu_devices(n)
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", n)


def check_cpu_devices(n: int) -> list[jax.Device]:
    """The ``n`` CPU devices (this starts the CPU backend if it is not running).

    Raises:
      RuntimeError: JAX started with another count, naming the count and the fix.
    """
    have = jax.devices("cpu")
    if len(have) != n:
        raise RuntimeError(
            f"JAX runs with {len(have)} CPU devices, wanted {n}: a JAX backend started "
            "before the device count could be set (something ran a JAX operation, e.g. "
            "jax.devices() or jnp.zeros(), at import). Call "
            "jaxstep.testing.set_cpu_devices before anything uses JAX, or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n}"
        )
    return have


def set_cpu_devices(n: int) -> None:
    """Gives this process ``n`` fake CPU devices. Call it before JAX starts a backend.

    Uses ``chex.set_n_cpu_devices`` and ``jax_num_cpu_devices``, then checks the count
    (which starts the CPU backend). In pytest, the ``jaxstep`` plugin does this for
    you (``--jaxstep-devices N``, default 8).

    Args:
      n: how many devices, >= 1.

    Raises:
      ValueError: ``n`` is not a positive int.
      RuntimeError: a backend already runs with another device count.

    Example:
      In a script, before anything starts JAX's backend (in pytest, the plugin has given
      this process 8 already: asking again for as many is a no-op):

      >>> import jax
      >>> from jaxstep.testing import set_cpu_devices
      >>> set_cpu_devices(8)
      >>> jax.device_count()
      8
    """
    request_cpu_devices(n)
    check_cpu_devices(n)


def use_cpu_platform() -> None:
    """Makes CPU JAX's only platform, unless ``JAX_PLATFORMS`` chose one already."""
    if "JAX_PLATFORMS" in os.environ:
        return
    os.environ["JAX_PLATFORMS"] = "cpu"  # subprocesses of the tests too
    with contextlib.suppress(RuntimeError):  # a backend runs: too late, left as it is
        jax.config.update("jax_platforms", "cpu")
