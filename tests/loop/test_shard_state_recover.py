"""fit(..., recover=...) with a sharded state: a bad row quarantined, a bad device
excluded and the state sharded again by the same rule over the devices left."""

import jax
import optax
import pytest

import jaxstep
from jaxstep.testing import Fault
from tests.models import PER_DEVICE
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches


@pytest.mark.parametrize("layout", ["optimizer", "params"])
def test_recover_quarantines_a_row_and_excludes_a_device_then_trains_on_seven(layout, tmp_path):
    devices = jax.devices()
    row, bad = devices[3], devices[5]
    faults = [Fault("input", row.id, step=1, mode="data", example=1, leaf="['x']")]
    faults += [Fault("loss", bad.id, step=t, mode="device") for t in range(3, 9)]
    step = jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), shard_state=layout, shard_min_size=0, faults=faults
    )
    history = jaxstep.History()
    with pytest.warns(UserWarning, match="no longer divide over 7 devices"):
        state = jaxstep.fit(
            step,
            step.init(init_params()),
            make_batches(6),
            recover=jaxstep.Recover(),
            history=history,
            checkpoint_dir=tmp_path,
        )
    quarantined, excluded = history.recoveries
    assert (quarantined.step, quarantined.verdict, quarantined.action) == (1, "data", "quarantined")
    assert quarantined.examples == (3 * PER_DEVICE + 1,)
    assert jaxstep.read_quarantine(tmp_path) == {1: (3 * PER_DEVICE + 1,)}
    assert (excluded.step, excluded.verdict, excluded.action) == (3, "device", "excluded")
    assert excluded.device_ids == (bad.id,)
    # training went on on the seven others, the state laid out for them
    assert [d.id for d in step.devices] == [d.id for d in devices if d != bad]
    assert int(state.step) > 4 and not any(s.any() for s in history.status[-2:])
    assert state.params["dense1"]["kernel"].sharding.device_set == set(step.devices)
    # and stays sharded on them: dense1's 8 columns padded to 14, 2 a device
    moment = state.opt_state[0].mu["dense1"]["kernel"]
    assert {s.data.shape for s in moment.addressable_shards} == {(3, 2)}
    assert step.host_state(state).opt_state[0].mu["dense1"]["kernel"].shape == (3, 8)
