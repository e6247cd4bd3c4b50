"""Benchmark: what ``fit(checkpoint_dir=..., checkpoint_every=100)`` costs, and how long
``jaxstep.restore`` takes, on the 784-512-512-10 MLP (adam, 64 examples per device).

Two variants of the same step (the replica check runs every 100th step in both) train
blocks of ``--block`` steps, interleaved in rounds (A B A B ...) so machine noise hits
them alike; the ratio is the checkpointing block's time over the plain one's in the
same round (median and interquartile range over rounds). Batches are on the devices
already. A block ends with fit's wait for its last write, which is counted. Then, for
the same state: the time of one write (device to host + orbax, on the writer thread),
the blocking part of an orbax async save called from the training thread (the design
not taken), and the time to restore.

    .venv/bin/python scripts/bench_checkpoint.py --rounds 5 --json bench_checkpoint.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import tempfile
import time
from typing import Any

from jaxstep import testing

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--devices", type=int, default=8, help="fake CPU devices (CPU only)")
parser.add_argument("--backend", default="shard_map", choices=["shard_map", "pmap"])
parser.add_argument("--every", type=int, default=100, help="checkpoint_every")
parser.add_argument("--block", type=int, default=200, help="steps per timed block")
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--per-device", type=int, default=64)
parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
parser.add_argument("--json", default=None, help="write the results here too")
args = parser.parse_args()

if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    testing.set_cpu_devices(args.devices)  # before anything starts a JAX backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxstep  # noqa: E402
from jaxstep._src.checkpoint._layout import local_copy  # noqa: E402
from jaxstep._src.checkpoint._store import Store  # noqa: E402
from jaxstep._src.loop._checkpoints import FitCheckpoints  # noqa: E402
from jaxstep._src.step import runtime_of  # noqa: E402

SIZES = (784, 512, 512, 10)


def mlp_loss(params: Any, batch: Any) -> jax.Array:
    h = batch["x"]
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["kernel"] + layer["bias"])
    logits = h @ params[-1]["kernel"] + params[-1]["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def init(rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    return [
        {
            "kernel": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
            "bias": np.zeros(b, np.float32),
        }
        for a, b in itertools.pairwise(SIZES)
    ]


def quartiles(xs: np.ndarray) -> list[float]:
    return [float(q) for q in np.percentile(xs, [25, 50, 75])]


def main() -> None:
    devices = jax.devices()
    n = len(devices)
    step = jaxstep.make_train_step(mlp_loss, optax.adam(1e-3), backend=args.backend)
    rng = np.random.default_rng(0)
    axis = step.options.axis_name
    split = NamedSharding(Mesh(np.array(devices), (axis,)), P(axis))
    host = [
        {
            "x": rng.normal(size=(args.per_device * n, SIZES[0])).astype(np.float32),
            "y": rng.integers(0, SIZES[-1], args.per_device * n).astype(np.int32),
        }
        for _ in range(4)
    ]
    placed = host if runtime_of(step).stacked else [jax.device_put(b, split) for b in host]
    feed = [placed[i % len(placed)] for i in range(args.block)]
    root = args.dir or tempfile.mkdtemp(prefix="jaxstep-bench-ckpt-")
    where = os.path.join(root, "run")
    states = {"plain": step.init(init(rng)), "checkpoint": step.init(init(rng))}

    def block(name: str) -> float:
        kw: dict[str, Any] = {}
        if name == "checkpoint":
            kw = {"checkpoint_dir": where, "checkpoint_every": args.every}
        t0 = time.perf_counter()
        states[name] = jax.block_until_ready(jaxstep.fit(step, states[name], feed, **kw))
        return time.perf_counter() - t0

    # The training thread's own time in the checkpoint hooks (copy dispatch, hand-off).
    hooks = {"s": 0.0, "saves": 0}

    def timed(fn: Any) -> Any:
        def wrapper(self: Any, *a: Any) -> Any:
            t0 = time.perf_counter()
            before = len(self.saver._futures)
            try:
                return fn(self, *a)
            finally:
                hooks["s"] += time.perf_counter() - t0
                hooks["saves"] += len(self.saver._futures) > before

        return wrapper

    for name in states:  # warm-up: compile both programs, first write
        block(name)
    FitCheckpoints.before = timed(FitCheckpoints.before)
    FitCheckpoints.read = timed(FitCheckpoints.read)
    times: dict[str, list[float]] = {name: [] for name in states}
    for _ in range(args.rounds):
        for name in states:
            times[name].append(block(name))
    # What a fit call costs besides its steps (opening the orbax manager, the writer
    # thread, closing): paid once per call, here once per block; a run pays it once.
    calls: dict[str, list[float]] = {name: [] for name in states}
    for _ in range(5):
        for name in states:
            kw = {"checkpoint_dir": where, "checkpoint_every": args.every}
            t0 = time.perf_counter()
            jaxstep.fit(step, states[name], [], **(kw if name == "checkpoint" else {}))
            calls[name].append(time.perf_counter() - t0)
    per_call = float(np.median(calls["checkpoint"]) - np.median(calls["plain"]))
    t = {k: np.asarray(v) for k, v in times.items()}
    per_step_ms = float(np.median(t["plain"]) / args.block * 1e3)
    saves = args.block // args.every
    out: dict[str, Any] = {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": n,
        "backend": args.backend,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "checkpoint_every": args.every,
        "block_steps": args.block,
        "rounds": args.rounds,
        "ms_per_step_plain": per_step_ms,
        "ratio_checkpoint_over_plain": quartiles(t["checkpoint"] / t["plain"]),
        "ms_per_checkpoint_in_block": float(np.median(t["checkpoint"] - t["plain"]) / saves * 1e3),
        "ms_per_fit_call_extra": per_call * 1e3,
        "ms_training_thread_hooks_per_checkpoint": hooks["s"] / max(hooks["saves"], 1) * 1e3,
        "ratio_without_per_call_cost": quartiles((t["checkpoint"] - per_call) / t["plain"]),
    }

    # One write, as the writer thread does it, and the design not taken.
    state = states["checkpoint"]
    leaves = jax.device_get(local_copy(state, stacked=runtime_of(step).stacked))
    out["state_mb"] = sum(x.nbytes for x in leaves) / 2**20
    scratch = os.path.join(root, "scratch")
    store = Store(scratch, create=True)
    writes = []
    for i in range(5):
        t0 = time.perf_counter()
        leaves = jax.device_get(local_copy(state, stacked=runtime_of(step).stacked))
        store.save(i, {"state": leaves, "meta": {"i": i}})
        writes.append(time.perf_counter() - t0)
    store.close()
    out["ms_write_on_writer_thread"] = float(np.median(writes) * 1e3)
    async_root = os.path.join(root, "orbax-async")
    manager = ocp.CheckpointManager(async_root)
    blocking = []
    for i in range(5):
        t0 = time.perf_counter()
        manager.save(i, args=ocp.args.StandardSave(state))  # device arrays, as most do
        blocking.append(time.perf_counter() - t0)
        manager.wait_until_finished()
    manager.close()
    out["ms_orbax_async_save_blocking"] = float(np.median(blocking) * 1e3)

    restores = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(jaxstep.restore(step, where))
        restores.append(time.perf_counter() - t0)
    out["ms_restore"] = float(np.median(restores) * 1e3)
    out["ms_restore_first"] = float(restores[0] * 1e3)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)

    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
