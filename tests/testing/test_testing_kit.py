"""The testing kit as a user project adopting it found it (issue 20, item 9): ini keys
that are honoured (the command line wins), one backend on request, a ``slow`` marker,
a tiny ready-made step, ``corrupt_replica`` on model-state leaves and under either
spelling of a parameter, and a failing ``fit`` reported at the test's own lines."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from jaxstep.testing import assert_fails
from jaxstep.testing import corrupt_replica
from jaxstep.testing import replicas

pytest_plugins = ["pytester"]

# A user's project: its pyproject.toml sets the kit's ini keys, its tests use them.
PYPROJECT = """
[tool.pytest.ini_options]
jaxstep_devices = 4
jaxstep_backend = "shard_map"
"""

USER_TESTS = """
import jaxstep
import pytest
from jaxstep.testing import Fault


def test_ini(jaxstep_backend, jaxstep_devices):
    print(f"SEEN {jaxstep_backend} {len(jaxstep_devices)}")


@pytest.mark.slow
def test_slow():
    pass


def test_tiny(jaxstep_tiny_step):
    tiny = jaxstep_tiny_step
    history = jaxstep.History()
    jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3), history=history)
    assert history.loss[-1] < history.loss[0]


def test_fails_in_fit(jaxstep_devices):
    tiny = jaxstep.testing.tiny_step(
        faults=[Fault("grad", device_id=jaxstep_devices[1].id, step=1)]
    )
    state = tiny.state()
    jaxstep.fit(tiny.step, state, tiny.batches(3))  # THE USER'S LINE
"""


def _failure_section(text: str, name: str) -> list[str]:
    """The lines pytest prints for one failing test, from its header to the next one."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"_+ {name} _+$", line))
    end = next(
        i for i in range(start + 1, len(lines)) if re.match(r"(_+ \w+ _+|=+ .* =+)$", lines[i])
    )
    return lines[start + 1 : end]


def _user_project(pytester: pytest.Pytester) -> None:
    pytester.makefile(".toml", pyproject=PYPROJECT)
    pytester.makepyfile(test_user=USER_TESTS)


def test_a_user_project_sets_devices_and_one_backend_in_its_ini_and_gets_a_short_failure(
    pytester: pytest.Pytester,
):
    _user_project(pytester)
    # --strict-config: an unknown ini key fails; --strict-markers: so does an unknown mark
    result = pytester.runpytest_subprocess(
        "--strict-config", "--strict-markers", "-m", "not slow", "-s", timeout=240
    )
    text = result.stdout.str()
    result.assert_outcomes(passed=2, failed=1, deselected=1)
    assert "Unknown config option" not in text + result.stderr.str()
    # one backend, 4 devices: the test taking jaxstep_backend ran once
    assert re.findall(r"SEEN \w+ \d+", text) == ["SEEN shard_map 4"]
    assert "backend shard_map only" in text
    # the failure: the test's lines and the message, none of jaxstep's frames
    section = _failure_section(text, "test_fails_in_fit")
    report = "\n".join(section)
    assert "> " in report and "THE USER'S LINE" in report
    assert "training worker on device 1 failed: non-finite gradient" in report
    assert "jaxstep/" not in report.replace("jaxstep/testing", "")
    assert len(section) <= 25, report


def test_the_command_line_wins_over_the_ini_and_fulltrace_shows_jaxsteps_frames(
    pytester: pytest.Pytester,
):
    _user_project(pytester)
    result = pytester.runpytest_subprocess(
        "--jaxstep-devices=2",
        "--jaxstep-backend=pmap",
        "--fulltrace",
        "-s",
        "-k",
        "ini or fails",
        timeout=240,
    )
    result.assert_outcomes(passed=1, failed=1, deselected=2)
    text = result.stdout.str()
    assert re.findall(r"SEEN \w+ \d+", text) == ["SEEN pmap 2"]
    section = _failure_section(text, "test_fails_in_fit")
    assert "jaxstep/_src/loop/" in "\n".join(section)  # the loop's frames, on request
    assert len(section) > 25


