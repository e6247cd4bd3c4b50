"""bench.py's measurements of fit's host loop (issue 29): where each microsecond of
fit's host path goes, per step and phase, against a hand-written loop
(:func:`breakdown`), and how much of a slow data source fit hides behind the step
(:func:`overlap`). Imported by scripts/bench.py, which sets the fake devices first.

The hand loop is what a user writes: ``jax.device_put(batch, NamedSharding(mesh,
P('x')))``, the jitted donated ``shard_map`` step, and the previous step's loss read with
``float()`` once the next is dispatched.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import tempfile
import time
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

import jaxstep
from jaxstep._src.checkpoint._position import Source
from jaxstep._src.loop._recorder import Recorder
from jaxstep._src.step import Runtime
from jaxstep._src.step import runtime_of

# The phases of fit's host path, in the order of a step, and the hand loop's.
PHASES = ("pull", "check", "place", "dispatch", "call", "table read", "history", "callbacks")
HAND_PHASES = ("place", "call", "read")


def hand_loop(fn: Callable, state: Any, split: Any, feed: Any, clock: Any = None) -> Any:
    """The hand loop over ``feed`` (host batches): returns the state. ``clock``: a
    dict of phase -> seconds, added to."""
    params, opt = state
    previous = None
    now = time.perf_counter
    for batch in feed:
        t0 = now()
        placed = jax.device_put(batch, split)
        t1 = now()
        params, opt, loss = fn(params, opt, placed)
        t2 = now()
        if previous is not None:
            float(previous)
        t3 = now()
        previous = loss
        if clock is not None:
            clock["place"] += t1 - t0
            clock["call"] += t2 - t1
            clock["read"] += t3 - t2
    float(previous)
    return jax.block_until_ready((params, opt))


def _timed(name: str, fn: Callable, clock: dict[str, float]) -> Callable:
    now = time.perf_counter

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = now()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[name] += now() - t0

    return timed


@contextlib.contextmanager
def _phases(step: Any, clock: dict[str, float]) -> Iterator[None]:
    """Every phase of fit's host path timed into ``clock`` (wrappers, restored after)."""
    runtime = runtime_of(step)
    variants = runtime.programs.variants
    saved = (Source.__next__, Runtime.dispatch, Runtime.raw_table)
    hooks = (jaxstep.Progress, jaxstep.JsonlWriter)  # the callbacks breakdown attaches
    saved += (Recorder.settled, dict(variants), *(c.on_step_end for c in hooks))
    try:
        Source.__next__ = _timed("pull", Source.__next__, clock)  # type: ignore[method-assign]
        Runtime.dispatch = _timed("step", Runtime.dispatch, clock)  # type: ignore[method-assign]
        Runtime.raw_table = _timed("table read", Runtime.raw_table, clock)  # type: ignore[method-assign]
        Recorder.settled = _timed("history", Recorder.settled, clock)  # type: ignore[method-assign]
        for c in hooks:  # bound by fit when it starts: patched before
            c.on_step_end = _timed("callbacks", c.on_step_end, clock)  # type: ignore[method-assign]
        runtime.inputs.check_batch = _timed("check", runtime.inputs.check_batch, clock)  # type: ignore[method-assign]
        runtime.backend.place_batch = _timed("place", runtime.backend.place_batch, clock)  # type: ignore[method-assign]
        for key, fn in variants.items():
            variants[key] = _timed("call", fn, clock)
        yield
    finally:
        Source.__next__, Runtime.dispatch, Runtime.raw_table = saved[:3]  # type: ignore[method-assign]
        Recorder.settled = saved[3]  # type: ignore[method-assign]
        for c, fn in zip(hooks, saved[5:], strict=True):
            c.on_step_end = fn  # type: ignore[method-assign]
        variants.clear()
        variants.update(saved[4])
        del runtime.inputs.check_batch, runtime.backend.place_batch


def breakdown(setup: Any, steps: int, rounds: int) -> dict[str, Any]:
    """Microseconds per step of each phase of fit's host path (``prefetch=0``, host
    batches, Progress and JsonlWriter attached, so every phase runs on the loop's
    thread), and of the hand loop's; "dispatch" is the step's own host work around the
    compiled call (check, place and call left out), "loop" what is left of fit's time
    (its plumbing); "call" includes the time the runtime blocks the caller (XLA:CPU
    returns once every device launched its part)."""
    step = jaxstep.make_train_step(setup.model.loss_fn, setup.adam)
    state = step.init(setup.params)
    hand_fn = jax.jit(setup.shard_map(), donate_argnums=(0, 1))
    hand = jax.device_put((setup.params, setup.adam.init(setup.params)), setup.rep)
    feed = [setup.host[i % len(setup.host)] for i in range(steps)]
    fit_clock: dict[str, float] = collections.defaultdict(float)
    hand_clock: dict[str, float] = collections.defaultdict(float)
    totals: dict[str, float] = collections.defaultdict(float)
    path = os.path.join(tempfile.mkdtemp(), "bench.jsonl")
    for r in range(rounds + 1):  # the first round compiles and warms up, untimed
        callbacks = [jaxstep.Progress(live=False, file=io.StringIO()), jaxstep.JsonlWriter(path)]
        clock = fit_clock if r else collections.defaultdict(float)
        with _phases(step, clock):
            t0 = time.perf_counter()
            state = jax.block_until_ready(
                jaxstep.fit(step, state, feed, callbacks=callbacks, prefetch=0)
            )
            t1 = time.perf_counter()
        hand = hand_loop(hand_fn, hand, setup.split, feed, hand_clock if r else None)
        t2 = time.perf_counter()
        if r:
            totals["fit"] += t1 - t0
            totals["hand"] += t2 - t1
    n = steps * rounds
    fit = {k: fit_clock[k] / n * 1e6 for k in ("pull", "check", "place", "call")}
    fit["dispatch"] = fit_clock["step"] - sum(fit_clock[k] for k in ("check", "place", "call"))
    fit["dispatch"] /= n / 1e6
    fit |= {k: fit_clock[k] / n * 1e6 for k in ("table read", "history", "callbacks")}
    fit["loop"] = totals["fit"] / n * 1e6 - sum(fit.values())
    fit["total"] = totals["fit"] / n * 1e6
    out = {f"fit {k}": fit[k] for k in (*PHASES, "loop", "total")}
    out |= {f"hand {k}": hand_clock[k] / n * 1e6 for k in HAND_PHASES}
    out["hand loop"] = totals["hand"] / n * 1e6 - sum(hand_clock[k] / n * 1e6 for k in HAND_PHASES)
    out["hand total"] = totals["hand"] / n * 1e6
    return out


