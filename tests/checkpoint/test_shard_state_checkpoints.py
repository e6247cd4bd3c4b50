"""Checkpoints of a sharded state (make_train_step(shard_state=...)): every leaf saved
whole, restored onto any layout and device count, and a run resumed exactly."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxstep
from tests.models import host_params
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches


def _step(layout, **kw):
    kw = {"shard_min_size": 0, "divergence_every": None, **kw}
    return jaxstep.make_train_step(loss_fn, optax.adam(1e-2), shard_state=layout, **kw)


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(jax.device_get(x), jax.device_get(y))


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)


def test_a_params_checkpoint_restores_into_every_layout_and_a_replicated_one_into_params(
    tmp_path,
):
    batches = make_batches(3)
    step = _step("params")
    jaxstep.fit(
        step, step.init(init_params()), batches, checkpoint_dir=tmp_path / "p", checkpoint_every=2
    )
    clean = jaxstep.fit(step, step.init(init_params()), batches[:2])  # the checkpoint's step
    same = jaxstep.restore(step, tmp_path / "p", at=2)  # a checkpoint of the run's middle
    _equal(same, clean)  # bitwise, laid out as the step lays it out
    for got, want in zip(jax.tree.leaves(same), jax.tree.leaves(clean), strict=True):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    replicated = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), devices=jax.devices()[:4])
    zero1 = _step("optimizer")
    for other in (replicated, zero1):
        restored = jaxstep.restore(other, tmp_path / "p", at=2)
        _close(host_params(other, restored), host_params(step, clean))
        _close(other.host_state(restored).opt_state, step.host_state(clean).opt_state)
    assert restored.opt_state[0].mu["dense1"]["kernel"].sharding.spec == P(None, "devices")
    # a checkpoint of the replicated layout (as written before shard_state existed)
    plain = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), divergence_every=None)
    jaxstep.fit(
        plain, plain.init(init_params()), batches, checkpoint_dir=tmp_path / "r", checkpoint_every=2
    )
    into = jaxstep.restore(step, tmp_path / "r", at=2)
    assert into.params["dense1"]["kernel"].sharding.spec == P(None, "devices")
    _equal(into, jaxstep.fit(plain, plain.init(init_params()), batches[:2]))


@pytest.mark.parametrize("layout", ["optimizer", "params"])
def test_a_resumed_run_ends_bitwise_where_an_uninterrupted_one_does(layout, tmp_path):
    step, batches = _step(layout), make_batches(5)
    kw = {"checkpoint_dir": tmp_path, "checkpoint_every": 2}
    jaxstep.fit(step, step.init(init_params()), batches[:3], **kw)
    resumed = jaxstep.fit(step, step.init(init_params()), batches, resume=True, **kw)
    _equal(resumed, jaxstep.fit(step, step.init(init_params()), batches))


def test_the_writer_never_deletes_the_blocks_of_a_step_newer_than_the_one_it_wrote(tmp_path):
    # several processes: process 1 may write its blocks of step 2 before the writer has
    # finished step 0; clearing after step 0 must leave them (a lost block made step 2
    # unreadable and a restore fall back to step 0)
    from jaxstep._src.checkpoint import _blocks as blocks
    from jaxstep._src.checkpoint._store import as_path

    root = as_path(tmp_path)
    for number in (0, 1, 2):
        blocks.write(root, number, 1, {"0_0": np.zeros(2)})
    blocks.forget_older(root, keep=[0], written=0)
    assert sorted(p.name for p in (tmp_path / "blocks").iterdir()) == ["0", "1", "2"]
    blocks.forget_older(root, keep=[2], written=2)  # orbax let step 0 go
    assert sorted(p.name for p in (tmp_path / "blocks").iterdir()) == ["2"]


@pytest.mark.parametrize(
    ("written", "read"),
    [
        (("params", 2), ("params", 2)),  # the same layout: bitwise
        (("params", 2), ("params", 4)),
        (("params", 2), ("optimizer", 1)),
        (("optimizer", 4), ("params", 2)),
        ((None, 1), ("params", 4)),
        (("params", 2), (None, 1)),
    ],
)
def test_a_checkpoint_of_any_replicas_restores_into_any_other(tmp_path, written, read):
    def make(layout, replicas):
        if layout is None:
            return jaxstep.make_train_step(loss_fn, optax.adam(1e-2), divergence_every=None)
        return _step(layout, replicas=replicas)

    batches = make_batches(3)
    first = make(*written)
    end = jaxstep.fit(first, first.init(init_params()), batches[:2], checkpoint_dir=tmp_path)
    other = make(*read)
    restored = jaxstep.restore(other, tmp_path)
    if written == read:
        _equal(restored, end)
    _equal(other.host_state(restored).params, first.host_state(end).params)  # bitwise
    _equal(other.host_state(restored).opt_state, first.host_state(end).opt_state)
    if read[0] is not None:
        m = 8 // read[1]
        moment = restored.opt_state[0].mu["dense1"]["kernel"]
        assert {s.data.shape for s in moment.addressable_shards} == {(3, 8 // m)}
    # and it trains on: within 1e-6 of the run that wrote it
    want = jaxstep.fit(first, end, batches[2:])
    _close(host_params(other, jaxstep.fit(other, restored, batches[2:])), host_params(first, want))
