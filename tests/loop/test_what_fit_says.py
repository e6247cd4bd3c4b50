"""What fit says besides its errors: each warning points at the user's line and says
what happened (once per leaf over a run, against the run's first batch; bytes in a unit
that shows them), its log lines keep one format whatever configured logging, the
launcher drops gloo's connection chatter, and a batch the data thread was still pulling
when a real Ctrl-C stopped fit reaches err.batches."""

import io
import logging
import re
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import jax
import optax

import jaxstep
from jaxstep._src.distributed import launch
from jaxstep.testing import Fault
from tests.models import bucketed_batches
from tests.models import init_params
from tests.models import loss_fn
from tests.models import seq_loss_fn

ROOT = Path(__file__).parents[2]


def test_a_recompile_after_a_device_left_is_told_once_against_the_runs_first_batch(backend):
    """Device 5 leaves at step 0; the batches' sequence axis then grows from 4 to 6
    tokens: one warning, naming the first batch as it was (32 rows, not the 28 the
    smaller step took first), at the line that called fit."""
    devices = jax.devices()
    faults = [Fault("loss", devices[5].id, step=t, mode="device") for t in range(8)]
    step = jaxstep.make_train_step(seq_loss_fn, optax.adam(1e-2), backend=backend, faults=faults)
    data = bucketed_batches([4, 4, 6, 6])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jaxstep.fit(step, step.init(init_params()), data, recover=jaxstep.Recover())
    told = [w for w in caught if "recompile" in str(w.message)]
    assert len(told) == 1, [str(w.message) for w in caught]
    assert "(32, 4, 3) in the first batch" in str(told[0].message)
    assert told[0].filename == __file__  # the user's line, not jaxstep's
    assert all(w.filename == __file__ for w in caught), [(w.filename, w.message) for w in caught]


def test_the_resharding_warning_names_the_bytes_in_a_unit_that_shows_them():
    step = jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), shard_state="optimizer", shard_min_size=0
    )
    state = step.init(init_params())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step.exclude_devices([jax.devices()[7].id], state)
    (told,) = [w for w in caught if "no longer divide" in str(w.message)]
    text = str(told.message)
    assert "0.00 MiB" not in text
    assert re.search(r"takes \d+(\.\d+)? (bytes|KiB) per device", text), text
    assert told.filename == __file__


LOGGING_CHILD = r"""
import logging, sys
import jaxstep
log = logging.getLogger("jaxstep")
assert not log.handlers and log.propagate, (log.handlers, log.propagate)
log.warning("jaxstep says one thing")  # no set-up: logging's last resort, the bare message
logging.basicConfig(format="app| %(name)s %(levelname)s %(message)s", stream=sys.stderr)
log.warning("jaxstep says another")  # the application's set-up decides
log.info("jaxstep says a detail")  # below the level the application chose: not shown
"""


