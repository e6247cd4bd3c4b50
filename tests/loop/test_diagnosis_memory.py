"""A diagnosed failure holds no whole copy of the state on one device, and no second
copy of it anywhere: the bytes each device holds while ``fit(diagnose=True)`` replays a
failed step are measured against a normal step's, under every layout.

How it is measured: ``jax.live_arrays()``, each buffer counted once on every device it
lives on (a replicated leaf on each device, a shard on its own), sampled each time a
function of jaxstep's host code returns (``sys.setprofile``): before each replay and
pass, after each (its outputs alive), and at every step of the loop around them. A
sample is "normal" until the loop turns the failed step into its error, "diagnosed"
from then until ``fit`` raises. What the compiled programs hold while they run (XLA's
temporaries: a pass's gathered parameters) is not a live array; docs/sharding.md
gives those figures from ``memory_analysis()``."""

from __future__ import annotations

import collections
import gc
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from jaxstep._src.loop import _driver as driver
from jaxstep.testing import Fault
from jaxstep.testing import assert_fails

WIDTH, LAYERS, PER_DEVICE = 512, 3, 4
LEAF = "['dense1']['kernel']"  # sharded under "params", whole under "optimizer"
BAD = 3  # the position of the device whose chunk carries the bad example
EXAMPLE = 1
HOST_CODE = os.path.dirname(jaxstep.__file__) + os.sep
TRACED = os.path.join(HOST_CODE, "program") + os.sep  # the traced per-device program


def _params() -> dict[str, Any]:
    """An MLP of three 512x512 layers: 3 MiB of parameters, 9 MiB with Adam's moments."""
    rng = np.random.default_rng(0)
    params = {
        f"dense{i}": {
            "kernel": rng.normal(0, 0.05, (WIDTH, WIDTH)).astype(np.float32),
            "bias": np.zeros(WIDTH, np.float32),
        }
        for i in range(LAYERS)
    }
    params["head"] = {
        "kernel": rng.normal(0, 0.05, (WIDTH, 1)).astype(np.float32),
        "bias": np.zeros(1, np.float32),
    }
    return params


def _loss(params: Any, batch: Any) -> jax.Array:
    h = batch["x"]
    for i in range(LAYERS):
        h = jnp.tanh(h @ params[f"dense{i}"]["kernel"] + params[f"dense{i}"]["bias"])
    pred = h @ params["head"]["kernel"] + params["head"]["bias"]
    return jnp.mean((pred - batch["y"]) ** 2)


def _batches(k: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    rows = len(jax.devices()) * PER_DEVICE
    return [
        {
            "x": rng.normal(size=(rows, WIDTH)).astype(np.float32),
            "y": rng.normal(size=(rows, 1)).astype(np.float32),
        }
        for _ in range(k)
    ]


def _bytes_per_device(arrays: Any) -> dict[int, int]:
    """Bytes on each device: every addressable shard of every array, each buffer once
    (a view of a buffer, e.g. ``addressable_data``, is not counted again)."""
    seen: set[tuple[int, int]] = set()
    total: collections.Counter[int] = collections.Counter()
    for x in arrays:
        if x.is_deleted():
            continue
        for shard in x.addressable_shards:
            data = shard.data
            key = (shard.device.id, data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                total[shard.device.id] += data.nbytes
    return total


class Peaks:
    """The most bytes one device held, by phase, sampled at every return from a
    function of jaxstep's host code (not the traced program: a sample there would see
    nothing new). Arrays alive before it started (other tests') are left out."""

    def __init__(self) -> None:
        gc.collect()
        self.before = {id(x): x for x in jax.live_arrays()}  # held: their ids stay theirs
        self.phase: str | None = None
        self.peak: dict[str, int] = collections.defaultdict(int)
        self.sampled: dict[str, set[str]] = collections.defaultdict(set)

    def now(self) -> dict[int, int]:
        return _bytes_per_device(x for x in jax.live_arrays() if id(x) not in self.before)

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "return" or self.phase is None:
            return
        path = frame.f_code.co_filename
        if not path.startswith(HOST_CODE) or path.startswith(TRACED):
            return
        held = max(self.now().values(), default=0)
        self.peak[self.phase] = max(self.peak[self.phase], held)
        self.sampled[self.phase].add(frame.f_code.co_qualname)


@pytest.mark.parametrize("layout", [None, "optimizer", "params"])
def test_a_diagnosed_failure_holds_at_most_twice_a_normal_steps_bytes_on_any_device(
    layout, monkeypatch
):
    dev = jax.devices()[BAD]
    fault = Fault("grad", dev.id, step=2, mode="data", leaf=LEAF, example=EXAMPLE)
    step = jaxstep.make_train_step(
        _loss, optax.adam(1e-3), shard_state=layout, faults=[fault], divergence_every=None
    )
    state = step.init(_params())
    peaks = Peaks()
    turned = driver.failure_error

    def failure_error(*args: Any, **kwargs: Any) -> Any:
        peaks.phase = "diagnosed"  # the halted state as it stands is sampled here first
        return turned(*args, **kwargs)

    monkeypatch.setattr(driver, "failure_error", failure_error)
    peaks.phase = "normal"
    sys.setprofile(peaks)
    try:
        with pytest.raises(jaxstep.TrainingWorkerError) as info:
            jaxstep.fit(step, state, _batches(5), diagnose=True)
    finally:
        sys.setprofile(None)
    del state  # donated to the first step
    err = info.value

    # the verdict is still right: the device, the step, the leaf, the example
    assert_fails(err, device_id=dev.id, step=2, status=Status.GRAD_NONFINITE, leaf=LEAF)
    assert [f.device_id for f in err.failures] == [dev.id]  # no healthy device blamed
    found = err.diagnosis
    assert found.verdict == "data" and found.devices == (dev.id,)
    assert found.examples == (BAD * PER_DEVICE + EXAMPLE,)
    assert found.grad_leaves == (LEAF,)
    assert found.replays == ((0, (dev.id,)), (1, (jax.devices()[BAD - 1].id,)))

    # every part of the diagnosis was sampled, inside it and as it returned
    diagnosed = peaks.sampled["diagnosed"]
    for part in ("Runtime.replay", "Passes.failing_examples", "Passes.nonfinite_grad_leaves"):
        assert part in diagnosed, f"{part} was never sampled"
    assert "Runtime.dispatch" in peaks.sampled["normal"]

    # what one copy of the state is, on the device that holds the most of it
    held = max(_bytes_per_device(jax.tree.leaves(err.state)).values())
    normal, diagnosing = peaks.peak["normal"], peaks.peak["diagnosed"]
    assert held <= normal < 1.2 * held  # a normal step holds its state and batches
    assert held <= diagnosing  # err.state itself was seen while diagnosing
    assert diagnosing <= 2 * normal, (layout, diagnosing, normal)
    # and tighter, as built: the replay runs from err.state itself (neither copied nor
    # donated) and the halted state became err.state, so no second copy is ever held
    assert diagnosing < normal + held / 2, (layout, diagnosing, normal, held)

    # the measure sees a whole copy on one device: step.host_state puts one on the first
    first = jax.devices()[0].id
    own = _bytes_per_device(jax.tree.leaves(err.state))[first]
    whole = step.host_state(err.state)
    with_copy = peaks.now()
    assert with_copy[first] >= own + sum(x.nbytes for x in jax.tree.leaves(whole))
    if layout is not None:  # what the diagnosis held before, with its whole copy
        assert with_copy[first] > 2 * normal
