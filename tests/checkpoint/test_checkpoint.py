"""Lose nothing: verified orbax checkpoints with the data position, exact resume,
err.batches, the emergency save, restore across device counts and backends, bad input."""

import functools
import itertools
import json
import logging
import pickle
import shutil
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from jaxstep._src.checkpoint._emergency import read_emergency
from jaxstep.testing import corrupt_replica
from jaxstep.testing import replicas
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches
from tests.models import rows_of
from tests.sources import callable_source
from tests.sources import grain_loader

EVERY = 2


@functools.cache
def _step(backend, divergence_every=EVERY):
    """One step per backend for the whole module: compiled once (the box is slow)."""
    return jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), backend=backend, divergence_every=divergence_every
    )


def _host(step, state):
    """Every leaf of one replica as numpy (typed keys as their key data)."""
    return [
        np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
        for x in jax.tree.leaves(step.host_state(state))
    ]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)  # bitwise: same dtype, same values


def _poisoned(num, at, position):
    batches = make_batches(num)
    batches[at] = dict(batches[at])
    batches[at]["poison"] = batches[at]["poison"].copy()
    batches[at]["poison"][rows_of(position)] = 1.0
    return batches


@pytest.mark.parametrize("kind", ["sequence", "callable", "grain"])
def test_resume_goes_on_at_the_exact_data_position_bitwise(backend, kind, tmp_path):
    source = {
        "sequence": lambda: make_batches(9),
        "callable": lambda: callable_source(9),
        "grain": lambda: grain_loader(9),
    }[kind]
    step = _step(backend)
    clean = _host(step, jaxstep.fit(step, step.init(init_params()), source()))
    jaxstep.fit(
        step,
        step.init(init_params()),
        source(),
        num_steps=5,
        checkpoint_dir=tmp_path,
        checkpoint_every=EVERY,
    )
    # Every EVERY steps, and the run's end (keep=3: the oldest, 0, went).
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["2", "4", "5"]
    meta = json.loads((tmp_path / "4" / "meta" / "metadata").read_text())
    assert meta["verified"] and meta["step"] == 4 and meta["data"]["index"] == 4
    end = json.loads((tmp_path / "5" / "meta" / "metadata").read_text())
    assert end["verified"] and end["step"] == 5 and end["data"]["index"] == 5
    assert meta["backend"] == backend and meta["devices"] == 8
    assert ".params['dense1']['kernel']" in meta["layout"]["names"]
    resumed = jaxstep.fit(
        step,
        step.init(init_params(seed=5)),  # only its structure counts
        source(),
        checkpoint_dir=tmp_path,
        checkpoint_every=EVERY,
        resume=True,
    )
    _assert_same(_host(step, resumed), clean)


def test_err_batches_resume_trains_every_batch_but_the_failed_one_exactly_once(backend):
    batches = _poisoned(12, at=5, position=3)
    step = _step(backend)
    it = iter(batches)
    history = jaxstep.History()
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(init_params()), it, history=history)
    err = info.value
    assert (err.device_id, err.step, err.status) == (
        jax.devices()[3].id,
        5,
        Status.GRAD_NONFINITE,
    )
    # The failing batch and the one dispatched after it, untrained, in order, then
    # those the prefetch thread pulled ahead (at most 2).
    pulled = len(err.batches)
    assert 2 <= pulled <= 4
    assert [id(b) for b in err.batches] == [id(b) for b in batches[5 : 5 + pulled]]
    assert f"error.batches holds the failing batch and the {pulled - 1} pulled after it" in str(err)
    fixed = dict(err.batches[0], poison=np.zeros_like(err.batches[0]["poison"]))
    state = jaxstep.fit(
        step, err.state, itertools.chain([fixed], err.batches[1:], it), history=history
    )
    trained = [
        s for s, status in zip(history.step, history.status, strict=True) if not status.any()
    ]
    assert trained == list(range(12))  # each step once, none lost, none twice
    clean = make_batches(12)
    clean[5] = fixed
    reference = jaxstep.fit(step, step.init(init_params()), clean)
    _assert_same(_host(step, state), _host(step, reference))


