"""One process of the multi-process recovery test, started by ``python -m jaxstep.launch``.

    python -m jaxstep.launch -n 2 --devices-per-process 4 tests/recover_child.py DIR

Every process builds the same global batches and passes its own rows. It runs, one
after the other, a clean ``fit`` and three with ``recover=jaxstep.Recover()`` and a
fault on process 1's second device (id 2049 on this JAX) at step 2: ``transient``,
``data`` (example 1 of its chunk; checkpoints in ``DIR/data``) and ``device`` (it
fails every step; checkpoints every 2 steps in ``DIR/device``: excluded, every row of
the later batches re-split over the 7 devices left), each with the reference it must
match, and ``resplit``: ``device`` with a bad example at step 4 in a chunk of process 1
that holds rows process 0 passed. Then three that go back: ``spike`` (that device's
chunk spikes at step 6, ``Recover(rollback_batches=2)``, checkpoints every 4 steps in
``DIR/spike``), ``diverged`` (its replica corrupted by one ulp before step 3,
``divergence_every=1``: repaired) and ``rollback`` (its replica of a model-state count
moved inside the fit call, at step 4: rolled back to the checkpoint of step 4, every 2
steps in ``DIR/rollback``). Then ``presplit``: the ``data`` run with pre-split batches
(``fit(presplit=True)``) that carry each example's id (``Recover(example_id="id")``,
checkpoints in ``DIR/presplit``). Then ``buckets``: ``device`` on bucketed lengths.
``global``: ``device`` on global batches
(``fit(global_batches=True)``: every process reads each batch whole). Then ``stop``:
``device`` stopped by a callback at step 3 (each process's rows not trained), ``global
stop`` the same on global batches, and ``resume``: ``device`` cut short after 4
batches (``DIR/cut``), resumed at its position inside batch 3 on all 8 devices with
pre-split batches, and ``until``: ``device`` stopped after 5 batches with
``until_step=10`` (``DIR/until``), resumed on all 8 devices to step 10 exactly, then
once more (nothing trained). Each run prints one line ``RESULT {json}`` with what
this process saw; last, ``keys``: the keys left in the coordination service's store.
"""

import sys
import threading
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback

import jaxstep
from jaxstep import distributed
from jaxstep._src.core import processes
from jaxstep._src.step import runtime_of
from jaxstep.testing import Fault
from jaxstep.testing import corrupt_replica
from tests import child
from tests.child import result
from tests.models import PER_DEVICE
from tests.models import bucketed_batches
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches
from tests.models import rows_of
from tests.models import seq_loss_fn

STEPS = 6
AT = 2
SPIKE_STEPS, SPIKE_AT, SPIKE_EVERY = 8, 6, 4  # back to 4, batches 5 and 6 skipped
CORRUPT_AT = 3
MOVED_AT, ROLLBACK_EVERY = 4, 2
UNTIL = 10  # the run's total of the until_step run
RESPLIT_AT = (
    4  # a bad example after the exclusion  # seen at step 5, back to the checkpoint of step 4
)


class Moves:
    """A loss with a model state, ``{"count": steps}``, whose copy on
    ``devices[position]`` moves by one at step ``at``, once: a replica corrupted inside a
    fit call (the step's update keeps the replicas equal; this comes from outside it)."""

    def __init__(self, position, at):
        self.position, self.at, self.fired = position, at, False
        self._lock = threading.Lock()  # the devices call it from their own threads

    def loss(self, params, batch, *, model_state):
        count = model_state["count"]
        shape = jax.ShapeDtypeStruct((), jnp.int32)
        moved = io_callback(self._hit, shape, jax.lax.axis_index("devices"), count)
        return loss_fn(params, batch), {"model_state": {"count": count + 1 + moved}}

    def _hit(self, position, count):
        with self._lock:
            hit = not self.fired and int(position) == self.position and int(count) == self.at
            self.fired |= hit
        return np.int32(hit)


class Stopped(Exception):
    pass


class Stop:
    """A callback that stops fit at the end of step 3."""

    def on_step_end(self, table):
        if table.step == 3:
            raise Stopped


def resplit(batches, n):
    """The global batches a run that lost devices trains, ``n`` devices left: each batch
    joins the rows carried of its own shape, in order, and the largest multiple of
    ``n`` of them is a step (empty: none), the rest carried into the next."""
    held, out = {}, []
    for b in batches:
        shape = b["x"].shape[1:]
        rows = {
            k: np.concatenate([held[shape][k], v]) if shape in held else v for k, v in b.items()
        }
        keep = len(rows["x"]) // n * n
        held[shape] = {k: v[keep:] for k, v in rows.items()}
        out.append({k: v[:keep] for k, v in rows.items()})
    return out


