"""``fit(prefetch=N)``: a thread pulls the next N batches and places them while the step
runs, and every promise about batches holds: the data position a checkpoint saves is
the next batch to train; ``err.batches`` holds every batch pulled and not trained, in
order, the prefetched ones included; the data source's exception reaches the caller;
a recovery (retry, quarantine, a device left out) trains what it would without the
thread; the time waited for data is in the history and the progress line; the thread
never outlives fit. No timing: where the thread must be ahead, the test waits until it
is (a synchronisation), and asserts only what it pulled."""

import _thread
import io
import itertools
import json
import threading
import time
import traceback
import warnings

import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep._src.loop import FitOptions
from jaxstep.testing import Fault
from tests.models import assert_params_equal
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches
from tests.models import rows_of

NUM = 12


def _step(backend, **kw):
    return jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend, **kw)


def _threads():
    return [t for t in threading.enumerate() if t.name == "jaxstep-prefetch"]


@pytest.fixture(autouse=True)
def _no_thread_outlives_fit():
    yield
    assert _threads() == []  # joined on every way out of fit


class Watched:
    """The batches as a plain iterator that counts how many were pulled, so a test can
    wait until the prefetch thread is ahead (a synchronisation, not a timing)."""

    def __init__(self, batches):
        self._it = iter(batches)
        self.pulled = 0
        self._more = threading.Condition()

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._it)
        with self._more:
            self.pulled += 1
            self._more.notify_all()
        return batch

    def wait_pulled(self, n):
        with self._more:
            assert self._more.wait_for(lambda: self.pulled >= n, timeout=60), self.pulled


class Checkpointable(Watched):
    """A checkpointable iterator (``get_state`` / ``set_state``), as grain's."""

    def __init__(self, batches):
        super().__init__(())
        self.batches, self.index = batches, 0

    def __next__(self):
        if self.index >= len(self.batches):
            raise StopIteration
        batch = self.batches[self.index]
        self.index += 1
        with self._more:
            self.pulled += 1
            self._more.notify_all()
        return batch

    def get_state(self):
        return {"index": self.index}

    def set_state(self, state):
        self.index = state["index"]


class WaitAt:
    """At step ``at``'s end, waits until ``source`` pulled ``n`` batches: the thread is
    then ahead of the loop by the batches it prefetched."""

    def __init__(self, source, at, n):
        self.source, self.at, self.n = source, at, n

    def on_step_end(self, table):
        if table.step == self.at:
            self.source.wait_pulled(self.n)


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError)]
)
def test_prefetch_is_checked_naming_the_value_and_the_fix(value, error):
    with pytest.raises(error, match=rf"prefetch must be an int >= 0.*got {value!r}.*prefetch=0"):
        FitOptions(prefetch=value)
    step = jaxstep.make_train_step(loss_fn, optax.sgd(0.1))
    state = step.init(init_params())
    with pytest.raises(error, match="prefetch must be"):
        jaxstep.fit(step, state, make_batches(2), prefetch=value)
    jaxstep.fit(step, state, make_batches(1))  # refused before anything ran: still usable


def test_a_failure_hands_back_the_prefetched_batches_in_order_and_chaining_trains_each_once(
    backend,
):
    batches = make_batches(NUM)
    batches[5] = dict(batches[5], poison=batches[5]["poison"].copy())
    batches[5]["poison"][rows_of(3)] = 1.0
    step = _step(backend)
    source = Watched(batches)
    history = jaxstep.History()
    # at step 4's end batch 5 is dispatched: the thread pulls 6 and 7 ahead of it
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(
            step,
            step.init(init_params()),
            source,
            history=history,
            callbacks=[WaitAt(source, 4, 8)],
        )
    err = info.value
    assert (err.device_id, err.step) == (jax.devices()[3].id, 5)
    # the failing batch, the one dispatched after it, and the prefetched ones, in order
    pulled = len(err.batches)
    assert pulled == source.pulled - 5 and pulled >= 3
    assert [id(b) for b in err.batches] == [id(b) for b in batches[5 : 5 + pulled]]
    fixed = dict(err.batches[0], poison=np.zeros_like(err.batches[0]["poison"]))
    state = jaxstep.fit(
        step, err.state, itertools.chain([fixed], err.batches[1:], source), history=history
    )
    trained = [
        s for s, status in zip(history.step, history.status, strict=True) if not status.any()
    ]
    assert trained == list(range(NUM))  # each batch once: none lost, none twice
    clean = make_batches(NUM)
    clean[5] = fixed
    assert_params_equal(step, state, jaxstep.fit(step, step.init(init_params()), clean, prefetch=0))