def test_emergency_save_restores_err_state_and_its_batch_reproduces_the_failure(backend, tmp_path):
    batches = _poisoned(6, at=3, position=2)
    step = _step(backend)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(init_params()), batches, checkpoint_dir=tmp_path)
    err = info.value
    device = jax.devices()[2].id
    assert (err.device_id, err.step, err.status, err.leaf) == (
        device,
        3,
        Status.GRAD_NONFINITE,
        "['dense2']['kernel']",
    )
    assert err.checkpoint == str(tmp_path / "emergency" / "step_3")
    assert f"emergency save (state, failing batch, this report): {err.checkpoint}" in str(err)
    restored = jaxstep.restore(step, err.checkpoint)
    _assert_same(_host(step, restored), _host(step, err.state))
    saved = read_emergency(err.checkpoint)
    jax.tree.map(np.testing.assert_array_equal, saved.batch, batches[3])
    report = saved.report
    assert (report["device_id"], report["step"], report["status"], report["leaf"]) == (
        device,
        3,
        "GRAD_NONFINITE",
        "['dense2']['kernel']",
    )
    assert report["process_index"] == 0 and report["host"] and report["reason"]
    assert [f["device_id"] for f in report["failures"]] == [device]
    with pytest.raises(jaxstep.TrainingWorkerError) as again:
        jaxstep.fit(step, restored, [saved.batch])
    assert (again.value.device_id, again.value.step, again.value.leaf) == (
        device,
        3,
        "['dense2']['kernel']",
    )
    copy = pickle.loads(pickle.dumps(err))
    assert copy.checkpoint == err.checkpoint and len(copy.batches) == len(err.batches) >= 2
    np.testing.assert_array_equal(copy.batches[0]["poison"], batches[3]["poison"])


def test_diverged_names_the_verified_checkpoint_and_it_equals_a_clean_run(backend, tmp_path):
    batches = make_batches(8)
    step = _step(backend)
    state = jaxstep.fit(
        step,
        step.init(init_params()),
        batches[:3],
        checkpoint_dir=tmp_path,
        checkpoint_every=EVERY,
    )
    dev = jax.devices()[6]
    state = corrupt_replica(step, state, dev.id, "params['dense1']['kernel']", ulps=1 << 12)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, batches[3:], checkpoint_dir=tmp_path, checkpoint_every=EVERY)
    err = info.value
    assert (err.device_id, err.step, err.status) == (dev.id, 4, Status.DIVERGED)
    # The first fit's end (step 3) was saved before the corruption, and verified.
    assert f"the latest verified checkpoint is step 3 ({tmp_path / '3'})" in str(err)
    # The state the failed check saw is never saved: only verified states are.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["0", "2", "3"]
    restored = jaxstep.restore(step, tmp_path)
    copies = replicas(step, (restored.params, restored.opt_state))
    for copy in copies[1:]:
        jax.tree.map(np.testing.assert_array_equal, copy, copies[0])
    clean = jaxstep.fit(step, step.init(init_params()), batches[:3])
    _assert_same(_host(step, restored), _host(step, clean))


def _spike_step(backend, devices=None):
    def loss(params, batch, rng):
        return loss_fn(params, batch) + 0.0 * jax.random.normal(rng)

    return jaxstep.make_train_step(
        loss,
        optax.adam(1e-2),
        backend=backend,
        devices=devices,
        divergence_every=EVERY,
        loss_spike=jaxstep.LossSpike(window=4, warmup=2, sigmas=1e6),
    )


