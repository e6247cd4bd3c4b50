"""One process of a multi-process test, started by ``python -m jaxstep.launch``.

    python -m jaxstep.launch -n 2 --error-dir D tests/multihost_child.py MODE

Every process builds the same global batches and passes its own rows. MODE:
``nan`` (a NaN in the input chunk of process 1's second device at step 3),
``kill`` (process 1 SIGKILLs itself after step 2), ``raise`` (a Python error on
process 1 alone after step 2, jax#11987), ``stall`` (process 1's second device stalls
at step 3, ``step_timeout``), ``sharded`` (under ``shard_state="optimizer"``, then
``"params"``, then ``"params"`` with ``replicas=2``: the ``nan`` run with checkpoints,
its latest checkpoint and emergency save restored, and the rest trained from the
checkpoint), ``chip`` (model groups of 2 devices: a device fault on one chip of process
1, diagnosed), ``resume`` (resume from the
checkpoints of an earlier run, train to the end, and process 0 saves the parameters).
With a checkpoint directory (second argument) the run checkpoints every 2 steps. Each
process prints one line ``RESULT {json}`` with what it saw.
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import optax

import jaxstep
from jaxstep import distributed
from jaxstep._src.step import runtime_of
from jaxstep.testing import Fault
from tests import child
from tests.child import result
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

STEPS = 8
AT = 3


def error_fields(err):
    return {
        "raised": True,
        "device_id": err.device_id,
        "process_index": err.process_index,
        "host": err.failures[0].host,
        "step": err.step,
        "status": int(err.status),
        "ids": [f.device_id for f in err.failures],
        "message": str(err),
        "note": err.note,
        "checkpoint": err.checkpoint,
    }


def sharded(checkpoint_dir: str, save_params: str) -> None:
    """``sharded``: each layout's run, its checkpoints restored, the rest trained; process
    0 saves the parameters of each (whole: host_state gathers every process's shards)."""
    import numpy as np

    devices = jax.devices()
    target = child.target(devices)
    batches = child.local_batches(make_batches(STEPS), devices)
    seen, saved = {}, {}
    # replicas=2 on 2 processes of 4: one group a process, every shard's twin on the other
    for layout, replicas in (("optimizer", 1), ("params", 1), ("params", 2)):
        label = layout if replicas == 1 else f"{layout}-r{replicas}"
        where = f"{checkpoint_dir}/{label}"

        def make(faults=(), layout=layout, replicas=replicas):
            return jaxstep.make_train_step(
                loss_fn,
                optax.adam(1e-2),
                shard_state=layout,
                shard_min_size=0,
                replicas=replicas,
                divergence_every=2,
                faults=faults,
            )

        step = make([Fault("input", device_id=target.id, step=AT)])
        try:
            jaxstep.fit(
                step, step.init(init_params()), batches, checkpoint_dir=where, checkpoint_every=2
            )
        except jaxstep.TrainingWorkerError as err:
            seen[label] = error_fields(err)
        clean = make()
        for name, state in (
            ("emergency", jaxstep.restore(clean, seen[label]["checkpoint"])),
            ("latest", jaxstep.restore(clean, where)),
            ("resumed", jaxstep.fit(clean, jaxstep.restore(clean, where), batches[2:])),
        ):
            params = clean.host_state(state).params  # a collective: both processes
            flat = jax.tree_util.tree_leaves_with_path(jax.device_get(params))
            saved.update({f"{label}/{name}{jax.tree_util.keystr(k)}": v for k, v in flat})
    if jax.process_index() == 0:
        np.savez(save_params, **saved)
    result(target=target.id, errors=seen)


def megatron(path, shape):
    """The model axis's rule of tests/step/test_model_parallel.py: the first layer's
    columns split over the group, the second's rows."""
    if "dense1" in path:
        return len(shape) - 1
    return 0 if "dense2" in path and len(shape) == 2 else None


def chip() -> None:
    """``chip``: model groups of 2 devices inside each process; a device fault on one
    chip of process 1 (at model position 1, then at 0), diagnosed: both processes name
    the chip, found by rotating the model positions among process 1's two groups."""
    devices = jax.devices()
    here = [d for d in devices if d.process_index == 1]
    seen = {}
    for chip in (here[1], here[2]):  # position 1 of the first group, 0 of the second
        fault = Fault("grad", device_id=chip.id, step=1, mode="device")
        step = jaxstep.make_train_step(
            loss_fn,
            optax.adam(1e-2),
            model_parallel=2,
            model_rule=megatron,
            divergence_every=None,
            faults=[fault],
        )
        batches = child.local_batches(make_batches(3), step.devices)
        try:
            jaxstep.fit(step, step.init(init_params()), batches, diagnose=True)
        except jaxstep.TrainingWorkerError as err:
            seen[chip.id] = {
                "group": list(err.group),
                "verdict": err.diagnosis.verdict,
                "chip": err.diagnosis.chip,
                "evidence": list(err.diagnosis.evidence),
            }
    result(chips=seen)


@distributed.record
def main(mode: str, checkpoint_dir: str | None = None, save_params: str | None = None) -> None:
    if mode == "chip":
        return chip()
    if mode == "sharded":
        assert checkpoint_dir is not None and save_params is not None
        return sharded(checkpoint_dir, save_params)
    devices = jax.devices()
    target = child.target(devices)
    faults, kwargs = [], {}
    if mode == "nan":
        faults = [Fault("input", device_id=target.id, step=AT)]
        kwargs = {"prefetch": 3}  # each process's thread pulls and places its rows ahead
    elif mode == "stall":
        faults = [Fault("stall", device_id=target.id, step=AT, seconds=300)]
        kwargs = {"step_timeout": 6.0}
    if checkpoint_dir is not None:
        kwargs.update(checkpoint_dir=checkpoint_dir, checkpoint_every=2, resume=mode == "resume")
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), faults=faults, divergence_every=2)
    state = step.init(init_params())
    batches = child.local_batches(make_batches(STEPS), devices)
    rejected = {}
    if mode == "nan":  # what a multi-process run refuses, before anything runs
        try:
            jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend="pmap")
        except ValueError as err:
            rejected["pmap"] = str(err)
        try:  # 6 local rows do not split over this process's 4 devices
            step(state, jax.tree.map(lambda x: x[:6], batches[0]))
        except ValueError as err:
            rejected["rows"] = str(err)
        # pmap-style (its own 4 devices, per_device, ...): joined back to its rows
        split = jax.tree.map(lambda x: x.reshape(4, -1, *x.shape[1:]), batches[0])
        joined = jax.tree.leaves(runtime_of(step).join(split))
        rejected["presplit_joins"] = all(
            (a == b).all() for a, b in zip(joined, jax.tree.leaves(batches[0]), strict=True)
        )
        if jax.process_index() == 1:  # its own devices only: orbax cannot write from it
            local = jaxstep.make_train_step(loss_fn, optax.sgd(0.1), devices=jax.local_devices())
            try:
                jaxstep.fit(local, state, [], checkpoint_dir=checkpoint_dir, checkpoint_every=100)
            except ValueError as err:
                rejected["local_checkpoint"] = str(err)

    class Kill:
        def on_step_end(self, table):
            if jax.process_index() != 1 or table.step != AT - 1:
                return
            if mode == "kill":
                # Between collectives (step 3 is tiny and already dispatched): a peer
                # killed in the middle of a gloo message can make gloo abort the others
                # (std::terminate) before any Python runs, which no watchdog can name.
                time.sleep(1.0)
                print(f"KILLING {time.time()}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "raise":
                print(f"RAISING {time.time()}", flush=True)
                raise ValueError("bad record in the data of process 1")

    start = time.monotonic()
    try:
        state = jaxstep.fit(step, state, batches, callbacks=[Kill()], **kwargs)
    except jaxstep.TrainingWorkerError as err:
        fields = error_fields(err)
        fields.update(target=target.id, rejected=rejected)
        fields["held"] = [d.id for d in devices if d.process_index == 1]
        # the failing batch and every one pulled after it (prefetched too), in order
        fields["untrained"] = [
            next(i for i, b in enumerate(batches) if b is x) for x in err.batches
        ]
        # where the time went: the same on every process after a step's failure
        fields["goodput"] = None if err.history is None else err.history.goodput().to_dict()
        result(seconds=time.monotonic() - start, **fields)
        raise
    if save_params and jax.process_index() == 0:
        import numpy as np

        params = runtime_of(step).read_at(step.host_state(state).params, 0)
        flat = jax.tree_util.tree_leaves_with_path(params)
        np.savez(save_params, **{jax.tree_util.keystr(k): v for k, v in flat})
    result(raised=False, seconds=time.monotonic() - start, step=int(state.step.addressable_data(0)))


if __name__ == "__main__":
    child.start(main)