def test_a_wrong_backend_in_the_ini_is_a_usage_error(pytester: pytest.Pytester):
    pytester.makefile(".toml", pyproject=PYPROJECT.replace('"shard_map"', '"jit"'))
    pytester.makepyfile(test_user="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess(timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "jaxstep_backend must be one of both, shard_map, pmap, got 'jit'" in (
        result.stderr.str()
    )


def test_the_tiny_step_fixture_trains_on_the_tests_backend(jaxstep_tiny_step, jaxstep_backend):
    tiny = jaxstep_tiny_step
    assert tiny.step.options.backend == jaxstep_backend
    batches = tiny.batches(4)
    assert batches[0]["x"].shape == (2 * len(jax.devices()), 3)
    history = jaxstep.History()
    jaxstep.fit(tiny.step, tiny.state(), batches, history=history)
    assert history.loss[-1] < history.loss[0]


def test_corrupt_replica_reaches_model_state_leaves_and_divergence_names_them(backend):
    def loss(params, batch, model_state):
        # running statistics of the input, as BatchNorm keeps them
        mean = 0.9 * model_state["mean"] + 0.1 * jnp.mean(batch["x"], axis=0)
        pred = batch["x"] @ params["w"] + params["b"]
        return jnp.mean((pred - batch["y"]) ** 2), {"model_state": {"mean": mean}}

    tiny = jaxstep.testing.tiny_step(backend=backend)
    step = jaxstep.make_train_step(
        loss, optax.sgd(0.1), backend=backend, has_aux=True, divergence_every=1
    )
    state = step.init(tiny.params(), model_state={"mean": jnp.zeros(3, jnp.float32)})
    assert "model_state['mean']" in step.names["state"]
    bad = jax.devices()[5]
    corrupted = corrupt_replica(step, state, bad.id, "model_state['mean']")
    copies = [c["mean"] for c in replicas(step, corrupted.model_state)]
    assert [i for i, c in enumerate(copies) if c[0] != 0] == [5]
    err = assert_fails(
        lambda: jaxstep.fit(step, corrupted, tiny.batches(2)),
        device_id=bad.id,
        step=0,
        status=Status.DIVERGED,
        leaf="model_state['mean']",
    )
    assert err.leaf == "model_state['mean']"


def test_a_parameter_is_named_with_or_without_params_in_front(backend):
    tiny = jaxstep.testing.tiny_step(backend=backend, divergence_every=1)
    bad = jax.devices()[3]

    def corrupted(leaf):  # fit donates its state: a fresh one each time
        return corrupt_replica(tiny.step, tiny.state(), bad.id, leaf)

    # as err.leaf and Fault write it, and as step.names["state"] does: the same leaf
    short = replicas(tiny.step, corrupted("['w']").params)
    full = replicas(tiny.step, corrupted("params['w']").params)
    for a, b in zip(short, full, strict=True):
        np.testing.assert_array_equal(a["w"], b["w"])
    assert [i for i, copy in enumerate(short) if copy["w"][0, 0] != 0] == [3]
    with pytest.raises(ValueError, match=r"unknown state leaf \"\['v'\]\"; the leaves are"):
        corrupted("['v']")
    # assert_fails takes either spelling of the leaf the error names
    for leaf in ("params['w']", "['w']"):
        assert_fails(
            lambda: jaxstep.fit(tiny.step, corrupted("['w']"), tiny.batches(2)),
            device_id=bad.id,
            step=0,
            status=Status.DIVERGED,
            leaf=leaf,
        )
    with pytest.raises(AssertionError, match=r"leaf is \"params\['w'\]\", not \"\['b'\]\""):
        assert_fails(
            lambda: jaxstep.fit(tiny.step, corrupted("['w']"), tiny.batches(2)),
            device_id=bad.id,
            step=0,
            leaf="['b']",
        )


def test_the_slow_marker_is_registered(pytestconfig):
    markers = pytestconfig.getini("markers")
    assert any(m.startswith("slow:") for m in markers)
