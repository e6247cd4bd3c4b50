"""What jaxstep's own layers do with a :class:`~jaxstep.TrainStep` beyond its face,
as functions taking the step. Users call the step, :func:`jaxstep.fit` and
:func:`jaxstep.diagnose`, which use these; other layers import the module as a
namespace (``from jaxstep.step import driving``), as they do ``core.validate``.

- the loop's call: :func:`dispatch` (calling the step, plus heartbeats and a replica
  check on demand), :func:`heartbeats`, :func:`rows_per_device`, :func:`origin` (the
  devices before ``exclude_devices``), :func:`join` (a pre-split batch as one),
  :func:`raw_table` (a step's table as read); a batch placed ahead of its step
  (``fit(prefetch=...)``): :func:`place_ahead`, :func:`placement`;
- reads of a replicated state: :func:`stacked`, :func:`first_copy`,
  :func:`local_copy`, :func:`replicas_agree` (the replica check alone);
- the replay diagnosis: :func:`replay` (the step again, chunks moved), and its passes
  over one chunk, :func:`failing_examples` and :func:`nonfinite_grad_leaves`;
- a failed step again as under ``on_failure="drop"`` (``fit(recover=...)``'s
  quarantine): :func:`rerun_dropping`, :func:`compile_dropping`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxstep.core import Batch
from jaxstep.core import PyTree
from jaxstep.core import StepOutput
from jaxstep.core import TrainState
from jaxstep.core import processes
from jaxstep.program import fingerprint
from jaxstep.program import held_shards
from jaxstep.step import _exclude as exclude
from jaxstep.step._inputs import join_presplit
from jaxstep.step._inputs import local_positions
from jaxstep.step._train_step import TrainStep

#: ``dispatch(step, state, batch, *, heartbeat=False, presplit=False,
#: check_replicas=False) -> (state, out)``: the method itself, not a wrapper, so the
#: loop's hot path pays for no extra call (its docstring says what each option does).
dispatch = TrainStep._dispatch


def heartbeats(step: TrainStep) -> dict[int, int]:
    """Device position -> the last step whose local part that device finished, as the
    heartbeat programs record it (``dispatch(..., heartbeat=True)`` and the heartbeat
    rerun). The live record: the loop clears it before a watched step."""
    return step._heartbeats


def rows_per_device(step: TrainStep) -> int:
    """Rows per device of the batch dispatched last, as this process passed it."""
    return step._inputs.rows_per_device


def origin(step: TrainStep) -> list[jax.Device] | None:
    """The devices the step was built with, once ``exclude_devices`` took some out
    (None before): a later ``fit`` call trains batches laid out for them."""
    return step._origin


def join(step: TrainStep, batch: Batch) -> Batch:
    """A pre-split ``(n_devices, per_device, ...)`` batch as one batch. Several
    processes: each passes its own rows, ``n_devices`` of them its own devices."""
    return step._join(batch)


def raw_table(step: TrainStep, out: StepOutput) -> np.ndarray:
    """A step's health table as read, the int32 ``(n, len(COLUMNS))`` array
    (``HealthTable.from_array`` decodes it): what ``step.table`` reads, undecoded.
    Waits for that step."""
    return step._backend.read_table(out.health)


def placement(step: TrainStep) -> object:
    """The placement the step's batches go to now: a batch placed ahead for another
    (``exclude_devices`` makes a new one) is placed again by the step."""
    return step._backend


def place_ahead(
    step: TrainStep, batch: Batch, presplit: bool = False
) -> tuple[object, Batch | None]:
    """``batch``, as the data gives it (``presplit``: each leaf ``(n_devices,
    per_device, ...)``), placed on the step's devices and split as the step splits it,
    ahead of its dispatch (fit's prefetch thread): the step takes it without another
    copy. Returns the :func:`placement` it was placed for and the placed batch (None:
    nothing to place ahead: under ``pmap``, whose call takes host arrays, or a batch
    already on devices). Several processes: this process's rows, one transfer per local
    device, no collective. Raises what ``jax.device_put`` raises for a batch the devices
    cannot take (the step, given the batch itself, says why)."""
    backend = step._backend  # read once: exclude_devices replaces it
    if backend.stacked:
        return backend, None
    if presplit:
        batch = join_presplit(batch, len(local_positions(backend.devices)))
    if all(isinstance(x, jax.Array) for x in jax.tree.leaves(batch)):
        return backend, None
    return backend, backend.place_batch(batch)


def stacked(step: TrainStep) -> bool:
    """Whether state leaves carry a leading device axis (the ``pmap`` backend)."""
    return step._backend.stacked


def first_copy(step: TrainStep, tree: PyTree) -> PyTree:
    """The numpy copy of ``tree`` held by this process's first device of the step (a
    small read: e.g. ``first_copy(step, state.step)``); typed keys come as
    :class:`jaxstep.core.HostKey`."""
    return step._backend.read_first(tree)


def local_copy(step: TrainStep, tree: PyTree, position: int) -> PyTree:
    """The numpy copy of a replicated (or pmap-stacked) ``tree`` held by
    ``step.devices[position]``; typed PRNG keys come as :class:`jaxstep.core.HostKey`
    (``step.place_state`` takes them back). A leaf sharded over the devices
    (``shard_state``) comes whole, gathered from its shards (across processes a
    collective: every process calls it alike)."""
    return step._backend.read_at(tree, position)


def replicas_agree(step: TrainStep, state: TrainState) -> bool:
    """Whether every device holds the same bits of ``state``'s params, optimizer state
    and model state: the replica check of the step, run alone (one small program: each
    device's fingerprint, gathered; compiled on first use)."""
    if step._fingerprints is None:
        axis = step.options.axis_name
        plan = step._backend.plan(state)
        held = None if plan is None else held_shards(plan, state)

        def prints(s: TrainState) -> jax.Array:
            leaves = jax.tree.leaves((s.params, s.opt_state, s.model_state))
            if held is not None:  # a shard has no second copy to compare
                leaves = [
                    jnp.zeros((), x.dtype) if h else x for x, h in zip(leaves, held, strict=True)
                ]
            return jax.lax.all_gather(fingerprint(leaves), axis)

        step._fingerprints = step._backend.compile_state_fn(prints, P())
    gathered = np.asarray(step._fingerprints(state))
    if step._backend.stacked:
        gathered = gathered[0]
    return bool(np.all(gathered == gathered[:1]))


def replay(
    step: TrainStep,
    state: TrainState,
    batch: Batch,
    *,
    rotation: int = 0,
    order: Sequence[int] | None = None,
    heartbeat: bool = False,
) -> tuple[TrainState, StepOutput]:
    """Runs the step again from ``state`` (not donated) with its chunks moved:
    ``devices[i]`` runs chunk ``order[i]`` of the global batch. By default each
    process's chunks are rotated by ``rotation`` among its own devices
    (:func:`jaxstep.distributed.local_rotation`): with one process, chunk ``(i +
    rotation) % n`` runs on ``devices[i]``. ``batch`` is what the step took (with
    several processes, this process's rows). Used by :func:`jaxstep.diagnose`.
    ``heartbeat=True`` runs the step's heartbeat variant, as :func:`dispatch` does
    (compiled on first use, then cached): each device's beat lands in
    :func:`heartbeats`, so a device that stalls in the replay can be named.

    Raises:
      ValueError: ``order`` is not a permutation of the device positions, or (several
        processes) gives a device a chunk of another process, whose rows are not here.
    """
    step._check_state(state)
    step._inputs.check_batch(batch)
    if order is None:
        chunks = processes.local_rotation(step.devices, rotation)
    else:
        chunks = _replay_order(step.devices, order)
    local = local_positions(step.devices)
    at = {p: j for j, p in enumerate(local)}  # position -> its chunk in this batch
    size = jax.tree.leaves(batch)[0].shape[0] // len(local)  # checked just above
    source = np.asarray([at[int(chunks[p])] for p in local], np.int64)
    rows = (source[:, None] * size + np.arange(size)[None, :]).reshape(-1)
    moved = jax.tree.map(lambda x: np.asarray(x)[rows], batch)
    copy = jax.tree.map(jnp.copy, state)
    extras = dict(step._extras)
    extras["chunk"] = step._make_extras(chunks)["chunk"]
    placed = step._backend.place_batch(moved)
    replicas = step._checks_replicas(step._step_number(state))
    fn: Any = step._compiled[(False, replicas)]
    if heartbeat:
        fn = step.compile(state, batch, heartbeat=True, replicas=replicas)
    new_state, out, _ = fn(copy, placed, extras)
    step._learn(out.info)
    return new_state, out


def _replay_order(devices: Sequence[jax.Device], order: Sequence[int]) -> np.ndarray:
    """``order`` checked: a permutation of the positions that keeps every chunk on a
    device of its own process."""
    n = len(devices)
    chunks = np.asarray(order)
    if chunks.shape != (n,) or sorted(chunks.tolist()) != list(range(n)):
        raise ValueError(
            f"replay order must be a permutation of the {n} device positions 0..{n - 1} "
            f"(order[i]: the chunk devices[i] runs), got {list(order)!r}"
        )
    crossing = [
        i
        for i, c in enumerate(chunks.tolist())
        if devices[c].process_index != devices[i].process_index
    ]
    if crossing:
        i = crossing[0]
        raise ValueError(
            f"replay order gives device {devices[i].id} (process "
            f"{devices[i].process_index}) chunk {int(chunks[i])}, whose rows process "
            f"{devices[int(chunks[i])].process_index} holds: each process passes "
            "only its own rows, so a chunk moves only among its process's devices "
            "(jaxstep.distributed.local_rotation)"
        )
    return chunks


def failing_examples(
    step: TrainStep, state: TrainState, batch: Batch, chunks: Sequence[int], step_number: int
) -> list[int]:
    """Global batch indices of the examples of ``chunks`` that fail on their own
    (input, loss, gradient, model state or a user check) from ``state`` at step
    ``step_number``: the per-example health pass of the replay diagnosis. Runs on one
    device; ``axis_name`` is bound to a one-example axis, so a model that communicates
    (cross-device BatchNorm) sees each example alone. With several processes only the
    chunks of ``chunks`` this process holds are run (the other rows are not here): the
    caller gathers the rest from the other processes."""
    step._inputs.check_batch(batch)
    local = local_positions(step.devices)
    held = set(local)
    mine = [c for c in chunks if c in held]
    copy = local_copy(step, state, local[0])
    return step._passes.failing_examples(copy, batch, mine, step_number, local)


def nonfinite_grad_leaves(
    step: TrainStep, state: TrainState, batch: Batch, position: int, step_number: int
) -> list[str]:
    """Names of the gradient leaves that are not finite for the rows
    ``devices[position]`` holds of ``batch``, run from ``state`` at step ``step_number``
    as that device ran them (one pass over the whole chunk, on one device;
    ``axis_name`` is bound to a one-chunk axis): which layers a non-finite gradient
    reached. Used by :func:`jaxstep.diagnose`. With several processes only the process
    holding ``devices[position]`` can run it (ValueError elsewhere)."""
    step._inputs.check_batch(batch)
    local = local_positions(step.devices)
    if position not in local:
        raise ValueError(
            f"device {step.devices[position].id}'s rows are not in this process's "
            f"batch: ask process {step.devices[position].process_index}"
        )
    copy, device = local_copy(step, state, local[0]), step.devices[position].id
    bad = step._passes.nonfinite_grad_leaves(copy, batch, position, device, step_number, local)
    return [step.names["params"][i] for i in bad]


def rerun_dropping(
    step: TrainStep,
    state: TrainState,
    batch: Batch,
    *,
    presplit: bool = False,
    heartbeat: bool = False,
) -> tuple[TrainState, StepOutput]:
    """Runs one step on ``batch`` from ``state`` as a step built with
    ``on_failure="drop"`` would, whatever ``step``'s policy: each device whose own
    checks fail (non-finite input, loss, gradient or model state, a user check) is left
    out of the step's mean, and the update is the mean over the others' chunks. Any
    number of devices but all may be left out (all failing: the step is skipped, as
    under ``skip``), with no limit on drops in a row; a failure found after the
    all-reduce (a loss spike) skips it whole. ``halted`` is cleared first: this reruns
    a failed step.

    ``state`` is ``step``'s (its structure in and out: the drop policy's fields,
    ``total_drops`` and ``monitor["drops"]`` / ``["repairs"]``, are added and let go on
    the host, reading nothing; under ``on_failure="drop"`` they are kept). It is not
    donated. Read the output with ``step.table(out)``: ``table.dropped`` marks the
    devices left out. Injected faults fire as in the step itself (a ``"data"`` fault
    again on its chunk; a transient that fired does not). The dropping step is compiled
    on first use (and again after ``step.exclude_devices``). ``heartbeat=True`` runs
    its heartbeat variant, as :func:`dispatch` does: each device's beat lands in
    :func:`heartbeats`, as the step's own would (``fit(step_timeout=...)`` names a
    device that stalls in the rerun); :func:`compile_dropping` compiles it ahead.

    Raises:
      ValueError, TypeError: the state or batch does not fit this step.
    """
    step.check_state(state)
    own = step.options.on_failure == "drop"
    dropping = _sibling(step)
    try:
        new, out = dropping._dispatch(
            _entering(step, state), batch, presplit=presplit, heartbeat=heartbeat
        )
    finally:
        step._extras = dropping._extras
    leaving = exclude.out_of_dropping(new, own=own)
    step._last_state, step._next_number = leaving, dropping._next_number
    step._inputs.rows_per_device = dropping._inputs.rows_per_device
    return leaving, out


def compile_dropping(
    step: TrainStep,
    state: TrainState,
    batch: Batch,
    *,
    heartbeat: bool = False,
    replicas: bool = False,
) -> None:
    """Compiles ahead :func:`rerun_dropping`'s program for this state and batch shape
    (cached), as ``step.compile`` does the step's: what ``fit(step_timeout=...)`` keeps
    out of a rerun's deadline."""
    step.check_state(state)
    _sibling(step).compile(_entering(step, state), batch, heartbeat=heartbeat, replicas=replicas)


def _sibling(step: TrainStep) -> TrainStep:
    """The dropping step (built on first use), with ``step``'s fault bookkeeping (what
    fired) and its heartbeats."""
    if step._dropping is None:
        step._dropping = TrainStep(exclude.dropping_options(step.options))
        step._dropping._heartbeats = step._heartbeats  # one record of beats
    dropping = step._dropping
    dropping._extras = step._extras
    dropping._inputs.presplit_warned = step._inputs.presplit_warned
    return dropping


def _entering(step: TrainStep, state: TrainState) -> TrainState:
    """``state`` as the dropping step takes it (one ``device_put`` of its fields)."""
    placed = step._backend.place_state(exclude.drop_fields(len(step.devices)))
    return exclude.into_dropping(state, placed, own=step.options.on_failure == "drop")