def test_restore_onto_four_devices_and_the_other_backend(backend, tmp_path):
    there = {"shard_map": "pmap", "pmap": "shard_map"}[backend]
    step = _spike_step(backend)
    batches = make_batches(6)
    init = step.init(init_params(), rng=jax.random.key(3))
    jaxstep.fit(step, init, batches[:2], checkpoint_dir=tmp_path, checkpoint_every=EVERY)
    at_2 = jaxstep.fit(step, step.init(init_params(), rng=jax.random.key(3)), batches[:2])
    four = _spike_step(there, devices=jax.devices()[:4])
    restored = jaxstep.restore(four, tmp_path)  # the run's end, step 2
    host, want = four.host_state(restored), step.host_state(at_2)
    for name in ("step", "params", "opt_state", "halted", "total_skips"):
        jax.tree.map(np.testing.assert_array_equal, getattr(host, name), getattr(want, name))
    np.testing.assert_array_equal(jax.random.key_data(host.rng), jax.random.key_data(want.rng))
    # four of the devices that saved it: their loss windows are kept (a run that lost a
    # device rolls back to a checkpoint from before, fit(recover=...))
    want_spike = want.monitor["spike"]
    np.testing.assert_array_equal(host.monitor["spike"]["losses"], want_spike["losses"][:, :4])
    assert int(host.monitor["spike"]["count"]) == int(want_spike["count"])
    jaxstep.fit(four, restored, batches[2:4], checkpoint_dir=tmp_path / "four", checkpoint_every=1)
    # devices the checkpoint holds no window for: the windows restart, and it says so
    with pytest.warns(UserWarning, match="monitor windows are for another device count"):
        wide = step.host_state(jaxstep.restore(step, tmp_path / "four"))
    assert wide.monitor["spike"]["losses"].shape == (4, 8)
    assert int(wide.monitor["spike"]["count"]) == 0
    # Back on 8 devices under the first backend: everything returns, the windows too.
    back = step.host_state(jaxstep.restore(step, tmp_path))
    jax.tree.map(np.testing.assert_array_equal, back.monitor, want.monitor)


