"""Benchmark: step time of 2 processes x 4 devices against 1 process x 8 devices, on
the same model and global batch, jaxstep against a hand-written step in each.

CPU collectives between processes go through gloo (~3x slower than in one process),
so the ratios that mean something are within one layout (jaxstep / hand-written) and
the cost of the layout itself for each (2x4 / 1x8), not absolute times. Each process
times blocks of steps of both variants interleaved in rounds (A B A B ...), reading
step t-1's output while step t runs, as ``fit`` does; the tables show medians of the
per-round ratios.

    .venv/bin/python scripts/bench_multihost.py                 # both layouts, a table
    .venv/bin/python scripts/bench_multihost.py --json bench_multihost.json
    .venv/bin/python scripts/bench_multihost.py --checkpoint-every 10   # + checkpoint cost

``--checkpoint-every N`` also times ``jaxstep.fit`` with checkpoints every N steps
against ``fit`` without, in each layout (process 0 writes, every process's data
position is published through the coordination service).

``--resplit`` also times ``jaxstep.fit`` after a device of the last process left the
run (``step.without_devices``: the batches, laid out for the 8 devices, are re-split
over the 7 left, the rows that do not divide carried; on 2x4 every process's rows of a
batch are gathered first) against ``fit`` on all 8 devices, the same host batches; and
the same after the exclusion with every process reading the global batches
(``fit(global_batches=True)``: each takes its rows from its own copy, nothing gathered).

    .venv/bin/python scripts/bench_multihost.py --resplit --rounds 6 --block 20
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    """One process of a layout: time both variants, print ``BENCH {json}`` on process 0."""
    from jaxstep import distributed

    if os.environ.get(distributed.ENV_COORDINATOR):
        distributed.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxstep

    sizes = tuple(int(x) for x in args.sizes.split(","))
    rng = np.random.default_rng(0)
    params = [
        {
            "kernel": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
            "bias": np.zeros(b, np.float32),
        }
        for a, b in itertools.pairwise(sizes)
    ]

    def loss_fn(params, batch):
        h = batch["x"]
        for layer in params[:-1]:
            h = jax.nn.relu(h @ layer["kernel"] + layer["bias"])
        logits = h @ params[-1]["kernel"] + params[-1]["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    devices = jax.devices()
    opt = optax.adam(1e-3)
    step = jaxstep.make_train_step(loss_fn, opt, divergence_every=None)
    mesh = Mesh(np.array(devices, dtype=object), ("devices",))
    split = NamedSharding(mesh, P("devices"))

    def hand_body(params, opt_state, batch):
        params_v = jax.lax.pcast(params, "devices", to="varying")
        loss, grads = jax.value_and_grad(loss_fn)(params_v, batch)
        grads, loss = jax.lax.pmean((grads, loss), "devices")
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    hand = jax.jit(
        jax.shard_map(
            hand_body, mesh=mesh, in_specs=(P(), P(), P("devices")), out_specs=(P(), P(), P())
        ),
        donate_argnums=(0, 1),
    )
    n = len(devices)
    draw = np.random.default_rng(1)
    global_batch = {
        "x": draw.normal(size=(args.per_device * n, sizes[0])).astype(np.float32),
        "y": draw.integers(0, sizes[-1], args.per_device * n).astype(np.int32),
    }
    local = distributed.local_batch(global_batch, devices)
    placed = distributed.place_local_batch(local, devices, split)  # both get it placed

    state = step.init(jax.tree.map(jnp.asarray, params))
    replicated = NamedSharding(mesh, P())
    hp = jax.device_put(jax.tree.map(jnp.asarray, params), replicated)
    ho = jax.device_put(opt.init(jax.tree.map(jnp.asarray, params)), replicated)

    def run_jaxstep(steps: int) -> float:
        nonlocal state
        start = time.perf_counter()
        prev = None
        for _ in range(steps):
            state, out = step(state, placed)
            if prev is not None:
                step.table(prev)
            prev = out
        step.table(prev)
        return (time.perf_counter() - start) / steps

    def run_hand(steps: int) -> float:
        nonlocal hp, ho
        start = time.perf_counter()
        prev = None
        for _ in range(steps):
            hp, ho, loss = hand(hp, ho, placed)
            if prev is not None:
                np.asarray(prev.addressable_data(0))
            prev = loss
        np.asarray(prev.addressable_data(0))
        return (time.perf_counter() - start) / steps

    every = args.checkpoint_every
    checked = jaxstep.make_train_step(loss_fn, opt, divergence_every=every) if every else None
    fit_state = checked.init(jax.tree.map(jnp.asarray, params)) if checked else None

    def run_fit(steps: int, checkpoint: bool) -> float:
        nonlocal fit_state
        assert checked is not None
        kwargs: dict[str, Any] = {}
        if checkpoint:
            kwargs = {"checkpoint_dir": args.checkpoint_dir, "checkpoint_every": every}
        start = time.perf_counter()
        fit_state = jaxstep.fit(checked, fit_state, [placed] * steps, **kwargs)
        return (time.perf_counter() - start) / steps

    whole = jaxstep.make_train_step(loss_fn, opt, divergence_every=None)
    whole_state = whole.init(jax.tree.map(jnp.asarray, params))
    left, left_state = whole, whole_state
    if args.resplit:  # a device of the last process leaves: 7 train the 8's batches
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            left, left_state = whole.without_devices([devices[-1].id], whole_state)

    def run_resplit(steps: int, excluded: bool, read_whole: bool = False) -> float:
        nonlocal whole_state, left_state
        start = time.perf_counter()
        if excluded and read_whole:  # every process reads the global batch: no gather
            left_state = jaxstep.fit(left, left_state, [global_batch] * steps, global_batches=True)
        elif excluded:
            left_state = jaxstep.fit(left, left_state, [local] * steps)
        else:
            whole_state = jaxstep.fit(whole, whole_state, [local] * steps)
        return (time.perf_counter() - start) / steps

    run_jaxstep(3)  # compile and warm up
    run_hand(3)
    if every:
        run_fit(every, True)
        run_fit(every, False)
    if args.resplit:
        run_resplit(args.block, True)
        run_resplit(args.block, True, read_whole=True)
        run_resplit(args.block, False)
    times: dict[str, list[float]] = {
        "jaxstep": [],
        "hand": [],
        "fit": [],
        "fit_ckpt": [],
        "fit_all": [],
        "fit_resplit": [],
        "fit_whole": [],
    }
    for _ in range(args.rounds):
        times["jaxstep"].append(run_jaxstep(args.block))
        times["hand"].append(run_hand(args.block))
        if every:
            times["fit_ckpt"].append(run_fit(args.block, True))
            times["fit"].append(run_fit(args.block, False))
        if args.resplit:
            times["fit_resplit"].append(run_resplit(args.block, True))
            times["fit_whole"].append(run_resplit(args.block, True, read_whole=True))
            times["fit_all"].append(run_resplit(args.block, False))
    if jax.process_index() == 0:
        result = {"processes": jax.process_count(), "devices": n}
        pairs = {"": ("jaxstep", "hand"), "ckpt_": ("fit_ckpt", "fit")}
        pairs["resplit_"] = ("fit_resplit", "fit_all")
        pairs["whole_"] = ("fit_whole", "fit_all")
        for name, (a, b) in pairs.items():
            if not times[a]:
                continue
            ratios = [x / y for x, y in zip(times[a], times[b], strict=True)]
            result.update(
                {
                    f"{b}_ms": 1e3 * float(np.median(times[b])),
                    f"{a}_ms": 1e3 * float(np.median(times[a])),
                    f"{name}ratio": float(np.median(ratios)),
                    f"{name}ratio_iqr": [float(q) for q in np.percentile(ratios, [25, 75])],
                }
            )
        print("BENCH " + json.dumps(result), flush=True)


def run_layout(args: argparse.Namespace, processes: int) -> dict[str, Any]:
    me = [str(Path(__file__).resolve()), "--child", *_passthrough(args)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if processes == 1:
        env["JAX_NUM_CPU_DEVICES"] = "8"
        cmd = [sys.executable, *me]
    else:
        per = 8 // processes
        cmd = [sys.executable, "-m", "jaxstep.launch", "-n", str(processes)]
        cmd += ["--devices-per-process", str(per), *me]
    out = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if "BENCH " in line:
            return dict(json.loads(line.split("BENCH ", 1)[1]))
    raise RuntimeError(f"layout {processes}x{8 // processes} gave no result:\n{out.stdout[-3000:]}")


def _passthrough(args: argparse.Namespace) -> list[str]:
    return [
        *("--sizes", args.sizes, "--per-device", str(args.per_device)),
        *("--rounds", str(args.rounds), "--block", str(args.block)),
        *("--checkpoint-every", str(args.checkpoint_every)),
        *("--checkpoint-dir", str(args.checkpoint_dir)),
        *(["--resplit"] if args.resplit else []),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="784,512,512,10", help="MLP layer sizes")
    p.add_argument("--per-device", type=int, default=64)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--block", type=int, default=10, help="steps per variant and round")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also time fit's checkpoints")
    p.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    p.add_argument(
        "--resplit",
        action="store_true",
        help="also time fit after a device left (rows re-split and carried)",
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory() as where:
        args.checkpoint_dir = args.checkpoint_dir or where
        one = run_layout(args, 1)
        shutil.rmtree(where, ignore_errors=True)
        two = run_layout(args, 2)
    print(f"MLP {args.sizes}, {args.per_device} per device, 8 devices in all, CPU")
    print(f"{'layout':>8} {'hand ms':>9} {'jaxstep ms':>11} {'jaxstep/hand':>13} {'IQR':>13}")
    for name, r in (("1x8", one), ("2x4", two)):
        iqr = f"{r['ratio_iqr'][0]:.2f}-{r['ratio_iqr'][1]:.2f}"
        print(f"{name:>8} {r['hand_ms']:9.2f} {r['jaxstep_ms']:11.2f} {r['ratio']:13.2f} {iqr:>13}")
    print(
        f"2x4 / 1x8: hand {two['hand_ms'] / one['hand_ms']:.2f}x, "
        f"jaxstep {two['jaxstep_ms'] / one['jaxstep_ms']:.2f}x (gloo between processes)"
    )
    sections = []
    if args.checkpoint_every:
        title = f"fit with checkpoints every {args.checkpoint_every} steps / fit without:"
        sections.append((title, "ckpt_", "fit", "fit_ckpt"))
    if args.resplit:
        title = "fit after a device left (7 of 8, rows re-split and carried) / fit on all 8:"
        sections.append((title, "resplit_", "fit_all", "fit_resplit"))
        title = "the same, every process reading the global batches (fit(global_batches=True)):"
        sections.append((title, "whole_", "fit_all", "fit_whole"))
    for title, key, base, timed in sections:
        print(title)
        for name, r in (("1x8", one), ("2x4", two)):
            iqr = f"{r[key + 'ratio_iqr'][0]:.2f}-{r[key + 'ratio_iqr'][1]:.2f}"
            print(
                f"{name:>8} {r[base + '_ms']:9.2f} ms {r[timed + '_ms']:9.2f} ms "
                f"{r[key + 'ratio']:6.3f}x (IQR {iqr})"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"1x8": one, "2x4": two, "args": vars(args)}))


if __name__ == "__main__":
    main()
