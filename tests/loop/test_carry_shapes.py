"""A device gone with bucketed lengths (loop._carry.Carry): rows carried wait for a batch
of their own shape, so at the end at most n' - 1 rows of each shape are left, listed
exactly; a stop hands back each shape's rows; a checkpoint taken while two shapes are
carried names the rows trained between theirs, and a resume trains exactly the rest."""

import itertools
import json
import shutil

import chex
import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep.testing import Fault
from tests.models import RaiseAt
from tests.models import bucketed_batches
from tests.models import fit_recording
from tests.models import host_params
from tests.models import init_params
from tests.models import seq_loss_fn

pytestmark = pytest.mark.filterwarnings("ignore:batch leaf .* changed from")  # two lengths

ROWS = 32
SHORT, LONG = 16, 24


def _alternating(num):
    return bucketed_batches([(SHORT, LONG)[b % 2] for b in range(num)], seed=3)


def _steps(batches, first, unit):
    """The rule, row by row: from batch ``first`` on, each batch joins the rows carried
    of its own width and the largest multiple of ``unit`` is a step, the rest carried.
    Returns the steps' batches, in the order they run, and the rows left at the end as
    ``(batch, first row, stop)``, in the data's order."""
    held: dict[int, list[tuple[int, int]]] = {}  # width -> (batch, row) carried, in order
    steps = []
    for b in range(first, len(batches)):
        width = batches[b]["x"].shape[1]
        rows = held.get(width, []) + [(b, r) for r in range(ROWS)]
        keep = len(rows) // unit * unit
        held[width] = rows[keep:]
        if keep:
            steps.append(
                {k: np.stack([batches[i][k][r] for i, r in rows[:keep]]) for k in batches[b]}
            )
    left = sorted(row for rows in held.values() for row in rows)
    spans: list[tuple[int, int, int]] = []
    for b, r in left:
        if spans and spans[-1][0] == b and spans[-1][2] == r:
            spans[-1] = (b, spans[-1][1], r + 1)
        else:
            spans.append((b, r, r + 1))
    return steps, spans


def _faulty(backend, at=2, **kw):
    """A step whose device 5 fails every step from ``at``: excluded at step ``at``."""
    faults = [Fault("loss", 5, step=t, mode="device") for t in range(at, 40)]
    return jaxstep.make_train_step(
        seq_loss_fn, optax.adam(1e-2), backend=backend, faults=faults, **kw
    )


def _on_seven(backend):
    rest = [d for d in jax.devices() if d.id != 5]
    return jaxstep.make_train_step(seq_loss_fn, optax.adam(1e-2), backend=backend, devices=rest)


def _uninterrupted(backend, data):
    step = _faulty(backend)
    state, history, _ = fit_recording(
        step, step.init(init_params()), data, recover=jaxstep.Recover()
    )
    return host_params(step, state), history


def test_every_row_is_trained_but_fewer_than_a_step_of_each_shape_at_the_end(backend):
    """Widths 16 and 24 alternate, 32 rows a batch; device 5 is excluded at step 2. On
    7 devices each width's rows wait for the next batch of that width: 28, 35, 28, 35,
    28 rows of each, and 6 of each are left when the data ends (before: every width
    change listed the rows carried, 20 of each). The same steps, built from the rule,
    trained on the 7 devices from the state after step 1 end where the run did."""
    data = _alternating(12)
    step = _faulty(backend)
    state, history, caught = fit_recording(
        step, step.init(init_params()), data, recover=jaxstep.Recover()
    )
    assert [(r.step, r.action, r.device_ids) for r in history.recoveries] == [(2, "excluded", (5,))]
    steps, left = _steps(data, first=2, unit=7)
    assert [len(s["x"]) for s in steps] == [28, 28, 35, 35, 28, 28, 35, 35, 28, 28]
    assert history.left_over == left == [(10, 26, 32), (11, 26, 32)]
    assert history.step[3:] == list(range(2, 2 + len(steps)))
    assert not any(s.any() for s in history.status[3:])
    (told,) = [w for w in caught if "not trained" in w]
    assert told.startswith("12 row(s) carried") and "6 with ['x'] (16, 3) float32" in told, told
    assert "6 with ['x'] (24, 3) float32" in told, told

    head = jaxstep.make_train_step(seq_loss_fn, optax.adam(1e-2), backend=backend)
    start = jaxstep.fit(head, head.init(init_params()), data[:2])
    seven = _on_seven(backend)
    reference = jaxstep.fit(seven, seven.place_state(head.host_state(start)), steps)
    chex.assert_trees_all_close(
        host_params(step, state), host_params(seven, reference), rtol=1e-6, atol=1e-7
    )


