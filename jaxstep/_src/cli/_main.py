"""The ``jaxstep`` command: ``jaxstep demo`` trains a small CNN on real data and meets a
fault if asked (and recovers from it with ``--recover``); ``jaxstep doctor`` checks the
devices.

exit codes:
  0  done: the demo trained to the end (a skipped step or a recovered failure
     included), the doctor found nothing wrong
  1  a device failed: a training worker failed (demo), or a device computed other
     bits than the rest or the all-reduce was wrong (doctor)
  2  usage error: bad arguments, or a missing optional dependency
  75 a hang under --recover: restart the job (jaxstep.RESTART_EXIT_CODE; what
     python -m jaxstep.launch --restarts N restarts)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from jaxstep._src.cli._demo import EXIT_OK
from jaxstep._src.cli._demo import EXIT_USAGE
from jaxstep._src.cli._demo import EXIT_WORKER_FAILED
from jaxstep._src.cli._demo import KINDS
from jaxstep._src.cli._demo import Injection

if TYPE_CHECKING:
    import jax

__all__ = ["EXIT_OK", "EXIT_USAGE", "EXIT_WORKER_FAILED", "main"]


def _device_spec(text: str) -> int | str:
    if text == "real":
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(
        f"{text!r}: give a number of fake CPU devices (e.g. 8) or 'real' for the devices "
        "JAX finds (GPUs, TPUs)"
    )


def _injection(text: str) -> Injection:
    try:
        return Injection.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


DEVICES_HELP = (
    "N fake CPU devices, or 'real' for the devices JAX finds (a bare --devices means real)"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxstep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a CNN on scikit-learn's digits on every device; --inject meets a fault",
        description="Train a small Flax CNN on scikit-learn's bundled digits with jaxstep.",
        epilog="fault kinds for --inject:\n"
        + "\n".join(f"  {k:8} {v}" for k, v in KINDS.items())
        + "\n\nwith --recover (policy raise): nan -> quarantined, inf -> excluded, grad -> "
        "retried,\ncorrupt -> repaired; a stall (a hang) needs a restart, not --recover\n\n"
        + __doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _demo_arguments(demo)
    doctor = sub.add_parser(
        "doctor",
        help="list the devices, compare their results bitwise, time an all-reduce",
        description="Check the devices: the same program on each must give the same bits.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument(
        "--devices",
        type=_device_spec,
        nargs="?",
        const="real",
        default="real",
        help=DEVICES_HELP + " (default real)",
    )
    doctor.add_argument("--size", type=int, default=256, help="the probe's matrix side")
    doctor.add_argument(
        "--corrupt",
        type=int,
        metavar="DEVICE_ID",
        help="flip one bit of this device's result, to see a failing scan",
    )
    return parser


def _demo_arguments(demo: argparse.ArgumentParser) -> None:
    """``jaxstep demo``'s arguments."""
    demo.add_argument(
        "--devices",
        type=_device_spec,
        nargs="?",
        const="real",
        default=8,
        help=DEVICES_HELP + " (default 8)",
    )
    demo.add_argument("--backend", choices=("shard_map", "pmap"), default="shard_map")
    demo.add_argument(
        "--policy",
        choices=("raise", "skip", "drop"),
        default="raise",
        help="on a failure: stop with the error (raise), skip the step (skip), or leave "
        "the failing devices' chunks out of the step's mean and repair a diverged replica "
        "(drop)",
    )
    demo.add_argument(
        "--shard-state",
        choices=("optimizer", "params"),
        help="shard the state over the devices (shard_map only): the optimizer state "
        "(ZeRO-1) or the parameters too (FSDP); every leaf the rule can shard is sharded "
        "(shard_min_size=0: the demo's model is small)",
    )
    demo.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="with --shard-state: the devices form this many groups, the state sharded "
        "inside each and whole in each (hybrid sharding); every shard's twins in the other "
        "groups are compared by the replica check (default 1)",
    )
    demo.add_argument(
        "--model-parallel",
        type=int,
        default=1,
        metavar="M",
        help="tensor parallelism: the devices form model groups of M, each splitting the "
        "dense layers (Megatron: the first's columns, the second's rows) and taking one "
        "chunk of the batch; a failure names the group (default 1)",
    )
    demo.add_argument("--steps", type=int, default=150)
    demo.add_argument("--per-device", type=int, default=16, help="examples per device a step")
    demo.add_argument("--seed", type=int, default=0, help="data split, shuffle and init")
    demo.add_argument(
        "--inject",
        type=_injection,
        metavar="KIND@device=D,step=S",
        help=f"plant one fault; KIND: {', '.join(KINDS)}; D a device id",
    )
    demo.add_argument(
        "--recover",
        action="store_true",
        help="act on a failure's verdict and train on (jaxstep.Recover): a transient "
        "fault is retried, a bad example quarantined, a bad device excluded, a diverged "
        "replica repaired; each recovery is printed",
    )
    demo.add_argument("--plot", metavar="PNG", help="save the gradient-norm heatmap and losses")
    demo.add_argument(
        "--goodput", metavar="PNG", help="save where the run's time went (jaxstep.plot.goodput)"
    )
    demo.add_argument("--jsonl", metavar="PATH", help="write per-step metrics as JSON lines")
    demo.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard event files")
    demo.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="where a failure saves the last good state, the failing batch and a report, "
        "and --recover the quarantined examples (default with --inject: a new temporary "
        "directory)",
    )


def _devices(spec: int | str) -> list[jax.Device]:
    """The devices to run on; fake CPU devices are made before JAX starts a backend
    (in a process where it has started, e.g. a notebook, the first N CPU devices)."""
    if spec == "real":
        import jax

        return jax.devices()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from jaxstep._src import testing

    try:
        testing.set_cpu_devices(int(spec))
    except RuntimeError as err:
        cpus = jax.devices("cpu")
        if len(cpus) < int(spec):
            raise ValueError(str(err)) from None
        return cpus[: int(spec)]
    return jax.devices("cpu")


def main(argv: list[str] | None = None) -> int:
    """Runs ``jaxstep`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:  # argparse has printed the usage error
        return EXIT_USAGE if exit.code else EXIT_OK
    try:
        devices = _devices(args.devices)
    except ValueError as err:
        print(f"jaxstep {args.command}: error: --devices {args.devices}: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "doctor":
            from jaxstep._src.cli import _doctor as doctor

            try:
                report = doctor.run(devices, corrupt=args.corrupt, size=args.size)
            except ValueError as err:
                print(f"jaxstep doctor: error: {err}", file=sys.stderr)
                return EXIT_USAGE
            print(doctor.format_report(report))
            return EXIT_OK if report.ok else EXIT_WORKER_FAILED
        from jaxstep._src.cli import _demo as demo

        problem = demo.check(args, [d.id for d in devices])
        if problem is not None:
            print(f"jaxstep demo: error: {problem}", file=sys.stderr)
            return EXIT_USAGE
        return demo.run(args, devices)
    except ImportError as err:
        print(f"jaxstep {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