def overlap(setup: Any, steps: int, rounds: int, kinds: tuple[str, ...]) -> dict[str, Any]:
    """A data source that takes about one step's time per batch (``sleep``: a
    generator that sleeps; ``grain``: a grain DataLoader whose map sleeps): (the slower
    of the data alone and the steps alone) / each loop's time, per round (1.0: the
    data fully hidden behind the step). The steps alone: fit on batches in memory."""
    step = jaxstep.make_train_step(setup.model.loss_fn, setup.adam)
    box = {"state": step.init(setup.params)}
    hand_fn = jax.jit(setup.shard_map(), donate_argnums=(0, 1))
    box["hand"] = jax.device_put((setup.params, setup.adam.init(setup.params)), setup.rep)
    memory = [setup.host[i % len(setup.host)] for i in range(steps)]

    def fit(batches: Any, **kw: Any) -> float:
        t0 = time.perf_counter()
        history = jaxstep.History()
        box["state"] = jax.block_until_ready(
            jaxstep.fit(step, box["state"], batches, history=history, **kw)
        )
        box.setdefault("waits", []).append(float(np.mean(history.data_wait)))
        return time.perf_counter() - t0

    fit(memory)  # compile
    box["hand"] = hand_loop(hand_fn, box["hand"], setup.split, memory[:2])
    delay = float(np.median([fit(memory) for _ in range(3)])) / steps
    out: dict[str, Any] = {"delay ms": delay * 1e3}
    for kind in kinds:
        source = _sources(setup.host, steps, delay)[kind]
        loops: dict[str, Callable[[], float]] = {
            "data alone": lambda source=source: _drain(source()),
            "steps alone": lambda: fit(memory),
            "hand loop": lambda source=source: _hand(hand_fn, box, setup.split, source()),
            "fit prefetch=0": lambda source=source: fit(source(), prefetch=0),
            "fit prefetch=2": lambda source=source: fit(source(), prefetch=2),
        }
        times = {k: [] for k in loops}  # type: dict[str, list[float]]
        waits = {k: [] for k in loops}  # type: dict[str, list[float]]
        order = np.random.default_rng(0)
        for _ in range(rounds):
            for i in order.permutation(len(loops)):
                name = list(loops)[i]
                box["waits"] = []
                times[name].append(loops[name]())
                waits[name] += box["waits"]
        t = {k: np.asarray(v) for k, v in times.items()}
        ideal = np.maximum(t["data alone"], t["steps alone"])
        res: dict[str, Any] = {
            "data alone ms/batch": float(np.median(t["data alone"]) / steps * 1e3),
            "steps alone ms/step": float(np.median(t["steps alone"]) / steps * 1e3),
        }
        for name in ("hand loop", "fit prefetch=0", "fit prefetch=2"):
            res[f"{name} overlap"] = [
                float(q) for q in np.percentile(ideal / t[name], [25, 50, 75])
            ]
            if waits[name]:
                res[f"{name} data wait ms/step"] = float(np.median(waits[name]) * 1e3)
        out[kind] = res
    return out


def _drain(batches: Any) -> float:
    t0 = time.perf_counter()
    for _ in batches:
        pass
    return time.perf_counter() - t0


def _hand(fn: Callable, box: dict[str, Any], split: Any, batches: Any) -> float:
    t0 = time.perf_counter()
    box["hand"] = hand_loop(fn, box["hand"], split, batches)
    return time.perf_counter() - t0


def _sources(host: list[Any], steps: int, delay: float) -> dict[str, Callable[[], Any]]:
    def sleeping() -> Iterator[Any]:
        for i in range(steps):
            time.sleep(delay)
            yield host[i % len(host)]

    def loader() -> Any:
        import grain

        class Batches:  # records are whole batches (pre-batched shards)
            def __len__(self) -> int:
                return steps

            def __getitem__(self, i: int) -> Any:
                return host[int(i) % len(host)]

        class Slow(grain.transforms.Map):  # reading and decoding, as sleep
            def map(self, batch: Any) -> Any:
                time.sleep(delay)
                return batch

        sampler = grain.samplers.IndexSampler(num_records=steps, shuffle=False, num_epochs=1)
        return iter(grain.DataLoader(data_source=Batches(), sampler=sampler, operations=[Slow()]))

    return {"sleep": sleeping, "grain": loader}