# ------------------------------------------------------------------ bad input
def test_missing_file_and_empty_directories_are_named(tmp_path):
    step = _step("shard_map")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint directory at .*nowhere"):
        jaxstep.restore(step, tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        jaxstep.restore(step, tmp_path / "file")
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        jaxstep.restore(step, tmp_path)


def _three_checkpoints(tmp_path, backend="shard_map"):
    """Checkpoints 0, 2 and the run's end, 4 (at data position 4)."""
    step = _step(backend)
    jaxstep.fit(
        step,
        step.init(init_params()),
        make_batches(4),
        checkpoint_dir=tmp_path,
        checkpoint_every=EVERY,
    )
    return step


def test_a_checkpoint_of_another_model_names_the_leaves_that_differ(tmp_path):
    _three_checkpoints(tmp_path)

    def wider(params, batch):
        h = jnp.tanh(batch["x"] @ params["dense1"]["kernel"])
        return jnp.mean((h @ params["head"] - batch["y"]) ** 2)

    other = jaxstep.make_train_step(wider, optax.adam(1e-2), divergence_every=EVERY)
    params = {"dense1": {"kernel": np.zeros((3, 16), np.float32)}, "head": np.zeros((16, 1))}
    state = other.init(jax.tree.map(jnp.float32, params))
    with pytest.raises(ValueError, match="another model's state") as info:
        jaxstep.fit(other, state, make_batches(2), checkpoint_dir=tmp_path, resume=True)
    text = str(info.value)
    assert ".params['dense1']['kernel'] (saved (3, 8) float32" in text  # wrong shape
    assert ".params['head'] (not in the checkpoint)" in text
    assert ".params['dense2']['bias'] (only in the checkpoint)" in text
    with pytest.raises(ValueError, match=r"params\['head'\] \(not in the checkpoint\)"):
        jaxstep.restore(other, tmp_path)  # the step knows its names from init


def test_a_half_written_checkpoint_is_never_loaded_the_previous_one_is(tmp_path):
    step = _three_checkpoints(tmp_path)
    at_4 = _host(step, jaxstep.restore(step, tmp_path))
    # A write killed half-way: orbax's temporary directory, never renamed.
    shutil.copytree(tmp_path / "4", tmp_path / "6.orbax-checkpoint-tmp-1733000000")
    # A step directory whose arrays were lost (a copy torn by hand).
    shutil.copytree(tmp_path / "4", tmp_path / "8")
    shutil.rmtree(tmp_path / "8" / "state")
    with pytest.warns(UserWarning, match="restoring step 4") as record:
        state = jaxstep.restore(step, tmp_path)
    text = str(record[0].message)
    assert "step 8 (unreadable" in text and "6.orbax-checkpoint-tmp-1733000000" in text
    _assert_same(_host(step, state), at_4)
    with pytest.raises(ValueError, match=r"checkpoint .*8 cannot be read"):
        jaxstep.restore(step, tmp_path, at=8)
    # fit(resume=True) takes the same one and goes on; the torn step 8 is left alone.
    with pytest.warns(UserWarning, match="restoring step 4"):
        resumed = jaxstep.fit(
            step,
            step.init(init_params()),
            make_batches(5),
            checkpoint_dir=tmp_path,
            checkpoint_every=EVERY,
            resume=True,
        )
    clean = jaxstep.fit(step, step.init(init_params()), make_batches(5))
    _assert_same(_host(step, resumed), _host(step, clean))
    # (the resumed run saved its end, 5: keep=3 left 4, 5 and the torn 8)
    with pytest.raises(ValueError, match=r"no checkpoint of step 6 .* steps \[4, 5, 8\]"):
        jaxstep.restore(step, tmp_path, at=6)


def test_a_data_position_past_the_end_is_an_error(tmp_path):
    step = _three_checkpoints(tmp_path)  # the latest checkpoint is at data position 4
    with pytest.raises(ValueError, match="data position 4 is past the end of batches"):
        jaxstep.fit(
            step, step.init(init_params()), make_batches(3), checkpoint_dir=tmp_path, resume=True
        )
    with pytest.raises(ValueError, match="data position 4 is past the end of batches"):
        jaxstep.fit(
            step, step.init(init_params()), callable_source(4), checkpoint_dir=tmp_path, resume=True
        )


def test_arguments_that_cannot_give_verified_checkpoints_are_rejected(tmp_path):
    step = _step("shard_map", 4)
    state = step.init(init_params())
    with pytest.raises(ValueError, match="needs checkpoint_dir"):
        jaxstep.fit(step, state, make_batches(1), checkpoint_every=4)
    with pytest.raises(ValueError, match="resume=True needs checkpoint_dir"):
        jaxstep.fit(step, state, make_batches(1), resume=True)
    with pytest.raises(ValueError, match="keep must be"):
        jaxstep.fit(step, state, make_batches(1), checkpoint_dir=tmp_path, keep=0)


def test_checkpoints_ahead_of_the_state_are_not_mixed_in(tmp_path):
    step = _three_checkpoints(tmp_path)
    with pytest.raises(ValueError, match=r"checkpoints of steps \[2, 4\], ahead of this state"):
        jaxstep.fit(
            step,
            step.init(init_params()),
            make_batches(2),
            checkpoint_dir=tmp_path,
            checkpoint_every=EVERY,
        )


def test_a_plain_iterator_warns_once_that_resume_is_not_exact(tmp_path, monkeypatch):
    from jaxstep._src.checkpoint import _position

    monkeypatch.setattr(_position, "_warned_plain", False)
    step = _step("shard_map")
    with pytest.warns(UserWarning, match="plain iterator") as record:
        state = jaxstep.fit(
            step,
            step.init(init_params()),
            iter(make_batches(3)),
            checkpoint_dir=tmp_path,
            checkpoint_every=EVERY,
        )
        jaxstep.fit(
            step,
            state,
            iter(make_batches(1)),
            checkpoint_dir=tmp_path / "b",
            checkpoint_every=EVERY,
        )
    assert sum("plain iterator" in str(r.message) for r in record) == 1
    meta = json.loads((Path(tmp_path) / "2" / "meta" / "metadata").read_text())
    assert meta["exact_resume"] is False and meta["data"]["kind"] == "iterator"


def test_model_state_and_loss_scale_are_saved_with_the_rest(backend, tmp_path):
    def loss(params, batch, model_state):
        mean = 0.9 * model_state["mean"] + 0.1 * jnp.mean(batch["x"], axis=0)
        return loss_fn(params, batch), {"model_state": {"mean": mean}}

    step = jaxstep.make_train_step(
        loss,
        optax.adam(1e-2),
        backend=backend,
        has_aux=True,
        divergence_every=EVERY,
        loss_scale=jaxstep.DynamicLossScale(scale=2.0**8, growth_interval=1),
    )

    def fresh():
        return step.init(init_params(), model_state={"mean": jnp.zeros(3, jnp.float32)})

    batches = make_batches(4)
    jaxstep.fit(step, fresh(), batches[:2], checkpoint_dir=tmp_path, checkpoint_every=EVERY)
    meta = json.loads((tmp_path / "2" / "meta" / "metadata").read_text())
    assert ".model_state['mean']" in meta["layout"]["names"]
    assert ".loss_scale.scale" in meta["layout"]["names"]
    clean = step.host_state(jaxstep.fit(step, fresh(), batches[:2]))
    host = step.host_state(jaxstep.restore(step, tmp_path))
    assert float(clean.loss_scale.scale) == 2.0**9  # it grew: the saved one is not the first
    jax.tree.map(np.testing.assert_array_equal, host.model_state, clean.model_state)
    jax.tree.map(np.testing.assert_array_equal, host.loss_scale, clean.loss_scale)
    _assert_same(
        [np.asarray(x) for x in jax.tree.leaves(host)],
        [np.asarray(x) for x in jax.tree.leaves(clean)],
    )


def test_a_checkpoint_of_several_processes_resumes_on_one_only_when_positions_agree(tmp_path):
    # What two processes wrote (meta["data_by_process"]), read back by one process.
    step = _three_checkpoints(tmp_path)
    path = tmp_path / "4" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    at_4 = meta["data"]
    meta["data_by_process"] = {"0": at_4, "1": {**at_4, "index": 5}}
    path.write_text(json.dumps(meta))
    again = step.init(init_params())
    with pytest.raises(ValueError, match=r"written by 2 processes, each at its own data"):
        jaxstep.fit(step, again, make_batches(9), checkpoint_dir=tmp_path, resume=True)
    assert int(jax.device_get(again.step)) == 0  # refused before anything ran
    # Positions that agree (a callable source's always do: the step): it resumes.
    meta["data_by_process"] = {"0": at_4, "1": at_4}
    path.write_text(json.dumps(meta))
    state = jaxstep.fit(step, again, make_batches(6), checkpoint_dir=tmp_path, resume=True)
    assert int(jax.device_get(step.host_state(state).step)) == 6


def test_a_save_a_resume_and_a_restore_log_no_warning_of_orbax(tmp_path, caplog):
    # orbax's all_steps(read=True) logged "`read` option is deprecated. Use `reload`"
    # (through absl) at every save and restore: a user's log shows only what matters.
    step = _step("shard_map")
    caplog.set_level(logging.DEBUG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = jaxstep.fit(
            step,
            step.init(init_params()),
            make_batches(3),
            checkpoint_dir=tmp_path,
            checkpoint_every=EVERY,
        )
        state = jaxstep.fit(
            step,
            state,
            make_batches(5),
            checkpoint_dir=tmp_path,
            checkpoint_every=EVERY,
            resume=True,
        )
        restored = jaxstep.restore(step, tmp_path)
    assert int(jax.device_get(step.host_state(state).step)) == 5
    assert int(jax.device_get(step.host_state(restored).step)) == 5  # the end, saved
    loud = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    assert loud == []
    assert [str(w.message) for w in caught] == []
    assert not any("deprecated" in r.getMessage() for r in caplog.records)
