"""Replay diagnosis: was it the data, the device, or a one-off?

Megatron-LM re-runs a step after a job restart to tell these apart; jaxstep's state
is a value, so it replays in place: once with the same placement and once with the
chunks rotated onto other devices. With several processes the chunks rotate among each
process's own devices (a process holds only its rows); the replays' health tables are
global, and what only one process can see (the examples of its chunks, the gradient
leaves of its device) is shared through the coordination service, so every process
reaches the same diagnosis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxstep._src.core import ReplayVerdict
from jaxstep._src.core import Status
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import from_host
from jaxstep._src.core import processes
from jaxstep._src.loop._action import Action
from jaxstep._src.loop._outcome import step_of
from jaxstep._src.loop._pending import Pending
from jaxstep._src.loop._watchdog import StepWatchdog
from jaxstep._src.step import Runtime
from jaxstep._src.step import TrainStep
from jaxstep._src.step import runtime_of

# Causes a replay can follow from chunk to device, earliest in the chain first.
_ROOTS = (
    Status.INPUT_NONFINITE,
    Status.LOSS_NONFINITE,
    Status.GRAD_NONFINITE,
    Status.MODEL_STATE_NONFINITE,
    Status.CHECK_FAILED,
    Status.LOSS_SPIKE,
)


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """The verdict of a replay, with its evidence.

    Attributes:
      verdict: ``"data"`` (fails again and the failure follows the chunk),
        ``"device"`` (fails again and stays on the device), ``"transient"`` (does not
        fail again) or ``"inconclusive"``; ``"diverged"`` for a replica whose copy of
        the state differs (not replayed: no verdict on the chip; the error's hint says
        what to do).
      evidence: what each replay showed, in words.
      examples: for ``"data"``: indices in the global batch of the examples that fail
        on their own (empty if none does alone), found on every process.
      replays: ``(rotation, failing device ids)`` of each replay: 0 in place, 1 with
        each process's chunks rotated by one among its devices (with one process, chunk
        ``i + 1`` on device ``i``).
      grad_leaves: for a non-finite gradient that comes back on replay: the gradient
        leaves it reached on the first failing device, in tree order (the error names
        only the first of them).
      root_devices: when a collective in the model (cross-device BatchNorm, a
        ``pmean`` in the loss) carried the failure to every device: the ids of the
        devices whose own rows fail alone, where it started. The error then leads
        with them.
      chip: under ``make_train_step(model_parallel=m)``, for a ``"device"`` verdict:
        the id of the device of the failing model group that the fault follows, found
        by replaying with the model positions rotated across the groups (the evidence
        says which rotation moved it; with several processes among each process's
        own groups), or None (the group is alone on its process, or no single device
        explains it). ``devices`` still names the group
        (its first device): a group goes whole.

    Example:
      A NaN in the input of example 1 of device 3's chunk follows that chunk to whichever
      device runs it:

      >>> import jaxstep
      >>> from jaxstep.testing import Fault, tiny_step
      >>> tiny = tiny_step(faults=[Fault("input", device_id=3, step=1, mode="data", example=1)])
      >>> try:
      ...     jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3), diagnose=True)
      ... except jaxstep.TrainingWorkerError as err:
      ...     diagnosis = err.diagnosis
      >>> diagnosis.verdict, diagnosis.examples
      ('data', (7,))
    """

    verdict: ReplayVerdict
    evidence: tuple[str, ...]
    examples: tuple[int, ...] = ()
    replays: tuple[tuple[int, tuple[int, ...]], ...] = ()
    grad_leaves: tuple[str, ...] = ()
    root_devices: tuple[int, ...] = ()
    chip: int | None = None

    @property
    def devices(self) -> tuple[int, ...]:
        """The ids of the devices the verdict is about: where a failure that spread
        started (``root_devices``), else those that failed again in the replay in
        place (for a ``"data"`` verdict the devices holding the examples, for
        ``"device"`` the bad ones); empty for ``"transient"``. When a collective in the
        model carried a failure to every device, these are fewer than the step's
        failures."""
        return self.root_devices or dict(self.replays).get(0, ())

    def __str__(self) -> str:
        text = f"{self.verdict}: " + "; ".join(self.evidence)
        if self.examples:
            text += f"; offending examples (global batch index): {list(self.examples)}"
        return text


def diagnose(
    step: TrainStep,
    error: TrainingWorkerError,
    batch: Any,
    *,
    step_timeout: float | None = None,
) -> Diagnosis:
    """Replays the failed step of ``error`` on ``batch`` from ``error.state``.

    With several processes, every process calls it (the replays are steps of every
    device) and gets the same diagnosis.

    Args:
      step: the step that failed.
      error: its error; ``error.state`` is the last good state (left untouched).
      batch: the batch of the failed step, as the step took it (with several
        processes: this process's rows).
      step_timeout: seconds each replay may take, as ``fit(step_timeout=...)``'s
        steps (``fit`` passes its own): a device that stalls in a replay is named in a
        ``HUNG`` error instead of hanging the host. None: not watched.

    Returns:
      A :class:`Diagnosis`.

    Raises:
      TrainingWorkerError: a replay hung (``Status.HUNG``), or a peer process was lost.
      ValueError: ``error`` has no state to replay from (a hang).

    Example:
      A fault of device 3's own: the replay moves device 3's rows elsewhere, and device 3
      fails again on other rows.

      >>> import jaxstep
      >>> from jaxstep.testing import Fault, tiny_step
      >>> tiny = tiny_step(faults=[Fault("grad", device_id=3, step=1)])
      >>> try:
      ...     jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3), diagnose=False)
      ... except jaxstep.TrainingWorkerError as err:
      ...     diagnosis = jaxstep.diagnose(tiny.step, err, err.batches[0])
      >>> diagnosis.verdict, diagnosis.replays
      ('device', ((0, (3,)), (1, (3,))))
    """
    return diagnose_on(runtime_of(step), error, batch, step_timeout=step_timeout)


def diagnose_on(
    runtime: Runtime, error: TrainingWorkerError, batch: Any, *, step_timeout: float | None = None
) -> Diagnosis:
    """:func:`diagnose` on a step's runtime (fit's replay and recovery: the runtime they
    run on)."""
    if error.state is None:
        raise ValueError(
            f"error has no state to replay from (status {error.status!r}); a hung step "
            "cannot be replayed in this process"
        )
    if error.status & Status.DIVERGED and not error.state_is_good:
        ids = [f.device_id for f in error.failures if f.status & Status.DIVERGED]
        named = " and ".join(str(i) for i in ids)
        return Diagnosis(
            "diverged",
            (
                f"devices {named}: their copies of the state differ and no majority tells "
                "which one is bad; not replayed (no copy is known healthy to replay from), "
                "so this says nothing of either chip",
            ),
        )
    if error.status & Status.DIVERGED:
        return Diagnosis(
            "diverged",
            (
                f"device {error.device_id}: its copy of the state differs from the majority's; "
                "not replayed (a replay would start from a healthy copy and pass), so this "
                "says nothing of the chip: one divergence does not tell a bad chip from a "
                "one-off corruption",
            ),
        )
    if error.status & Status.HUNG:
        return Diagnosis(
            "device",
            (f"device {error.device_id}: it hung; no replay needed (no state to replay from)",),
        )
    position = {d.id: i for i, d in enumerate(runtime.devices)}
    failed = tuple(sorted(position[f.device_id] for f in error.failures))

    # Follow the root cause only: when the model communicates (cross-device
    # BatchNorm), one device's bad input makes every device's loss non-finite, but
    # only the device holding the bad rows fails its input check.
    root = next((flag for flag in _ROOTS if flag in error.status), None)
    if root is not None:
        failed = tuple(sorted(position[f.device_id] for f in error.failures if root in f.status))

    state = error.state
    watchdog = None if step_timeout is None else StepWatchdog(step_timeout)

    def hits(status: np.ndarray) -> tuple[int, ...]:
        hit = status != 0 if root is None else (status & int(root)) != 0
        return tuple(int(i) for i in np.flatnonzero(hit))

    def run(rotation: int) -> tuple[int, ...]:
        if watchdog is None:
            out = runtime.replay(state, batch, rotation=rotation)
        else:
            out = watchdog.replay(runtime, state, batch, rotation, error.step)
        return hits(runtime.table(out).status)

    try:
        same = run(0)
        found = _verdict(runtime, error, batch, failed, same, run)
    finally:
        if watchdog is not None:
            watchdog.close()
    if found.verdict == "device" and runtime.options.model_parallel > 1 and len(same) == 1:
        found = _which_chip(runtime, error, batch, found, same[0], hits)
    if same and root == Status.GRAD_NONFINITE:
        found = _with_grad_leaves(found, runtime, error, batch, failed[0] if failed else same[0])
    return found


def _verdict(
    runtime: Runtime,
    error: TrainingWorkerError,
    batch: Any,
    failed: tuple[int, ...],
    same: tuple[int, ...],
    run: Callable[[int], tuple[int, ...]],
) -> Diagnosis:
    """The verdict once the replay in place (``same``: the devices that failed in it)
    is known; rotates the chunks where that tells data from device."""
    n = len(runtime.devices)
    ids = [d.id for d in runtime.devices]
    replays = [(0, tuple(ids[i] for i in same))]
    if not same:
        evidence: tuple[str, ...] = (
            f"step {error.step} failed on device(s) {[ids[i] for i in failed]}, and a replay "
            "from the last good state with the same data and placement passed",
        )
        return Diagnosis("transient", evidence, replays=tuple(replays))
    if n == 1:
        return Diagnosis(
            "inconclusive",
            ("fails again on replay; with one device the chunk cannot be moved",),
            replays=tuple(replays),
        )
    if len(same) == n:
        return _spread(runtime, error, batch, replays)
    order = processes.local_rotation(runtime.devices, 1)
    stuck = [ids[i] for i in same if order[i] == i]
    if stuck:
        evidence = (
            f"fails again on replay on device(s) {[ids[i] for i in same]}; device(s) "
            f"{stuck} are the only device of their process in this step, and a process "
            "holds only its own rows, so their chunk cannot move to tell data from device",
        )
        return Diagnosis("inconclusive", evidence, replays=tuple(replays))
    moved = run(1)  # device i now holds chunk order[i] (i + 1 with one process)
    replays.append((1, tuple(ids[i] for i in moved)))
    chunks_then = set(same)
    chunks_now = {int(order[i]) for i in moved}
    where_now = [ids[i] for i in moved]
    if moved and chunks_now == chunks_then and set(moved) != set(same):
        size = processes.local_rows_per_device(batch, runtime.devices)
        rows = ", ".join(f"{c * size}..{(c + 1) * size - 1}" for c in sorted(chunks_then))
        evidence = (
            f"fails again on replay on device(s) {[ids[i] for i in same]}",
            f"with the chunks rotated it fails on device(s) {where_now}, which now hold the "
            f"same rows ({rows}): the failure follows the data",
        )
        examples = _examples(runtime, error, batch, sorted(chunks_then))
        return Diagnosis("data", evidence, examples, tuple(replays))
    if set(moved) == set(same):
        evidence = (
            f"fails again on replay on device(s) {[ids[i] for i in same]}",
            "with other rows on those devices it fails there again: the failure stays on the "
            "device (suspect the chip; run without it)",
        )
        return Diagnosis("device", evidence, replays=tuple(replays))
    evidence = (
        f"fails again on replay on device(s) {[ids[i] for i in same]}",
        f"with the chunks rotated it fails on {where_now}: neither the data nor the "
        "device alone explains it",
    )
    return Diagnosis("inconclusive", evidence, replays=tuple(replays))


def _which_chip(
    runtime: Runtime,
    error: TrainingWorkerError,
    batch: Any,
    found: Diagnosis,
    group: int,
    hits: Callable[[np.ndarray], tuple[int, ...]],
) -> Diagnosis:
    """A ``"device"`` verdict on model group ``group`` (a position), sharpened to one
    of its devices: for each model position ``j > 0`` the step is replayed on a
    runtime whose groups swap position ``j`` one group along (group ``i`` takes the
    next group's device there), so group ``group``'s device at ``j`` now sits in the
    group before it: a failure that moves there follows that device; one that stays
    through every rotation follows the device none of them moves, the group's first.
    With several processes the rotation runs among each process's own groups (a group
    never spans processes and a process holds only its groups' rows: the chunks stay
    where they are, only chips move); a group alone on its process cannot be told
    apart. On a runtime of its own, compiled for it (the state placed on it through
    the host, read from a group of this process)."""
    options = runtime.options
    groups, n, m = options.groups, options.n, options.model_parallel
    ahead = _next_group(groups)
    if ahead[group] == group:
        return found  # the only group of its process (or of the step): nothing to swap with
    behind = next(i for i in range(n) if ahead[i] == group)
    assert error.state is not None  # checked by diagnose
    here = jax.process_index()
    mine = group if groups[group][0].process_index == here else None
    if mine is None:
        mine = next(i for i in range(n) if groups[i][0].process_index == here)
    host = runtime.backend.read_at(error.state, mine)
    fired = runtime.extras.fired() if runtime.extras.n_faults else None
    ids = [tuple(d.id for d in g) for g in groups]
    evidence = list(found.evidence)
    for j in range(1, m):
        swapped = tuple(
            tuple(groups[ahead[i]][k] if k == j else groups[i][k] for k in range(m))
            for i in range(n)
        )
        moved = dataclasses.replace(options, devices=[g[0] for g in swapped], groups=swapped)
        other = type(runtime)(moved, inputs=runtime.inputs, fired=fired)
        placed = other.backend.place_state(from_host(host))
        other.continues(placed, int(host.step))
        now = hits(other.table(other.replay(placed, batch)).status)
        chip = ids[group][j]
        if now == (behind,):
            evidence.append(
                f"with model position {j} rotated across the groups (device {chip} moved to "
                f"the group of device {ids[behind][0]}) the failure moved with it: "
                f"it follows device {chip}"
            )
            return dataclasses.replace(found, evidence=tuple(evidence), chip=chip)
        if now != (group,):
            evidence.append(
                f"with model position {j} rotated across the groups it fails on positions "
                f"{list(now)}: no one device of the group explains it"
            )
            return dataclasses.replace(found, evidence=tuple(evidence))
    chip = ids[group][0]
    evidence.append(
        f"with every other model position rotated across the groups the failure stayed "
        f"with device {chip} (model position 0): it follows device {chip}"
    )
    return dataclasses.replace(found, evidence=tuple(evidence), chip=chip)


def _next_group(groups: Sequence[Sequence[jax.Device]]) -> list[int]:
    """For each model group (a position), the group whose devices it takes in a
    rotation: the next of its own process's groups, in order, the last taking the
    first's (itself when it is its process's only one)."""
    by_process: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_process.setdefault(g[0].process_index, []).append(i)
    ahead = list(range(len(groups)))
    for members in by_process.values():
        for a, i in enumerate(members):
            ahead[i] = members[(a + 1) % len(members)]
    return ahead


def _spread(
    runtime: Runtime,
    error: TrainingWorkerError,
    batch: Any,
    replays: list[tuple[int, tuple[int, ...]]],
) -> Diagnosis:
    """Every device fails again on replay: either the model or the update is at fault,
    or one device's rows fail and a collective in the model carries the failure to the
    others. Each example alone (collectives see a one-example axis) tells which."""
    n, ids = len(runtime.devices), [d.id for d in runtime.devices]
    examples = _examples(runtime, error, batch, list(range(n)))
    evidence: tuple[str, ...]
    if not examples:
        evidence = (
            "every device fails again on replay, and no example fails alone: the cause is "
            "in the model or the update (or needs several rows together), not in one "
            "device or one chunk",
        )
        return Diagnosis("inconclusive", evidence, replays=tuple(replays))
    size = processes.local_rows_per_device(batch, runtime.devices)
    roots = tuple(dict.fromkeys(ids[e // size] for e in examples))
    evidence = (
        "every device fails again on replay",
        f"each example alone, on one device: {len(examples)} fail(s), all in the rows of "
        f"device(s) {list(roots)}, and every other example passes: the failure starts in "
        "that data, and a collective in the model (cross-device BatchNorm, a pmean in "
        "the loss) carries it to every device",
    )
    return Diagnosis("data", evidence, tuple(examples), tuple(replays), root_devices=roots)


def _examples(
    runtime: Runtime, error: TrainingWorkerError, batch: Any, chunks: list[int]
) -> tuple[int, ...]:
    """The examples of ``chunks`` (device positions) that fail alone, sorted: each
    process runs the chunks it holds, and with several processes each one's finds are
    shared (:func:`jaxstep.distributed.share`), so every process holds them all."""
    assert error.state is not None  # checked by diagnose
    mine = runtime.passes.failing_examples(error.state, batch, chunks, error.step)
    found = processes.share("diagnose/examples", mine, runtime.devices)
    return tuple(sorted(int(e) for seen in found.values() for e in seen))


def _with_grad_leaves(
    found: Diagnosis, runtime: Runtime, error: TrainingWorkerError, batch: Any, position: int
) -> Diagnosis:
    """``found`` with the gradient leaves the non-finite gradient reached on
    ``devices[position]``: the error names the first in tree order, which is not
    where a NaN that arose near the output started."""
    assert error.state is not None  # checked by diagnose
    # every process runs the pass (sharded parameters are gathered in it); only the
    # one holding the device's rows gets its leaves, and shares them
    leaves = runtime.passes.nonfinite_grad_leaves(error.state, batch, position, error.step)
    bad = None if leaves is None else [runtime.names["params"][i] for i in leaves]
    shared = processes.share("diagnose/grad_leaves", bad, runtime.devices)
    bad = next(seen for seen in shared.values() if seen is not None)
    names = runtime.names["params"]
    device = runtime.devices[position].id
    if not bad:
        note = (
            f"device {device}'s rows alone, in one pass, give finite gradients: the "
            "non-finite gradient needs more than them (the other devices' rows, through a "
            "collective in the model, or a micro-batch's own key)"
        )
    elif len(bad) == len(names):
        note = (
            f"on replay every gradient leaf is non-finite on device {device} ({len(bad)} of "
            f"{len(names)}), as when the NaN arises at the output layer or in loss_fn's "
            "backward pass: the leaf named above is only the first in tree order"
        )
    else:
        finite = [name for name in names if name not in bad]
        more = ", ..." if len(bad) > 4 else ""
        note = (
            f"on replay {len(bad)} of {len(names)} gradient leaves are non-finite on device "
            f"{device} ({', '.join(bad[:4])}{more}); the other {len(finite)} stay finite: "
            "the NaN reached only the layers that own these"
        )
    return dataclasses.replace(found, evidence=(*found.evidence, note), grad_leaves=tuple(bad))


class Replay(Action):
    """The loop's replay action: a failure that leaves fit carries the verdict of its
    replay (``error.diagnosis``, and in its message). ``every`` (``fit(diagnose=True)``):
    every failure is replayed; None (the default): only one every device had alike
    (``error.alike``), where the step alone cannot tell which device's rows started it
    and the replay can (a failure the replay cannot help, a hang, a diverged replica or
    a state already bad, is left as it is). ``presplit``: the failing batch came
    pre-split (joined for the replay). The replays are watched as the steps are
    (``step_timeout``), on the step the failing one ran on (``Pending.step``)."""

    bucket = "diagnosis"

    def __init__(
        self,
        every: bool | None = True,
        presplit: bool = False,
        step_timeout: float | None = None,
    ):
        self.every = bool(every)
        self.presplit = presplit
        self.step_timeout = step_timeout

    def failed(self, pending: Pending, error: TrainingWorkerError) -> TrainingWorkerError:
        """``error`` with its diagnosis (a recovery may have replayed it already).

        Raises:
          TrainingWorkerError: a replay hung, or a peer process was lost (the loop
            reports it as a hang).
        """
        if error.diagnosis is not None:
            return error
        runtime = runtime_of(step_of(pending))
        batch = pending.batch
        if self.presplit and (pending.item is None or pending.item.first is None):
            batch = runtime.join(batch)  # the replay takes the global batch
        if self.every:
            found = diagnose_on(runtime, error, batch, step_timeout=self.step_timeout)
            return error.with_diagnosis(found)
        if not (error.alike and error.state is not None and error.state_is_good):
            return error
        if error.status & (Status.DIVERGED | Status.HUNG):
            return error
        try:
            found = diagnose_on(runtime, error, batch, step_timeout=self.step_timeout)
        except TrainingWorkerError:
            raise  # the replay hung, or a peer process was lost: the loop reports it
        except Exception as why:  # never let the automatic replay hide the failure
            return error.with_note(f"the automatic replay of this failure failed: {why!r}")
        return error.with_diagnosis(found)