@pytest.mark.parametrize("kind", ["callable", "checkpointable"])
def test_a_checkpoint_taken_while_batches_were_prefetched_resumes_exactly(backend, kind, tmp_path):
    """The checkpoint of step 4 is copied when batch 4 is dispatched, with 5 and 6
    pulled ahead: its data position is batch 4 (the next to train), not 7."""
    dev = jax.devices()[2]
    step = _step(backend, faults=[Fault("grad", dev.id, step=5, mode="transient")])
    batches = make_batches(NUM)
    made = []

    def source():
        if kind == "checkpointable":
            made.append(Checkpointable(batches))
            return made[-1]

        def start_at(start):
            made.append(Watched(batches[start:]))
            return made[-1]

        return start_at

    first = source()
    watched = first if kind == "checkpointable" else None

    class Wait:
        def on_step_end(self, table):  # at step 2's end, batches 4 and 5 are pulled
            if table.step == 2:
                (watched or made[0]).wait_pulled(6)

    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(
            step,
            step.init(init_params()),
            first,
            checkpoint_dir=tmp_path,
            checkpoint_every=2,
            callbacks=[Wait()],
        )
    assert info.value.step == 5  # the transient fault fired: the step is clean from here
    resumed = jaxstep.fit(
        step,
        step.init(init_params()),
        source(),
        checkpoint_dir=tmp_path,
        checkpoint_every=2,
        resume=True,
    )
    assert int(np.asarray(step.host_state(resumed).step)) == NUM
    assert_params_equal(step, resumed, jaxstep.fit(step, step.init(init_params()), batches))


def test_an_interrupt_with_batches_prefetched_hands_them_back_and_resume_is_exact(
    backend, tmp_path
):
    batches = make_batches(NUM)
    step = _step(backend)
    source = Watched(batches)

    class Interrupt:
        def on_step_end(self, table):
            if table.step == 3:  # batch 4 in flight, 5 and 6 pulled ahead
                source.wait_pulled(7)
                _thread.interrupt_main()  # a first Ctrl-C: stops after the step in flight

    with pytest.raises(KeyboardInterrupt) as info:
        jaxstep.fit(
            step, step.init(init_params()), source, checkpoint_dir=tmp_path, callbacks=[Interrupt()]
        )
    err = info.value
    trained = int(np.asarray(step.host_state(err.state).step))
    assert len(err.batches) == source.pulled - trained >= 2
    assert [id(b) for b in err.batches] == [id(b) for b in batches[trained : source.pulled]]
    clean = jaxstep.fit(step, step.init(init_params()), batches, prefetch=0)
    chained = jaxstep.fit(step, err.state, itertools.chain(err.batches, source))
    assert_params_equal(step, chained, clean)
    resumed = jaxstep.fit(  # the save of the stop: its position is the first untrained
        step, step.init(init_params()), batches, checkpoint_dir=tmp_path, resume=True
    )
    assert_params_equal(step, resumed, clean)


def test_an_interrupt_while_the_data_stalls_stops_fit_and_the_late_batch_follows(backend):
    """A first Ctrl-C while the source is stuck in ``next``: fit stops without waiting
    for the data and hands back what was pulled and not trained; the batch the thread
    was still pulling joins ``err.batches`` when ``next`` returns (issue 38)."""
    batches = make_batches(6)
    release = threading.Event()
    step = _step(backend)

    def stalls():
        yield from batches[:3]
        _thread.interrupt_main()
        release.wait(60)  # a network read that does not return
        yield batches[3]

    try:
        with pytest.raises(KeyboardInterrupt) as info:
            jaxstep.fit(step, step.init(init_params()), stalls())
        assert info.value.batches.pending  # the thread is still inside next
    finally:
        release.set()
        for thread in _threads():
            thread.join(30)
    err = info.value
    trained = int(np.asarray(step.host_state(err.state).step))
    assert [id(b) for b in err.batches] == [id(b) for b in batches[trained:4]]
    assert not err.batches.pending


