"""Data-parallel training on every host of a TPU VM slice (or a multi-node GPU job),
checked by jaxstep: the same script runs on every host, each host feeds its own rows.

On a TPU VM slice (``launch.sh`` runs this on every worker)::

    python train.py --steps 2000 --checkpoint-dir gs://BUCKET/run1 --error-dir /tmp/errors

On one machine, as 2 processes x 4 fake CPU devices (collectives through gloo)::

    python scripts/tpu_vm/train.py --local 2x4 --steps 50 --error-dir /tmp/errors

The model is a Flax MLP classifier on a synthetic, learnable task (which of 10 fixed
templates is nearest); replace ``make_model`` and ``global_batch`` with yours. A
failure raises the same ``TrainingWorkerError`` on every host; each host writes its
JSON error report to ``--error-dir`` (or ``$JAXSTEP_ERROR_DIR``), the root cause marked.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

IMAGE, CLASSES = 784, 10


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--per-device", type=int, default=16, help="examples per device and step")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--checkpoint-dir", help="a local path or a bucket (gs://...): orbax")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="start from the newest checkpoint")
    p.add_argument("--error-dir", help="JSON error reports (default $JAXSTEP_ERROR_DIR)")
    p.add_argument("--step-timeout", type=float, default=None, help="seconds; names hung devices")
    p.add_argument(
        "--recover",
        action="store_true",
        help="fit(recover=jaxstep.Recover()): after a hang or a lost peer, exit with code 75 "
        "for launch.sh --restarts (with --resume and --checkpoint-dir)",
    )
    p.add_argument(
        "--shard-state",
        choices=("optimizer", "params"),
        help="shard the state over every device of every host: 'optimizer' (ZeRO-1) or "
        "'params' (FSDP); default: every device holds the whole state",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="with --shard-state: hybrid sharding, the devices in this many groups, the state "
        "sharded inside each and whole in each (on 2 hosts of 4 chips, --replicas 2: a group "
        "a host, every shard's twin on the other host); default 1",
    )
    p.add_argument(
        "--shard-min-size",
        type=int,
        default=None,
        help="with --shard-state: leaves under this many elements stay whole (default: "
        "jaxstep's, 65536; 0 shards every leaf that divides, as a small test model needs)",
    )
    p.add_argument(
        "--model-parallel",
        type=int,
        default=1,
        metavar="M",
        help="tensor parallelism inside each host: model groups of M chips split the dense "
        "layers (Megatron: dense1's columns, dense2's rows) and each takes one chunk of the "
        "batch; a group never spans hosts (default 1)",
    )
    p.add_argument("--fault-step", type=int, default=-1, help="plant a NaN at this step (-1: no)")
    p.add_argument("--fault-device", type=int, default=-1, help="jax.Device.id for --fault-step")
    p.add_argument("--save-params", help="process 0 writes the final parameters here (.npz)")
    p.add_argument(
        "--single-process", action="store_true", help="one host, no jax.distributed (a GPU box)"
    )
    p.add_argument(
        "--local",
        metavar="NxK",
        help="run here as N processes with K fake CPU devices each (python -m jaxstep.launch)",
    )
    return p.parse_args(argv)


def make_model(hidden: int) -> Any:
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(hidden, name="dense1")(x))
            x = nn.relu(nn.Dense(hidden, name="dense2")(x))
            return nn.Dense(CLASSES, name="head")(x)

    return MLP()


def global_batch(step: int, size: int) -> dict[str, np.ndarray]:
    """Batch ``step`` of the run, the same on every host (a real loader reads only the
    host's rows: ``jaxstep.distributed.local_rows``)."""
    templates = np.random.default_rng(1234).normal(size=(CLASSES, IMAGE)).astype(np.float32)
    draw = np.random.default_rng(step)
    label = draw.integers(0, CLASSES, size)
    image = templates[label] + 4 * draw.normal(size=(size, IMAGE)).astype(np.float32)
    return {"image": image.astype(np.float32), "label": label.astype(np.int32)}


def megatron(path: str, shape: tuple[int, ...]) -> int | None:
    """The ``model_rule`` (``--model-parallel``): dense1's columns and bias, dense2's rows
    over a model group (the hidden activation between them stays split); the head whole."""
    return {"['dense1']['kernel']": 1, "['dense1']['bias']": 0, "['dense2']['kernel']": 0}.get(path)


def build(args: argparse.Namespace, devices: list[Any]) -> tuple[Any, Any]:
    """The checked step on ``devices`` and its first state."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxstep
    from jaxstep._src.program import DEFAULT_DIVERGENCE_EVERY

    model = make_model(args.hidden)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    faults = []
    if args.fault_step >= 0:
        faults = [jaxstep.testing.Fault("input", device_id=args.fault_device, step=args.fault_step)]
    # Checkpoints are taken from states whose replicas were compared.
    every = math.gcd(DEFAULT_DIVERGENCE_EVERY, args.checkpoint_every)
    step = jaxstep.make_train_step(
        loss_fn,
        optax.adam(args.lr),
        devices=devices,
        faults=faults,
        divergence_every=every,
        shard_state=getattr(args, "shard_state", None),
        replicas=getattr(args, "replicas", 1),
        model_parallel=getattr(args, "model_parallel", 1),
        model_rule=megatron,
        **(
            {}
            if (least := getattr(args, "shard_min_size", None)) is None
            else {"shard_min_size": least}
        ),
    )
    params = model.init(jax.random.key(0), jnp.zeros((1, IMAGE)))["params"]
    return step, step.init(params)


def batches(args: argparse.Namespace, devices: list[Any], start: int, stop: int):
    """The global batches ``start .. stop-1``, the same on every process (``fit(...,
    global_batches=True)`` keeps each process's rows); ``devices``: the step's
    (``step.devices``: under ``--model-parallel`` each model group's first chip, a
    chunk each)."""
    size = args.per_device * len(devices)
    for i in range(start, stop):
        yield global_batch(i, size)


def train(
    args: argparse.Namespace, devices: list[Any] | None = None, history: Any = None
) -> tuple[Any, Any]:
    """Trains to step ``args.steps`` and returns (step, final state).

    With ``--checkpoint-dir``, ``fit`` writes a verified checkpoint every
    ``--checkpoint-every`` steps (process 0 writes the one replica, every process's data
    position goes with it; with ``--shard-state`` each process writes its own shards)
    and, on a failure, the emergency save, and saves the final state; ``--resume`` goes
    on from the newest verified checkpoint, every process at its own position, and
    ``--steps`` is the run's total (``fit(until_step=...)``): a job restarted by
    ``launch.sh --restarts`` trains what is left and stops at that step.
    """
    import jax

    import jaxstep

    devices = list(jax.devices() if devices is None else devices)
    step, state = build(args, devices)
    start = time.perf_counter()

    class Progress:
        def on_step_end(self, table: jaxstep.HealthTable) -> None:
            if table.step % args.log_every == 0:
                log(
                    f"step {table.step:5d}  loss {table.mean_loss:.4f}  "
                    f"{time.perf_counter() - start:.1f}s"
                )

    state = jaxstep.fit(
        step,
        state,
        # A callable source: batch i for step i, so a resumed run reads the same rows;
        # every process reads the whole batch, so once a device left the run each
        # takes the rows it then trains from its own copy (nothing gathered)
        lambda first: batches(args, list(step.devices), first, args.steps),
        global_batches=True,
        callbacks=[Progress()],
        step_timeout=args.step_timeout,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every if args.checkpoint_dir else None,
        resume=args.resume,
        until_step=args.steps,  # the run's total: a restarted job never trains past it
        recover=jaxstep.Recover() if args.recover else None,
        history=history,
    )
    return step, state


def log(text: str) -> None:
    import jax

    print(f"[process {jax.process_index()}] {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.local:
        from jaxstep import launch

        n, k = (int(x) for x in args.local.lower().split("x"))
        rest = list(sys.argv[1:] if argv is None else argv)
        i = rest.index("--local")
        del rest[i : i + 2]
        return launch.launch(
            [sys.executable, str(Path(__file__).resolve()), *rest],
            num_processes=n,
            devices_per_process=k,
            error_dir=args.error_dir,
            grace=60.0,
        )

    from jaxstep import distributed

    if not args.single_process:
        distributed.initialize()  # TPU VM / SLURM / Open MPI: found by jax.distributed
    if args.error_dir:
        import os

        os.environ[distributed.reports.ENV_ERROR_DIR] = args.error_dir

    @distributed.record
    def run() -> None:
        import jax

        import jaxstep

        log(
            f"{jax.process_count()} processes, {len(jax.devices())} devices "
            f"({len(jax.local_devices())} here), "
            f"{args.per_device * len(jax.devices()) // args.model_parallel} examples per step"
            + (f", model groups of {args.model_parallel}" if args.model_parallel > 1 else "")
        )
        history = jaxstep.History()
        step, state = train(args, history=history)
        log(f"finished {args.steps} steps")
        # where the time went: the same figures on every process (process 0's clock)
        report = history.goodput().to_dict()
        log(f"goodput {report['goodput']:.4f} of {report['wall_s']:.3f} s: {report}")
        if args.save_params:
            # every process: with --shard-state the whole parameters are gathered from
            # every process's shards (a collective)
            params = jax.device_get(step.host_state(state).params)
            if jax.process_index() == 0:
                flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in _flatten(params)}
                np.savez(args.save_params, **flat)

    run()
    return 0


def _flatten(tree: Any) -> list[tuple[Any, Any]]:
    import jax

    return jax.tree_util.tree_leaves_with_path(tree)


if __name__ == "__main__":
    sys.exit(main())
