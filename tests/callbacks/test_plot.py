"""``jaxstep.plot``: the heatmap marks the failing device at the failing step, in the
PNG itself, and nowhere else."""

import jax
import matplotlib
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep.testing import Fault
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

matplotlib.use("Agg")

BAD_STEP, BAD_POSITION = 4, 6


@pytest.fixture(scope="module")
def history():
    bad = jax.devices()[BAD_POSITION].id
    step = jaxstep.make_train_step(
        loss_fn,
        optax.adam(1e-2),
        on_failure="skip",
        divergence_every=None,
        faults=[Fault("grad", device_id=bad, step=BAD_STEP, leaf="['dense1']['bias']")],
    )
    history = jaxstep.History()
    jaxstep.fit(step, step.init(init_params()), make_batches(10), history=history)
    return history


def _rgb(hex_color):
    return np.array([int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)])


def test_marks_are_the_failing_device_and_step(history):
    marks = jaxstep.plot.marks(history)
    assert marks["failures"].tolist() == [[BAD_STEP, jax.devices()[BAD_POSITION].id]]
    assert marks["skipped"].tolist() == [BAD_STEP]
    assert marks["overflows"].shape == (0, 2)


def test_overview_is_a_png_with_the_failure_drawn_where_it_happened(history, tmp_path):
    import matplotlib.pyplot as plt

    path = tmp_path / "run.png"
    fig = jaxstep.plot.overview(history, path, dpi=80)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = plt.imread(path)[..., :3]
    height = image.shape[0]
    heatmap = fig.axes[0]
    red = _rgb(jaxstep.plot.FAILURE_COLOR)

    def pixel(step, row):
        x, y = heatmap.transData.transform((step, row))
        return image[round(height - y), round(x)]

    assert np.abs(pixel(BAD_STEP, BAD_POSITION) - red).max() < 0.05
    for step, row in [(BAD_STEP, 0), (BAD_STEP - 1, BAD_POSITION), (9, 3)]:
        assert np.abs(pixel(step, row) - red).max() > 0.3, (step, row)
    # The heatmap has one cell per device and step; the losses panel one line each.
    assert heatmap.images[0].get_array().shape == (len(jax.devices()), 10)
    assert len(fig.axes[1].lines) >= len(jax.devices()) + 1
    plt.close(fig)


def test_an_empty_history_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"history is empty: pass it to jaxstep\.fit"):
        jaxstep.plot.overview(jaxstep.History())


def test_an_overflow_is_marked_as_an_overflow_not_a_failure():
    history = jaxstep.History(device_ids=[10, 11])
    for t, status in enumerate([(0, 0), (0, int(jaxstep.Status.OVERFLOW)), (4, 0)]):
        history.step.append(t)
        history.loss.append(1.0)
        history.device_loss.append(np.ones(2, np.float32))
        history.device_grad_norm.append(np.ones(2, np.float32))
        history.status.append(np.asarray(status, np.int32))
        history.skipped.append(False)
        history.metrics.append({})
        history.examples_per_sec.append(1.0)
    marks = jaxstep.plot.marks(history)
    assert marks["overflows"].tolist() == [[1, 11]]
    assert marks["failures"].tolist() == [[2, 10]]
    fig = jaxstep.plot.overview(history)
    assert {c.get_gid() for c in fig.axes[0].collections} >= {"failures", "overflows"}