@pytest.mark.parametrize("prefetch", [1, 4])
def test_the_data_sources_exception_reaches_the_caller_after_every_batch_before_it(
    backend, prefetch
):
    batches = make_batches(8)
    step = _step(backend)

    def source():
        yield from batches[:5]
        raise OSError("the data server went away")

    with pytest.raises(OSError, match="went away") as info:
        jaxstep.fit(step, step.init(init_params()), source(), prefetch=prefetch)
    err = info.value
    frames = {frame.name for frame in traceback.extract_tb(err.__traceback__)}
    assert "source" in frames  # its own traceback, from the generator
    assert int(np.asarray(step.host_state(err.state).step)) == 5
    assert err.batches == []
    clean = jaxstep.fit(step, step.init(init_params()), batches)
    assert_params_equal(step, jaxstep.fit(step, err.state, batches[5:]), clean)


def _recover_run(backend, faults, prefetch, tmp_path):
    step = _step(backend, faults=faults)
    history = jaxstep.History()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rows never trained once a device left: said
        state = jaxstep.fit(
            step,
            step.init(init_params()),
            Watched(make_batches(NUM)),
            recover=jaxstep.Recover(),
            history=history,
            checkpoint_dir=tmp_path / str(prefetch),
            prefetch=prefetch,
        )
    return step, state, history


@pytest.mark.parametrize("case", ["retried", "quarantined", "excluded"])
def test_recover_under_prefetch_trains_what_it_trains_without(backend, case, tmp_path):
    dev = jax.devices()[5]
    faults = {
        "retried": [Fault("grad", dev.id, step=3, mode="transient")],
        "quarantined": [Fault("input", dev.id, step=3, mode="data", example=1)],
        "excluded": [Fault("loss", dev.id, step=t, mode="device") for t in range(3, 10)],
    }[case]
    step, state, history = _recover_run(backend, faults, 3, tmp_path)
    base_step, base, expected = _recover_run(backend, faults, 0, tmp_path)
    assert case in [r.action for r in history.recoveries]
    assert [(r.step, r.action, r.device_ids, r.examples, r.batch) for r in history.recoveries] == [
        (r.step, r.action, r.device_ids, r.examples, r.batch) for r in expected.recoveries
    ]
    assert history.step == expected.step and history.left_over == expected.left_over
    assert_params_equal(step, state, base, base_step)


def test_the_time_waited_for_data_is_in_the_history_the_progress_line_and_the_jsonl(
    backend, tmp_path
):
    batches = make_batches(5)
    step = _step(backend)

    def slow():
        for batch in batches:
            time.sleep(0.05)
            yield batch

    shown = io.StringIO()
    history = jaxstep.History()
    jaxstep.fit(
        step,
        step.init(init_params()),
        slow(),
        history=history,
        prefetch=0,  # every batch waited for on the loop's thread
        callbacks=[
            jaxstep.Progress(every=1, live=False, file=shown),
            jaxstep.JsonlWriter(tmp_path / "run.jsonl"),
        ],
    )
    assert len(history.data_wait) == 5
    assert min(history.data_wait) >= 0.05  # at least the source's own sleep
    steps = [line for line in shown.getvalue().splitlines() if line.startswith("step")]
    assert "data " in steps[-1]  # the time waited for data, beside the step's
    lines = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    lines, ended = lines[:-1], lines[-1]  # the run's goodput, when it ended
    assert [line["data_wait"] >= 0.05 for line in lines] == [True] * 5
    assert ended["event"] == "goodput"  # the waits are its "data" badput
    assert ended["badput"]["data"] == pytest.approx(sum(history.data_wait), rel=0.05)
    assert history.as_arrays()["data_wait"].shape == (5,)


def test_float64_batches_placed_ahead_and_a_retried_one_from_the_host_agree(backend):
    """The thread places a float64 batch as float32 (what the devices hold); a batch the
    step places itself (a retry, placed while nothing is placed ahead) is the same."""
    dev = jax.devices()[2]
    batches = [jax.tree.map(lambda x: x.astype(np.float64), b) for b in make_batches(6)]
    step = _step(backend, faults=[Fault("grad", dev.id, step=2, mode="transient")])
    history = jaxstep.History()
    state = jaxstep.fit(
        step, step.init(init_params()), batches, recover=jaxstep.Recover(), history=history
    )
    assert [r.action for r in history.recoveries] == ["retried"]
    assert int(np.asarray(step.host_state(state).step)) == 6
