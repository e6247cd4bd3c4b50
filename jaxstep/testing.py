"""Helpers for tests, notebooks and the demo: fake CPU devices."""

from __future__ import annotations

import contextlib
import os


def set_cpu_devices(n: int) -> None:
    """Gives this process ``n`` fake CPU devices. Call it before JAX starts a backend.

    Raises:
      RuntimeError: a backend already runs with another device count.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    import jax

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    with contextlib.suppress(RuntimeError):  # a backend is up already: checked below
        jax.config.update("jax_num_cpu_devices", n)
    have = len(jax.devices("cpu"))
    if have != n:
        raise RuntimeError(
            f"JAX already started with {have} CPU devices, wanted {n}: call "
            "jaxstep.testing.set_cpu_devices before anything uses JAX (or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n})"
        )
