"""fit and its data source: it pulls only the batches it trains, so an iterator it
shares with its caller loses none."""

import itertools

import numpy as np
import optax

import jaxstep
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches


def test_num_steps_does_not_swallow_a_batch_of_a_shared_iterator():
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2))
    pulled = []
    source = (pulled.append(i) or b for i, b in enumerate(make_batches(6)))
    state = jaxstep.fit(step, step.init(init_params()), source, num_steps=2)
    state = jaxstep.fit(step, state, source, num_steps=2)
    assert pulled == [0, 1, 2, 3]
    assert int(np.asarray(state.step)) == 4
    assert list(itertools.islice(source, 1))  # batch 4 is still there
