"""A device's own part of the step, before any collective: where it stands in the step
(:class:`Here`: its position, the chunk it holds, its armed faults), its loss, gradients
and health row (:func:`local_part`), with the injected faults, the replica check's
fingerprints and the heartbeat folded in."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from jaxstep._src.core import Batch
from jaxstep._src.core import PyTree
from jaxstep._src.core import Status
from jaxstep._src.core import TrainState
from jaxstep._src.core import health
from jaxstep._src.program._chips import each_chip
from jaxstep._src.program._device import DeviceWork
from jaxstep._src.program._device import WorkFn
from jaxstep._src.program._device import microbatched_work
from jaxstep._src.program._faults import Armed
from jaxstep._src.program._model import unit_prints
from jaxstep._src.program._options import Options

#: ``beat(position, step_number, status) -> status``: a host callback telling the host that a
#: device finished its local part (``fit(step_timeout=...)``).
Beat = Callable[[Any, Any, Any], Any]


class Here(NamedTuple):
    """Where one device stands in the step (traced, inside the ``shard_map``)."""

    position: jax.Array  # its position among the step's devices
    #: the chunk of the global batch it holds: its own position, except in a replay that
    #: moves the chunks, where the key and the faults travel with the rows
    chunk: jax.Array
    faults: Armed  # its faults at this step, the step's one seam to them (or NO_FAULTS)
    token: jax.Array  # an injected stall's mark (negative when one stalled it)
    #: under ``model_parallel``, at a replica-check step: each device of this model
    #: group's fingerprints, ``(m, leaves)``, read before the body (``chip_prints``)
    prints: jax.Array | None = None


def here(options: Options, state: TrainState, batch: Batch, extras: dict[str, Any]) -> Here:
    """This device's :class:`Here` (an injected stall, due at this step, runs here)."""
    index = jax.lax.axis_index(options.axis_name)
    chunk = extras["chunk"].reshape(-1)[0]
    rows = jax.tree.leaves(batch)[0].shape[0]
    faults = options.arm(state.step, chunk, rows, extras.get("fired"), position=index)
    faults.check_rows(rows)
    token = faults.stall(jnp.zeros((), jnp.int32))
    given = extras.get("unit_prints")
    return Here(index, chunk, faults, token, None if given is None else given[0])


class LocalPart(NamedTuple):
    """This device's part of the step, ready for the all-reduce."""

    work: DeviceWork  # its loss, gradients and health, before any collective
    grads: PyTree  # the gradients it sends (injected faults and the heartbeat's term in)
    row: dict[str, Any]  # its health row, status included
    prints: jax.Array | None  # its fingerprints (the replica-check variant), or None
    checks: tuple[str, ...]  # the names of the user checks


def local_part(
    options: Options,
    state: TrainState,
    batch: Batch,
    at: Here,
    *,
    beat: Beat | None,
    check_replicas: bool,
    sharded: Sequence[bool] | None = None,
    work_fn: WorkFn | None = None,
) -> LocalPart:
    """This device's loss, gradients and health row, before any collective; with
    ``check_replicas`` its fingerprints too, and with ``beat`` the host told it is done. The
    key is folded with the step and the chunk: a replay that moves a chunk to another
    device moves its random numbers with it (dropout masks), so a failure that follows
    the chunk is the data's and one that stays is the device's. ``sharded``: which
    leaves of (params, opt_state, model_state) this device holds only a shard of (a
    sharded layout: no replica to compare; their fingerprints are left out);
    ``work_fn``: what each (micro-)batch runs in place of ``device_work``."""
    key = chunk_key(state, at.chunk)
    faults = at.faults
    work, microbatch, check_names = microbatched_work(
        options, state, batch, key, faults, options.microbatches, work_fn
    )
    grads, squares, grad_leaf = work.grads, work.grad_squares, work.grad_leaf
    status = work.status | jnp.minimum(at.token, 0)  # keeps an injected stall ahead
    if faults:
        grads = faults.grads(grads)
        # an injected gradient fault is checked like a real one
        injected, injected_leaf, _ = health.gradient_health(jax.tree.leaves(grads))
        bad = ~jnp.isfinite(injected)
        squares = jnp.where(bad, injected + squares, squares)
        grad_leaf = health.earliest(grad_leaf, injected_leaf)
        flag: Any = int(Status.GRAD_NONFINITE)
        if options.loss_scale is not None:  # as a real one: an overflow of scaled values
            overflow = (work.input_leaf < 0) & jnp.isfinite(work.loss)
            flag = jnp.where(overflow, int(Status.OVERFLOW), flag)
        status |= jnp.where(bad, flag, 0)
    row = row_of(work, grad_leaf, squares, microbatch)
    prints = None
    if check_replicas:
        prints, param_leaf = replica_check(options, state, sharded, at.prints)
        row["param_leaf"] = param_leaf
        status |= jnp.where(param_leaf >= 0, int(Status.PARAM_NONFINITE), 0)
    if beat is not None:
        # Tell the host this device finished its local part. The gradients take a
        # (zero) term from the callback's result, so it runs before the collective.
        m = options.model_parallel

        def tell(chip: jax.Array, position: jax.Array, number: jax.Array) -> jax.Array:
            # each device of a model group beats by its place in the mesh's order
            shape = jax.ShapeDtypeStruct((), jnp.int32)
            return io_callback(beat, shape, position * m + chip, number, status)

        done = each_chip(m, tell, at.position, state.step)
        zero = jnp.minimum(done, 0)  # the callback returns status >= 0
        grads = jax.tree.map(lambda g: g + zero.astype(g.dtype), grads)
        status |= zero
    row["status"] = status
    return LocalPart(work, grads, row, prints, check_names)


def chunk_key(state: TrainState, chunk: jax.Array) -> jax.Array | None:
    """The key of this step's chunk ``chunk`` (None: the state holds none)."""
    if state.rng is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(state.rng, state.step), chunk)


def row_of(
    work: DeviceWork, grad_leaf: jax.Array, squares: jax.Array, microbatch: jax.Array
) -> dict[str, Any]:
    """A device's health row (but its status) from its work."""
    return {
        "input_leaf": work.input_leaf,
        "grad_leaf": grad_leaf,
        "param_leaf": -1,
        "diverged_leaf": -1,
        "model_state_leaf": work.model_state_leaf,
        "microbatch": microbatch,
        "check": health.first_true(work.check_failed),
        "loss": work.loss,
        "grad_norm": squares,  # squared: health.to_table takes the root
    }


def replica_check(
    options: Options,
    state: TrainState,
    sharded: Sequence[bool] | None = None,
    given: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """This unit's fingerprints of its copy of params, optimizer state and model state
    (:func:`~jaxstep._src.program._model.unit_prints`: ``sharded``, the leaves held as
    shards without twins; ``given``, under ``model_parallel`` its devices' own), and
    its first non-finite parameter leaf (or -1). In the every-k-steps program only."""
    params = jax.tree.leaves(state.params)
    return unit_prints(options, state, sharded, given), health.first_nonfinite(params)[1]