def test_jaxstep_leaves_its_log_lines_to_the_applications_set_up():
    """A library adds no handler and keeps propagation (the logging HOWTO): the
    application's format and level apply to jaxstep's lines; with no set-up at all a
    warning still reaches stderr (a notebook shows it)."""
    done = subprocess.run(
        [sys.executable, "-c", LOGGING_CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    err = done.stderr.splitlines()
    assert "jaxstep says one thing" in err, err
    assert "app| jaxstep WARNING jaxstep says another" in err, err
    assert not any("a detail" in line for line in err), err


def test_caplog_sees_jaxsteps_lines(caplog):
    with caplog.at_level(logging.WARNING):
        logging.getLogger("jaxstep").warning("jaxstep says it to the application")
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("jaxstep", "jaxstep says it to the application")
    ]


def test_the_launcher_drops_gloo_connection_lines_and_relays_the_rest():
    stream = io.BytesIO(
        b"[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of connected peer "
        b"ranks is : 7\nstep 3 loss 0.5\n[Gloo] Rank 1 is connected to 1 peer ranks. "
        b"Expected number of connected peer ranks is : 1\n"
    )
    out = io.StringIO()
    launch._forward(1, stream, out, threading.Lock())
    assert out.getvalue() == "[p1] step 3 loss 0.5\n"


GLOO = "[Gloo] Rank {} is connected to 7 peer ranks. Expected number of connected peer ranks is : 7"


def test_the_launcher_drops_gloo_lines_torn_by_two_threads_and_keeps_every_user_line():
    """Two of gloo's threads writing at once tear its line: pieces of two on one line, a
    tail on the next, down to a bare number. None of it reaches the user; each user
    line does, a number or words of gloo's vocabulary included."""
    lines = [
        "[Gloo] Rank 0 is connected to [Gloo] Rank 1 is connected to 7 peer ranks. "
        "Expected number of connected peer ranks is : 7 peer ranks. Expected number of "
        "connected peer ranks is : ",
        "7",
        GLOO.format(2) + GLOO.format(3),
        "step 3 loss 0.5",
        "7",
        "[Gloo] Rank 4 is connected to 7 peer ranks. Expected number of connected peer",
        " ranks is : 7",
        "Rank 3 is connected",
        "epoch 1 " + GLOO.format(5),
        GLOO.format(6),
    ]
    stream = io.BytesIO("".join(line + "\n" for line in lines).encode())
    out = io.StringIO()
    launch._forward(0, stream, out, threading.Lock())
    assert out.getvalue().splitlines() == [
        "[p0] step 3 loss 0.5",
        "[p0] 7",
        "[p0] Rank 3 is connected",
        "[p0] epoch 1",
    ]
    shown = io.StringIO()  # asked for: every line as written
    launch._forward(
        0,
        io.BytesIO("".join(line + "\n" for line in lines).encode()),
        shown,
        threading.Lock(),
        show_gloo=True,
    )
    assert shown.getvalue().splitlines() == [f"[p0] {line}" for line in lines]


CHILD = r"""
import itertools, sys, time
import jaxstep
jaxstep.testing.set_cpu_devices(8)
import jax, numpy as np, optax
from tests.models import init_params, loss_fn, make_batches

step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2))
batches = make_batches(10)


class SlowAtSix:  # a plain iterator whose seventh next() takes 4 s
    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= len(batches):
            raise StopIteration
        if self.i == 6:
            print("slow", flush=True)
            time.sleep(4.0)
        self.i += 1
        return batches[self.i - 1]


source = SlowAtSix()
try:
    jaxstep.fit(step, step.init(init_params()), source)  # prefetch=2
    print("not interrupted", flush=True)
    sys.exit(1)
except KeyboardInterrupt as err:
    pending = err.batches.pending
    state = jaxstep.fit(step, err.state, itertools.chain(err.batches, source))
    clean = jaxstep.fit(step, step.init(init_params()), batches)
    a, b = (jax.tree.leaves(step.host_state(s).params) for s in (state, clean))
    same = all((np.asarray(x).view(np.uint32) == np.asarray(y).view(np.uint32)).all()
               for x, y in zip(a, b))
    print("result", pending, int(step.host_state(state).step), same, flush=True)
"""


def test_a_real_ctrl_c_while_the_data_is_slow_loses_no_batch():
    """SIGINT while fit's data thread is inside a slow next(): fit leaves at once, the
    batch that next() returns reaches err.batches when it arrives, and the README's
    recipe, fit(step, err.state, chain(err.batches, rest)), trains all 10 batches once,
    ending bit for bit as an uninterrupted run (it trained 9 of 10 before)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("slow"):
            break
    proc.send_signal(signal.SIGINT)
    out, errors = proc.communicate(timeout=240)
    assert proc.returncode == 0, f"{out}\n{errors[-3000:]}"
    (result,) = [line for line in out.splitlines() if line.startswith("result")]
    assert result == "result True 10 True", f"{out}\n{errors[-2000:]}"
