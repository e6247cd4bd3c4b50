"""Checks that look across steps or across replicas: parameter fingerprints (silent
replica divergence) and loss spikes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_DIVERGENCE_EVERY = 100


def fingerprint(leaves: Sequence[jax.Array]) -> jax.Array:
    """(len(leaves),) uint32: the wrapping sum of each leaf's bit patterns.

    Exact and independent of summation order, so replicas with equal bits agree and a
    one-ulp change in one element changes the sum.
    """
    out = []
    for x in leaves:
        if jnp.issubdtype(x.dtype, jnp.bool_):
            bits = x.astype(jnp.uint32)
        elif x.dtype.itemsize == 8:
            pair = jax.lax.bitcast_convert_type(x, jnp.uint32)  # (..., 2)
            bits = pair[..., 0] ^ (pair[..., 1] * jnp.uint32(0x9E3779B1))
        elif x.dtype.itemsize == 4:
            bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
        elif x.dtype.itemsize == 2:
            bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
        else:
            bits = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
        out.append(jnp.sum(bits, dtype=jnp.uint32))
    return jnp.stack(out) if out else jnp.zeros((0,), jnp.uint32)


def without_shards(leaves: Sequence[jax.Array], sharded: Sequence[bool]) -> list[jax.Array]:
    """``leaves`` with each one held as a shard (``sharded``) replaced by a zero scalar
    (fingerprint 0): the devices' shards differ by design and have no second copy, so
    a comparison of fingerprints leaves them out (and keeps the leaves' positions)."""
    return [jnp.zeros((), x.dtype) if s else x for x, s in zip(leaves, sharded, strict=True)]


def split16(prints: jax.Array) -> jax.Array:
    """uint32 fingerprints as float32 halves (exact), to ride in a float all-reduce."""
    return jnp.concatenate(
        [(prints >> 16).astype(jnp.float32), (prints & 0xFFFF).astype(jnp.float32)]
    )


def join16(halves: jax.Array) -> jax.Array:
    """Inverse of :func:`split16` along the last axis."""
    k = halves.shape[-1] // 2
    hi, lo = halves[..., :k].astype(jnp.uint32), halves[..., k:].astype(jnp.uint32)
    return (hi << 16) | lo


def minority(
    prints: jax.Array, twinned: Sequence[bool] | None = None, groups: int = 1
) -> tuple[jax.Array, jax.Array]:
    """For (devices, leaves) fingerprints: which devices disagree with a strict
    majority on some leaf, and the first such leaf (or -1), per device.

    With ``groups`` > 1 (``make_train_step(replicas=k)``: k groups of consecutive
    devices) a leaf of ``twinned`` is a shard, compared among its twins alone (the
    devices at the same place in every group); any other leaf among every device. With
    two groups a pair of twins that differ has no majority: both are named.

    >>> import jax.numpy as jnp
    >>> prints = jnp.zeros((6, 2), jnp.uint32).at[4, 1].set(7)  # device 4's shard
    >>> bad, first = minority(prints, [False, True], groups=3)  # 3 groups of 2
    >>> bad.tolist(), first.tolist()
    ([False, False, False, False, True, False], [-1, -1, -1, -1, 1, -1])
    """
    n = prints.shape[0]
    same = prints[:, None, :] == prints[None, :, :]  # (devices, devices, leaves)
    agree = jnp.sum(same, axis=1)  # (devices, leaves)
    size = jnp.full((1, prints.shape[1]), n)
    if groups > 1 and twinned is not None and any(twinned):
        m = n // groups
        place = np.arange(n) % m
        twins = jnp.asarray(place[:, None] == place[None, :])
        among = jnp.sum(same & twins[..., None], axis=1)
        mask = jnp.asarray(np.asarray(twinned, bool))[None, :]
        agree = jnp.where(mask, among, agree)
        size = jnp.where(mask, groups, size)
    off = agree * 2 <= size  # not in a strict majority
    bad = jnp.any(off, axis=1)
    first = jnp.where(bad, jnp.argmax(off, axis=1), -1).astype(jnp.int32)
    return bad, first


def all_agree(prints: np.ndarray, twinned: Sequence[bool] | None = None, groups: int = 1) -> bool:
    """Whether every device's (host) fingerprints ``(devices, leaves)`` are the same,
    a leaf of ``twinned`` (a shard of ``groups`` replica groups) among its twins alone."""
    prints = np.asarray(prints)
    if groups == 1 or twinned is None:
        return bool(np.all(prints == prints[:1]))
    m = prints.shape[0] // groups
    mask = np.asarray(twinned, bool)
    by_place = prints.reshape(groups, m, -1)
    twins_agree = np.all(by_place == by_place[:1], axis=(0, 1))  # (leaves,)
    everyone = np.all(prints == prints[:1], axis=0)
    return bool(np.all(np.where(mask, twins_agree, everyone)))


@dataclasses.dataclass(frozen=True)
class LossSpike:
    """Flags a device whose loss jumps far above its own recent range.

    After ``warmup`` accepted steps, device i fails with ``Status.LOSS_SPIKE`` when
    ``loss_i > mean_i + sigmas * max(std_i, min_rel * |mean_i|)`` over its last
    ``window`` losses. Only finite, accepted, non-spike losses enter the window, so a
    NaN or a spike never poisons it. (MaxText: the global loss, mean + 6 sigma over
    128 steps; here per device, and robust to flat or NaN-ridden stretches.)

    Attributes:
      window: the losses each device's mean and spread are taken over.
      sigmas: how many spreads above its mean a device's loss is a spike.
      warmup: the accepted steps before any loss can be a spike (at most ``window``).
      min_rel: the least spread, relative to the mean (a flat stretch of losses is not
        a zero spread that any wobble would exceed).

    Example:
      >>> import jaxstep
      >>> jaxstep.LossSpike(window=64, sigmas=8.0).warmup
      32
    """

    window: int = 128
    sigmas: float = 6.0
    warmup: int = 32
    min_rel: float = 0.02

    def __post_init__(self) -> None:
        if self.window < 2 or not 2 <= self.warmup <= self.window:
            raise ValueError(
                f"LossSpike needs window >= 2 and 2 <= warmup <= window, got "
                f"window={self.window}, warmup={self.warmup}"
            )
        if self.sigmas <= 0 or self.min_rel < 0:
            raise ValueError(f"sigmas must be > 0 and min_rel >= 0, got {self}")

    def init(self, n_devices: int) -> dict[str, jax.Array]:
        """The window's first memory (``state.monitor["spike"]``).

        Args:
          n_devices: the step's device count (a column each).

        Returns:
          ``{"losses": (window, n_devices) zeros, "count": 0}``.
        """
        return {
            "losses": jnp.zeros((self.window, n_devices), jnp.float32),
            "count": jnp.zeros((), jnp.int32),
        }

    def check(self, memory: dict[str, Any], losses: jax.Array) -> jax.Array:
        """Which of this step's per-device losses are spikes.

        Args:
          memory: the window (``state.monitor["spike"]``).
          losses: ``(devices,)`` this step's losses.

        Returns:
          ``(devices,)`` bool.
        """
        filled = jnp.minimum(memory["count"], self.window)
        valid = (jnp.arange(self.window) < filled)[:, None]
        k = jnp.maximum(filled, 1).astype(jnp.float32)
        mean = jnp.sum(jnp.where(valid, memory["losses"], 0.0), axis=0) / k
        var = jnp.sum(jnp.where(valid, (memory["losses"] - mean) ** 2, 0.0), axis=0) / k
        scale = jnp.maximum(jnp.sqrt(var), self.min_rel * jnp.abs(mean))
        ready = memory["count"] >= self.warmup
        return ready & jnp.isfinite(losses) & (losses > mean + self.sigmas * scale)

    def update(self, memory: dict[str, Any], losses: jax.Array, accept: jax.Array) -> Any:
        """The window with this step's losses added, when ``accept`` (one flag for all)
        and every loss is finite.

        Args:
          memory: the window before the step.
          losses: ``(devices,)`` this step's losses.
          accept: the step trained and no loss spiked.

        Returns:
          The window after the step.
        """
        accept = accept & jnp.all(jnp.isfinite(losses))
        slot = memory["count"] % self.window
        rolled = memory["losses"].at[slot].set(losses)
        return {
            "losses": jnp.where(accept, rolled, memory["losses"]),
            "count": memory["count"] + accept.astype(jnp.int32),
        }
