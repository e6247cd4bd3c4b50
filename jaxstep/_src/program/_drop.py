"""``on_failure="drop"``: a device whose own checks fail is left out of the step's
mean (it zeroes what it sends to the one all-reduce; the update divides by the healthy
count), and a replica that differs from a strict majority is repaired from it inside
the step. Traced only when the step is built with that policy: the others' programs
hold none of this."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep._src.core import PyTree
from jaxstep._src.core import Status
from jaxstep._src.core import TrainState
from jaxstep._src.program import _cross_checks as cross_checks
from jaxstep._src.program._grid import Grid
from jaxstep._src.program._model import unit_prints
from jaxstep._src.program._options import Options


def drop_memory(n: int) -> dict[str, jax.Array]:
    """The policy's per-device memory in ``state.monitor``: steps in a row each device
    was left out, and how often its replica was repaired."""
    return {"drops": jnp.zeros((n,), jnp.int32), "repairs": jnp.zeros((n,), jnp.int32)}


def leave_out(bad: jax.Array, tree: PyTree) -> PyTree:
    """``tree`` with every leaf zeroed when this device failed its own checks. A
    ``lax.cond``, not a ``where`` (nor a multiply: NaN * 0 is NaN): ``bad`` depends on
    reductions over these very gradients, so a ``where`` cannot fuse into the kernels
    that make them and cost a read and a write of every gradient on every step; the
    cond's healthy branch hands the buffers through untouched (no copy, no pass, no
    extra memory) and only a failing device writes zeros."""
    return jax.lax.cond(bad, lambda t: jax.tree.map(jnp.zeros_like, t), lambda t: t, tree)


class Repair(NamedTuple):
    """What the replica comparison at the start of the step found, per device."""

    repaired: jax.Array  # (n,) bool: its copy was replaced by a majority replica's
    diverged: jax.Array  # (n,) bool: differs and could not be repaired (DIVERGED)
    first: jax.Array  # (n,) the first state leaf that differed, or -1
    #: under ``model_parallel``: this model group's devices' fingerprints of the state
    #: the repair hands on (a repaired group's, its source's: the ones read before the
    #: body are of the copies it replaced); None without a model axis
    prints: jax.Array | None = None


def repair_replicas(
    options: Options,
    state: TrainState,
    index: jax.Array,
    sharded: Sequence[bool] | None = None,
    grid: Grid | None = None,
    given: jax.Array | None = None,
) -> tuple[TrainState, Repair]:
    """Compares every device's fingerprints of its params, optimizer state and model
    state (a small all-reduce, in the every-``divergence_every``-th program only) and,
    when some device differs from a strict majority, copies a majority replica onto it
    under a ``lax.cond`` on the replicated "any diverged" flag: the copy is paid only
    when a divergence is found. Done before the local part, so the repaired device's
    gradient is computed from the repaired copy and the step is the clean run's. A
    device repaired before is not repaired again: it diverges with ``DIVERGED``.
    ``sharded``: the leaves of (params, opt_state, model_state) held as shards (a
    sharded layout). With one group (``grid``) a shard has no second copy: it is
    neither compared nor copied. With several, a shard is compared among its twins and
    copied from one of their majority; with two groups a pair of twins that differ has
    no majority, and both stay ``DIVERGED``. ``given``: under ``model_parallel``, this
    model group's devices' fingerprints, read before the body (``chip_prints``)."""
    n = options.n
    trees = (state.params, state.opt_state, state.model_state)
    twinned = grid is not None and grid.grouped and sharded is not None
    prints = unit_prints(options, state, None if twinned else sharded, given)
    mine = jnp.arange(n)[:, None] == index
    sent = jnp.where(mine, cross_checks.split16(prints)[None, :], 0.0)
    gathered = jax.lax.psum(sent, options.axis_name)
    groups = grid.k if twinned and grid is not None else 1
    joined = cross_checks.join16(gathered)
    diverged, first = cross_checks.minority(joined, sharded, groups)
    repairs = state.monitor["repairs"]
    source = jnp.argmax(~diverged)  # a device agreeing with a strict majority everywhere
    can = ~diverged[source]
    if given is not None and sharded is not None and not twinned:
        # a group whose own copies of a shard disagree has no twin to copy it from:
        # it stays DIVERGED (nothing here knows which of its copies is right)
        shards = jnp.asarray(np.asarray(sharded, bool))[None, :]
        stuck, _ = cross_checks.minority(jnp.where(shards, joined, 0))
        can = can & ~stuck
    if twinned and grid is not None:
        sources = grid.twin_sources(diverged)  # per device: a twin of the majority
        can = can & ~diverged[sources]
        twin_source = sources[index]
    repaired = diverged & can & (repairs == 0) & ~state.halted

    def copy(trees: PyTree) -> PyTree:
        leaves, treedef = jax.tree.flatten(trees)
        marks = [False] * len(leaves) if sharded is None else list(sharded)
        out = []
        for x, shard in zip(leaves, marks, strict=True):
            if not shard:
                out.append(_broadcast(x, index == source, options.axis_name))
            elif twinned and grid is not None:  # from a twin of the majority
                out.append(_broadcast(x, index == twin_source, options.axis_name, grid.twins))
            else:  # a shard without twins stays: no majority to copy from
                out.append(x)
        return jax.tree.unflatten(treedef, out)

    params, opt_state, model_state = jax.lax.cond(
        jnp.any(repaired), copy, lambda trees: trees, trees
    )
    monitor = {**state.monitor, "repairs": repairs + repaired.astype(jnp.int32)}
    state = dataclasses.replace(
        state, params=params, opt_state=opt_state, model_state=model_state, monitor=monitor
    )
    after = None
    if given is not None:  # the devices' fingerprints of the copies handed on
        every = jax.lax.all_gather(given, options.axis_name)  # (n, m, leaves)
        shards = jnp.asarray(np.asarray(sharded if sharded is not None else [], bool))
        moved = every[source]
        if sharded is not None:  # a shard: from a twin of the majority, or it stays
            moved = jnp.where(shards, every[twin_source] if twinned else given, moved)
        after = jnp.where(repaired[index], moved, given)
    return state, Repair(repaired, diverged & ~repaired, first, after)


def _broadcast(
    x: jax.Array,
    source: jax.Array,
    axis_name: str,
    groups: Sequence[Sequence[int]] | None = None,
) -> jax.Array:
    """The source device's ``x`` on every device (of its group, with ``groups``: one
    source in each), bit for bit: its bits summed with the others' zeros as unsigned
    integers (a float sum would turn -0.0 into 0.0)."""
    if x.dtype == jnp.bool_:
        flags = jnp.where(source, x, False).astype(jnp.int32)
        return jax.lax.psum(flags, axis_name, axis_index_groups=groups) > 0
    bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
    raw = jax.lax.bitcast_convert_type(x, bits)
    zeros = jnp.where(source, raw, jnp.zeros((), bits))
    summed = jax.lax.psum(zeros, axis_name, axis_index_groups=groups)
    return jax.lax.bitcast_convert_type(summed, x.dtype)


def decide(
    options: Options,
    state: TrainState,
    seen: Any,
    would_apply: jax.Array,
) -> tuple[jax.Array, jax.Array, dict[str, Any], dict[str, jax.Array]]:
    """The drop policy's part of the verdict, for a step that would be applied
    (``would_apply``) with the devices ``seen.left_out`` ((n,) bool; ``seen.failing``
    of them) out of its mean; ``seen.repeats``: one of them failed
    ``max_consecutive_drops`` steps in a row (``seen``: the verdict's ``Seen``).
    Returns (halt: a device left out ``max_consecutive_drops`` steps in a row, a bad
    device rather than bad data; the devices left out of the applied step; the new
    ``total_drops`` and ``monitor["drops"]``; the table's columns)."""
    left_out = seen.left_out
    drops = state.monitor["drops"] if seen.drops is None else seen.drops
    counted = jnp.where(would_apply, jnp.where(left_out, drops + 1, 0), drops)
    halt = jnp.array(False) if seen.repeats is None else seen.repeats & would_apply
    applied = would_apply & ~halt
    dropped = left_out & applied
    assert state.total_drops is not None  # init gives it one under this policy
    fields = {
        "total_drops": state.total_drops + jnp.where(applied, seen.failing, 0).astype(jnp.int32),
        "drops": jnp.where(applied, counted, drops),
    }
    columns = {"dropped": dropped, "consecutive_drops": counted}
    return halt, dropped, fields, columns


def left_out(status: jax.Array) -> jax.Array:
    """Which of the gathered (pre-collective) statuses are failures a drop can cure."""
    return (status & ~int(Status.OVERFLOW)) != 0
