"""``jaxstep demo``: a short data-parallel run on fake CPU devices that meets a fault
on one device and says which one, where and why."""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time


def _demo(args: argparse.Namespace) -> int:
    from jaxstep import testing

    testing.set_cpu_devices(args.devices)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxstep

    rng = np.random.default_rng(0)
    sizes = (784, 256, 256, 10)
    params = {
        f"dense{i + 1}": {
            "kernel": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
            "bias": np.zeros(b, np.float32),
        }
        for i, (a, b) in enumerate(itertools.pairwise(sizes))
    }

    def loss_fn(params, batch):
        h = batch["image"]
        for name in ("dense1", "dense2"):
            h = jax.nn.relu(h @ params[name]["kernel"] + params[name]["bias"])
        logits = h @ params["dense3"]["kernel"] + params["dense3"]["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    # A synthetic, learnable task: the label is which of 10 fixed templates is nearest.
    templates = rng.normal(size=(10, 784)).astype(np.float32)
    batch_size = args.per_device * args.devices

    def batches(start: int = 0, drop: tuple[int, ...] = ()):
        """The batches from step ``start``; examples in ``drop`` (of the faulty step)
        are replaced by their neighbours, as a data pipeline fix would."""
        for i in range(start, args.steps):
            draw = np.random.default_rng(i)  # batch i is the same whenever it is made
            label = draw.integers(0, 10, batch_size)
            noise = 8 * draw.normal(size=(batch_size, 784)).astype(np.float32)
            image = templates[label] + noise
            if i == args.fault_step:
                chunk = args.fault_position * args.per_device
                image[chunk + 1, 17] = np.nan  # one bad pixel on one device's chunk
                for row in drop:
                    image[row], label[row] = image[row - 1], label[row - 1]
            yield {"image": image, "label": label.astype(np.int32)}

    devices = jax.devices()
    print(
        f"jaxstep demo: {len(devices)} {devices[0].platform} devices, backend "
        f"{args.backend}, {batch_size} examples per step ({args.per_device} per device)"
    )
    if 0 <= args.fault_step < args.steps:
        print(
            f"a NaN pixel is planted at step {args.fault_step} in the chunk of device "
            f"{devices[args.fault_position].id}"
        )
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-3), backend=args.backend)
    state = step.init(jax.tree.map(jnp.asarray, params))

    class Progress:
        def __init__(self) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, table: jaxstep.HealthTable) -> None:
            if table.step % args.log_every == 0:
                spread = float(np.max(table.loss) - np.min(table.loss))
                print(
                    f"  step {table.step:4d}  loss {table.mean_loss:.4f}  per-device "
                    f"spread {spread:.3f}  {time.perf_counter() - self.start:.1f}s"
                )

    try:
        state = jaxstep.fit(step, state, batches(), callbacks=[Progress()], diagnose=True)
    except jaxstep.TrainingWorkerError as err:
        print("\njaxstep.TrainingWorkerError:", err, sep="\n")
        good = int(np.asarray(step.host_state(err.state).step))
        print(f"\nerr.device_id={err.device_id} err.step={err.step} err.status={err.status!r}")
        print(f"err.leaf={err.leaf!r}; err.state holds the last good state (step {good})")
        if err.diagnosis is None or err.diagnosis.verdict != "data":
            return 1
        drop = err.diagnosis.examples
        print(f"\nreplacing example(s) {list(drop)} of step {err.step} and resuming from err.state")
        state = jaxstep.fit(step, err.state, batches(good, drop), callbacks=[Progress()])
    print(f"finished {int(np.asarray(step.host_state(state).step))} steps")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxstep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train on fake CPU devices and meet a fault")
    demo.add_argument("--devices", type=int, default=8)
    demo.add_argument("--backend", choices=("shard_map", "pmap"), default="shard_map")
    demo.add_argument("--steps", type=int, default=200)
    demo.add_argument("--per-device", type=int, default=32)
    demo.add_argument("--fault-step", type=int, default=150, help="-1: no fault")
    demo.add_argument("--fault-position", type=int, default=5)
    demo.add_argument("--log-every", type=int, default=25)
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.per_device < 2:
            parser.error("--per-device must be >= 2 (the planted NaN is on row 1 of a chunk)")
        if not 0 <= args.fault_position < args.devices:
            parser.error(f"--fault-position {args.fault_position} is not in 0..{args.devices - 1}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        return _demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