def test_a_stop_while_two_shapes_are_carried_hands_back_each_shapes_rows(backend, tmp_path):
    """Ctrl-C at step 5's end (step 6 dispatched): the 24-token row of batch 5 and the
    16-token rows of batch 6 are carried. err.batches holds them as one batch each, in
    the data's order, then the batches pulled after them; the state saved names batch 5
    from row 31, then batch 6 from row 27 (the rest of batch 5, trained, passed over).
    Going on from either (err.batches, or resume=True on the 7 devices) ends where a run
    that did not stop did."""
    data = _alternating(12)
    whole, _ = _uninterrupted(backend, data)
    step = _faulty(backend)
    with pytest.raises(KeyboardInterrupt) as info:
        jaxstep.fit(
            step,
            step.init(init_params()),
            data,
            recover=jaxstep.Recover(),
            checkpoint_dir=tmp_path,
            callbacks=[RaiseAt(5, KeyboardInterrupt())],
        )
    err = info.value
    assert int(step.host_state(err.state).step) == 7  # steps 0..6 trained
    carried, pulled = err.batches[:2], err.batches[2:]
    assert [b["x"].shape for b in carried] == [(1, LONG, 3), (5, SHORT, 3)]
    np.testing.assert_array_equal(carried[0]["x"], data[5]["x"][31:])
    np.testing.assert_array_equal(carried[1]["x"], data[6]["x"][27:])
    assert all(b is x for b, x in zip(pulled, data[7:], strict=False))  # the prefetch's
    rest = data[7 + len(pulled) :]
    again, history, _ = fit_recording(step, err.state, itertools.chain(err.batches, rest))
    chex.assert_trees_all_close(host_params(step, again), whole, rtol=1e-6, atol=1e-7)
    assert history.left_over == [(5, 26, 32), (6, 26, 32)]  # data 10, 11: after 2 carried

    meta = json.loads((tmp_path / "7" / "meta" / "metadata").read_text())
    saved = meta["data"]
    assert (saved["index"], saved["rows"], saved["then"]) == (5, 31, [[6, 27]]), saved
    assert saved["carried"] and meta["exact_resume"]
    seven = _on_seven(backend)
    resumed, history, _ = fit_recording(
        seven, seven.init(init_params()), data, resume=True, checkpoint_dir=tmp_path
    )
    assert history.left_over == [(10, 26, 32), (11, 26, 32)]
    chex.assert_trees_all_close(host_params(seven, resumed), whole, rtol=1e-6, atol=1e-7)


def test_a_checkpoint_while_two_shapes_are_carried_resumes_exactly(backend, tmp_path):
    """num_steps=8 with a checkpoint every 2 steps. Step 4's checkpoint: the 16-token
    rows 28.. of batch 2 are carried (not trained), batch 3's rows 0..27 were trained,
    its rows 28.. are not: the position is batch 2 row 28, then batch 3 row 28. The
    final one (num_steps cut the run short) names both widths' rows carried. A resume
    from either trains exactly the rows not trained: it ends where the whole run did."""
    data = _alternating(12)
    whole, _ = _uninterrupted(backend, data)
    step = _faulty(backend)
    run = tmp_path / "run"
    kw = {"checkpoint_dir": run, "checkpoint_every": 2, "keep": 5}
    fit_recording(
        step, step.init(init_params()), data, num_steps=8, recover=jaxstep.Recover(), **kw
    )

    def position(n):
        data = json.loads((run / str(n) / "meta" / "metadata").read_text())["data"]
        return data["index"], data["rows"], data["then"]

    assert position(2) == (2, 0, [])  # step 2 again, on 7 devices: nothing carried yet
    assert position(4) == (2, 28, [[3, 28]])
    assert position(6) == (4, 31, [[5, 31]])
    assert position(8) == (6, 27, [[7, 27]])  # the end, cut short
    for latest in (8, 4):
        directory = shutil.copytree(run, tmp_path / f"from_{latest}")
        for newer in [n for n in (6, 8) if n > latest]:
            shutil.rmtree(directory / str(newer))
        seven = _on_seven(backend)
        resumed, history, _ = fit_recording(
            seven, seven.init(init_params()), data, resume=True, checkpoint_dir=directory
        )
        assert int(seven.host_state(resumed).step) == 12
        assert history.left_over == [(10, 26, 32), (11, 26, 32)]
        chex.assert_trees_all_close(host_params(seven, resumed), whole, rtol=1e-6, atol=1e-7)


class _Checkpointable:
    """A checkpointable iterator over a list (``get_state`` / ``set_state``)."""

    def __init__(self, batches):
        self.batches, self.at = batches, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.at >= len(self.batches):
            raise StopIteration
        self.at += 1
        return self.batches[self.at - 1]

    def get_state(self):
        return {"at": self.at}

    def set_state(self, state):
        self.at = state["at"]


def test_a_checkpointable_iterator_resumes_at_rows_carried_many_batches_back(backend, tmp_path):
    """Batch 2's 16-token rows 28.. wait through ten 24-token batches: the iterator's
    state before batch 2 is kept that long (fit keeps those of the last few batches
    only), so the final checkpoint resumes there, the 24-token batches between passed
    over, and the run ends where the whole one did."""
    data = bucketed_batches([SHORT, LONG, SHORT, *[LONG] * 10, SHORT, LONG], seed=3)
    whole_step = _faulty(backend)
    whole, _, _ = fit_recording(
        whole_step, whole_step.init(init_params()), _Checkpointable(data), recover=jaxstep.Recover()
    )
    step = _faulty(backend)
    fit_recording(
        step,
        step.init(init_params()),
        _Checkpointable(data),
        num_steps=12,
        recover=jaxstep.Recover(),
        checkpoint_dir=tmp_path,
    )
    saved = json.loads((tmp_path / "12" / "meta" / "metadata").read_text())["data"]
    # 24-token batches 3..11: 9 x 32 rows, 41 steps of 7, batch 11's last row carried
    assert (saved["index"], saved["rows"], saved["then"]) == (2, 28, [[11, 31]]), saved
    assert saved["iterator_state"] == {"at": 2}
    seven = _on_seven(backend)
    resumed, history, caught = fit_recording(
        seven,
        seven.init(init_params()),
        _Checkpointable(data),
        resume=True,
        checkpoint_dir=tmp_path,
    )
    assert not [w for w in caught if "iterator" in w], caught
    assert history.left_over == _steps(data, first=2, unit=7)[1] == [(13, 31, 32), (14, 30, 32)]
    chex.assert_trees_all_close(
        host_params(seven, resumed), host_params(whole_step, whole), rtol=1e-6, atol=1e-7
    )