def params_of(step, state):
    """The parameters as lists of floats (float32 values survive JSON exactly)."""
    here = distributed.local_positions(step.devices)[0]  # a copy this process holds
    params = runtime_of(step).read_at(state.params, here)
    return {jax.tree_util.keystr(k): np.asarray(v).ravel().tolist() for k, v in _flat(params)}


def replicas_agree(step, state):
    """Whether the copies of the parameters this process holds are equal, bit for bit."""
    here = distributed.local_positions(step.devices)
    first, *others = [jax.tree.leaves(runtime_of(step).read_at(state.params, i)) for i in here]
    return all(all(map(np.array_equal, first, leaves)) for leaves in others)


def _flat(tree):
    return jax.tree_util.tree_leaves_with_path(tree)


def records(history):
    return [r.to_json() for r in history.recoveries]


def run(faults, batches, **kwargs):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), faults=faults)
    return train(step, step.init(init_params()), batches, **kwargs)


def train(step, state, batches, **kwargs):
    """``fit``, with its history and the warnings it gave."""
    history = jaxstep.History()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = jaxstep.fit(step, state, batches, history=history, **kwargs)
    return step, state, history, [str(w.message) for w in caught]


def seen(name, step, state, history, caught, **more):
    result(
        run=name,
        params=params_of(step, state),
        step=int(runtime_of(step).read_first(state.step)),
        devices=[d.id for d in step.devices],
        history_step=list(history.step),
        recoveries=records(history),
        dropped=[list(d) for d in history.dropped],
        left_over=[list(t) for t in history.left_over],
        warnings=caught,
        **more,
    )


