"""The step watchdog of ``fit(step_timeout=...)``: each step runs on a dispatch thread
with per-device heartbeat callbacks; past the deadline the devices that did not finish
their local part are named in a ``HUNG`` error. (Whole processes that stop are the
peer heartbeats' to name: :mod:`jaxstep.distributed`.)"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from collections.abc import Callable
from typing import Any
from typing import TypeVar

from jaxstep._src import distributed
from jaxstep._src.core import Failure
from jaxstep._src.core import Status
from jaxstep._src.core import StepOutput
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import TrainState
from jaxstep._src.core import failed_alike
from jaxstep._src.core import processes
from jaxstep._src.loop._action import Runner
from jaxstep._src.loop._pending import Item
from jaxstep._src.step import Runtime

#: what a watched call returns: a step's ``(state, out)`` or a replay's ``out``
Ran = TypeVar("Ran", tuple[TrainState, StepOutput], StepOutput)


class StepWatchdog(Runner):
    """The loop's runner under ``fit(step_timeout=...)``: runs each step on a dispatch
    thread and waits for it with a deadline, so a hung device is named instead of
    hanging the host (CPU runs steps with host callbacks synchronously, so the wait must
    not be on the dispatching thread). A step has finished when :meth:`run` returns: the
    loop settles it at once (:attr:`settles_at_once`). It holds no step: each call is
    handed the runtime it runs on."""

    settles_at_once = True

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxstep-step")

    def run(
        self,
        runtime: Runtime,
        state: TrainState,
        item: Item,
        expected: int,
        check_replicas: bool,
        presplit: bool,
    ) -> tuple[TrainState, StepOutput]:
        """Runs step ``expected`` (``state``'s) on ``item``'s batch on ``runtime`` and
        returns what the step returns, or raises the ``HUNG`` error naming the devices
        that did not finish their local part in time. ``item.drop``: a quarantine's
        rerun (``Runtime.rerun_dropping``), watched the same way."""
        batch = runtime.join(item.batch) if presplit else item.batch
        call: Callable[..., tuple[TrainState, StepOutput]]
        if item.drop:
            compile_ahead: Callable[..., Any] = runtime.compile_dropping
            call = functools.partial(runtime.rerun_dropping, heartbeat=True)
            # as without a watchdog: the rerun checks replicas on divergence_every's
            # schedule only (the step's failed first run did the checkpoint's check)
            check_replicas = False
        else:
            compile_ahead = runtime.compile
            call = functools.partial(
                runtime.dispatch, heartbeat=True, check_replicas=check_replicas
            )
        for check in (False, check_replicas or runtime.options.divergence_every is not None):
            # Compile time is not step time: both programs, before the clock starts.
            compile_ahead(state, batch, heartbeat=True, check_replicas=check)
        return self._watch(runtime, functools.partial(call, state, batch), expected)

    def replay(
        self, runtime: Runtime, state: TrainState, batch: Any, rotation: int, expected: int
    ) -> StepOutput:
        """:meth:`Runtime.replay` on ``runtime`` of step ``expected`` (from ``state``, not
        donated) with the chunks rotated by ``rotation``, watched as a step is: its
        heartbeat variant (compiled ahead), and past the deadline the ``HUNG`` error
        naming the devices that did not finish their part of the replay (the diagnosis
        of ``fit(diagnose=True)`` and of ``recover``)."""
        for check in (False, runtime.options.divergence_every is not None):
            runtime.compile(state, batch, heartbeat=True, check_replicas=check, replay=True)
        call = functools.partial(runtime.replay, state, batch, rotation=rotation, heartbeat=True)
        during = f"the replay that diagnoses step {expected}"
        return self._watch(runtime, call, expected, during)

    def close(self) -> None:
        """Lets the dispatch thread go (it is idle: each run waited for its step)."""
        self.pool.shutdown(wait=False)

    def _watch(
        self, runtime: Runtime, call: Callable[[], Ran], expected: int, during: str | None = None
    ) -> Ran:
        """``call()`` (a call of ``runtime``) on the dispatch thread, waited for until the
        deadline: what it returns (a step's ``(state, out)``, a replay's ``out``) once its
        health table is ready, or the ``HUNG`` error (or a lost peer's)."""
        # Only this run's beats count: a step run again (a retry, a rerun, a rollback,
        # a replay) has the step number its earlier run beat with.
        runtime.heartbeats.clear()
        future = self.pool.submit(call)
        deadline = time.monotonic() + self.timeout
        pause = 1e-4
        while not (future.done() and _output(future.result()).health.is_ready()):  # type: ignore[attr-defined]
            lost = distributed.lost_processes()
            if lost:  # a peer process died or froze: no need to wait for the deadline
                self.pool.shutdown(wait=False)
                raise distributed.lost_error(lost, expected, runtime.devices)
            if time.monotonic() > deadline:
                self.pool.shutdown(wait=False)
                raise hung(runtime, expected, self.timeout, during)
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        return future.result()


def _output(ran: tuple[TrainState, StepOutput] | StepOutput) -> StepOutput:
    """The step output of what a watched call returned."""
    return ran if isinstance(ran, StepOutput) else ran[1]


def hung(
    runtime: Runtime, expected: int, timeout: float, during: str | None = None
) -> TrainingWorkerError:
    """The ``HUNG`` error of step ``expected`` (``during``: in what run of it, e.g. a
    replay), naming the devices whose heartbeat did not come (every device when all of
    them reached the collective); the Python stacks go to the log first."""
    what = f"step {expected}" if during is None else during
    distributed.log_stacks(f"{what} did not finish within {timeout:.1f} s")
    done = {i for i, beat in dict(runtime.heartbeats).items() if beat >= expected}
    many = processes.spans_processes(runtime.devices)
    if many:
        # Each process saw only its own devices' heartbeats: pool them, so every
        # process names the same devices.
        done, _ = distributed.share_heartbeats(expected, sorted(done), wait_s=min(timeout, 10.0))
    # a beat a device, by its place in the mesh's order (model_parallel: m a unit)
    m = runtime.options.model_parallel
    every = range(len(runtime.devices) * m)
    chips = [i for i in every if i not in done]
    where = "before reaching the first collective"
    if not chips:  # every device reached the collective: the hang is in or after it
        chips = list(every)
        where = "after reaching the first collective (all devices did)"
    if runtime.options.replicas > 1:  # its program carries no heartbeat (Programs)
        chips = list(every)
        where = (
            "(which device hung is not known: a step with replicas > 1 carries no "
            "heartbeat, as JAX lowers no host callback in its program of two meshes)"
        )
    if during is not None:
        where += f", in {during}"
    mesh_ids = [d.id for d in runtime.options.mesh_devices]
    late = sorted({i // m for i in chips})

    def reason(unit: int) -> str:
        said = f"did not finish its part of the step within {timeout:g} s, {where}"
        if runtime.options.replicas > 1:  # no beat: the step as a whole
            said = f"the step did not finish within {timeout:g} s {where}"
        own = [mesh_ids[i] for i in chips if i // m == unit]
        if m == 1 or len(own) == m:
            return said
        return f"device(s) {', '.join(map(str, own))} of its model group {said}"

    failures = [
        Failure(
            device_id=runtime.devices[i].id,
            process_index=runtime.devices[i].process_index,
            host=processes.host_name(runtime.devices[i].process_index) if many else None,
            step=expected,
            status=Status.HUNG,
            reason=reason(i),
            leaf=None,
            group=runtime.options.group_ids(runtime.devices[i].id),
        )
        for i in late
    ]
    note = (
        "the state lives on the hung device(s) and cannot be read: error.state is None; "
        "restore from the last checkpoint (on CPU, XLA aborts a stuck collective ~40 s in)"
    )
    alike = failed_alike(failures, len(runtime.devices))  # every device waits in the collective
    return TrainingWorkerError(failures, state=None, note=note, alike=alike)