@distributed.record
def main(base: str) -> None:
    devices = jax.devices()
    target = child.target(devices)
    full = make_batches(STEPS)
    mine = child.local_batches(full, devices)
    recover = jaxstep.Recover()

    seen("clean", *run([], mine))

    fault = Fault("input", target.id, step=AT, mode="transient")
    seen("transient", *run([fault], mine, recover=recover), target=target.id)

    fault = Fault("input", target.id, step=AT, mode="data", example=1)
    out = run([fault], mine, recover=recover, checkpoint_dir=f"{base}/data")
    quarantine = jaxstep.read_quarantine(f"{base}/data")
    # the reference: the failing step with the failing chunk left out of its mean
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), faults=[fault], on_failure="drop")
    reference = jaxstep.fit(step, step.init(init_params()), mine)
    seen(
        "data",
        *out,
        quarantine={str(k): list(v) for k, v in quarantine.items()},
        reference=params_of(step, reference),
    )

    faults = [Fault("loss", target.id, step=t, mode="device") for t in range(AT, STEPS + 1)]
    out = run(faults, mine, recover=recover, checkpoint_dir=f"{base}/device", checkpoint_every=2)
    # the reference: two steps on 8 devices, then the rest on the 7 others: every row of
    # the later batches, in order, each step the largest multiple of 7 of the rows at
    # hand (the rest carried), split over the 7 (every process's rows together)
    head = jaxstep.make_train_step(loss_fn, optax.adam(1e-2))
    start = jaxstep.fit(head, head.init(init_params()), mine[:AT])
    rest = [d for d in devices if d != target]
    tail = child.local_batches(resplit(full[AT:], len(rest)), rest)
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), devices=rest)
    copy = runtime_of(head).read_at(start, distributed.local_positions(devices)[0])
    reference = jaxstep.fit(step, step.place_state(copy), tail)
    seen("device", *out, target=target.id, reference=params_of(step, reference))

    # The same run on global batches (fit(global_batches=True)): every process reads
    # each batch whole and keeps its rows; after the exclusion each takes the rows it
    # trains from the batch it read (nothing gathered): the same steps, bit for bit
    out = run(
        faults,
        full,
        recover=recover,
        checkpoint_dir=f"{base}/global",
        checkpoint_every=2,
        global_batches=True,
    )
    seen("global", *out, target=target.id)

    # Then a bad example on a device of process 1 at step 4, after the exclusion: its
    # chunk holds rows process 0 passed (the rows re-split); quarantined by its row
    bad = Fault("input", rest[4].id, step=RESPLIT_AT, mode="data", example=0)
    out = run([*faults, bad], mine, recover=recover, checkpoint_dir=f"{base}/resplit")
    quarantine = jaxstep.read_quarantine(f"{base}/resplit")
    seen(
        "resplit",
        *out,
        target=target.id,
        bad=bad.device_id,
        quarantine={str(k): list(v) for k, v in quarantine.items()},
    )

    # A loss spike in the target's chunk alone (only process 1 holds its rows)
    spiky = make_batches(SPIKE_STEPS)
    y = spiky[SPIKE_AT]["y"].copy()
    y[rows_of(devices.index(target))] *= 1e3
    spiky[SPIKE_AT] = dict(spiky[SPIKE_AT], y=y)
    spike = jaxstep.LossSpike(window=8, warmup=3, sigmas=50.0)
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), loss_spike=spike)
    out = train(
        step,
        step.init(init_params()),
        child.local_batches(spiky, devices),
        recover=jaxstep.Recover(rollback_batches=2),
        checkpoint_dir=f"{base}/spike",
        checkpoint_every=SPIKE_EVERY,
    )
    # the reference: the same step on the batches the rollback did not skip
    kept = [b for i, b in enumerate(spiky) if i not in (SPIKE_AT - 1, SPIKE_AT)]
    reference = jaxstep.fit(step, step.init(init_params()), child.local_batches(kept, devices))
    loss = [float(x) for x in out[2].loss]
    seen("spike", *out, target=target.id, loss=loss, reference=params_of(step, reference))

    # A replica of process 1 silently corrupted: every process rebuilds the state from a
    # copy it holds that agrees with the majority (process 1: its first device)
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), divergence_every=1)
    state = jaxstep.fit(step, step.init(init_params()), mine[:CORRUPT_AT])
    state = corrupt_replica(step, state, target.id, "params['dense2']['kernel']", ulps=1)
    out = train(step, state, mine[CORRUPT_AT:], recover=recover)
    seen("diverged", *out, target=target.id, replicas_agree=replicas_agree(step, out[1]))

    # The same device's replica moved inside one fit call, with checkpoints: rolled back
    # (the reference: the same loss, its replica never moved)
    ms = {"count": jnp.zeros((), jnp.int32)}
    moves = Moves(devices.index(target), MOVED_AT)
    options = dict(has_aux=True, divergence_every=1)
    step = jaxstep.make_train_step(moves.loss, optax.adam(1e-2), **options)
    out = train(
        step,
        step.init(init_params(), model_state=ms),
        mine,
        recover=jaxstep.Recover(rollback_batches=1),
        checkpoint_dir=f"{base}/rollback",
        checkpoint_every=ROLLBACK_EVERY,
    )
    never = Moves(-1, MOVED_AT)
    clean = jaxstep.make_train_step(never.loss, optax.adam(1e-2), **options)
    reference = jaxstep.fit(clean, clean.init(init_params(), model_state=ms), mine)
    seen(
        "rollback",
        *out,
        target=target.id,
        moved=moves.fired,
        replicas_agree=replicas_agree(step, out[1]),
        reference=params_of(clean, reference),
    )

    # The data run again, pre-split (4, PER_DEVICE, ...) on each process, each example
    # carrying its id: process 1 holds the bad one's, process 0 learns it
    with_ids = [dict(b, id=np.arange(len(b["x"])) + 1000 * i) for i, b in enumerate(full)]
    presplit = [
        {k: v.reshape(4, PER_DEVICE, *v.shape[1:]) for k, v in b.items()}
        for b in child.local_batches(with_ids, devices)
    ]
    fault = Fault("input", target.id, step=AT, mode="data", example=1)
    out = run(
        [fault],
        presplit,
        recover=jaxstep.Recover(example_id="id"),
        checkpoint_dir=f"{base}/presplit",
        presplit=True,
    )
    lines = jaxstep.read_quarantine(f"{base}/presplit").lines
    seen("presplit", *out, quarantine=[{k: v for k, v in x.items() if k != "time"} for x in lines])

    # The device run on bucketed lengths (widths 16 and 24 alternating, 12 batches):
    # each width's rows wait for the next batch of that width
    buckets = bucketed_batches([16, 24] * 6)
    bucket_faults = [Fault("loss", target.id, step=t, mode="device") for t in range(AT, 20)]
    step = jaxstep.make_train_step(seq_loss_fn, optax.adam(1e-2), faults=bucket_faults)
    out = train(
        step, step.init(init_params()), child.local_batches(buckets, devices), recover=recover
    )
    head = jaxstep.make_train_step(seq_loss_fn, optax.adam(1e-2))
    start = jaxstep.fit(head, head.init(init_params()), child.local_batches(buckets[:AT], devices))
    on_rest = jaxstep.make_train_step(seq_loss_fn, optax.adam(1e-2), devices=rest)
    copy = runtime_of(head).read_at(start, distributed.local_positions(devices)[0])
    tail = [b for b in resplit(buckets[AT:], len(rest)) if len(b["x"])]
    reference = jaxstep.fit(on_rest, on_rest.place_state(copy), child.local_batches(tail, rest))
    seen(
        "buckets",
        *out,
        sizes=[len(b["x"]) for b in tail],
        reference=params_of(on_rest, reference),
    )

    # The device run stopped by a callback at step 3, after the exclusion: each process
    # is handed back the rows it passed that were not trained
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), faults=faults)
    try:
        jaxstep.fit(step, step.init(init_params()), mine, recover=recover, callbacks=[Stop()])
    except Stopped as err:
        trained = int(runtime_of(step).read_first(err.state.step))
        handed = [float(x) for b in err.batches for x in np.asarray(b["x"])[:, 0]]
        result(run="stop", trained=trained, handed=handed)

    # ... and on global batches: each process is handed back every row not trained (a
    # new step: the one before is on the 7 devices left, as fit leaves it)
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), faults=faults)
    try:
        jaxstep.fit(
            step,
            step.init(init_params()),
            full,
            recover=recover,
            callbacks=[Stop()],
            global_batches=True,
        )
    except Stopped as err:
        trained = int(runtime_of(step).read_first(err.state.step))
        handed = [float(x) for b in err.batches for x in np.asarray(b["x"])[:, 0]]
        result(run="global stop", trained=trained, handed=handed)

    # The device run cut short after 4 batches (a row of batch 3 carried: the saved
    # position is inside it), then resumed from it on all 8 devices with pre-split
    # batches: the rows are re-split as the run left them
    out = run(faults, mine, recover=recover, checkpoint_dir=f"{base}/cut", num_steps=4)
    cut_step, cut_state = out[0], out[1]
    split = [
        {k: v.reshape(4, PER_DEVICE, *v.shape[1:]) for k, v in b.items()}
        for b in child.local_batches(full, devices)
    ]
    eight = jaxstep.make_train_step(loss_fn, optax.adam(1e-2))
    out = train(
        eight,
        eight.init(init_params()),
        split,
        checkpoint_dir=f"{base}/cut",
        resume=True,
        presplit=True,
    )
    # the reference: the state the cut run ended with, trained on 8 devices on its rows
    # not trained (batch 3's last, then batches 4 and 5), re-split
    copy = runtime_of(cut_step).read_at(cut_state, distributed.local_positions(rest)[0])
    later = [{k: v[31:] for k, v in full[3].items()}, *full[4:]]
    tail = child.local_batches([b for b in resplit(later, 8) if len(b["x"])], devices)
    reference = jaxstep.fit(eight, eight.place_state(copy), tail)
    seen("resume", *out, reference=params_of(eight, reference))

    # until_step across a restart (issue 45, item 1): the device run stopped after 5
    # batches (num_steps) while rows were carried, its checkpoint inside a batch; the
    # restarted job, on all 8 devices, reaches the run's total exactly, and one more
    # restart trains nothing
    many = child.local_batches(make_batches(UNTIL * 2), devices)
    command = {"checkpoint_dir": f"{base}/until", "checkpoint_every": 2, "until_step": UNTIL}
    faults = [Fault("loss", target.id, step=t, mode="device") for t in range(AT, 4 * UNTIL)]
    run(faults, many, recover=recover, num_steps=5, **command)
    out = train(eight, eight.init(init_params()), many, resume=True, **command)
    seen("until", *out)
    out = train(eight, eight.init(init_params()), many, resume=True, **command)
    seen("until again", *out)

    # Every key a run set in the coordination service's store is gone once read
    store = processes.client()
    store.wait_at_barrier("recover_child/end", 60_000)  # every process done with its runs
    result(run="keys", keys=sorted(k for k, _ in store.key_value_dir_get("jaxstep/")))


if __name__ == "__main__":
    child.start(main)
