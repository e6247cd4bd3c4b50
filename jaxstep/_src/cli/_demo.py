"""``jaxstep demo``: a small Flax CNN learns scikit-learn's bundled digits on every
device with jaxstep; ``--inject`` plants one fault on one device at one step and the
run says which device, where and why; ``--recover`` acts on it and trains on. Built on
the layers' faces (jaxstep._src.step, .loop, .callbacks, ...) and the testing kit, never on
their private modules."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import re
import tempfile
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from typing import TYPE_CHECKING
from typing import Any
from typing import cast

from jaxstep._src.cli._report import report

if TYPE_CHECKING:
    import flax.linen as nn
    import jax
    import numpy as np

    from jaxstep._src.core import FaultKind
    from jaxstep._src.core import FaultMode
    from jaxstep._src.core import TrainingWorkerError
    from jaxstep._src.core import TrainState
    from jaxstep._src.loop import History
    from jaxstep._src.program import Fault
    from jaxstep._src.step import TrainStep

#: Exit codes of ``jaxstep`` (documented in ``jaxstep --help``).
EXIT_OK = 0
EXIT_WORKER_FAILED = 1  # a training worker failed (demo), or a device disagreed (doctor)
EXIT_USAGE = 2  # bad arguments, or a missing optional dependency

#: --inject KIND -> (what is injected, the fault's mode, what it shows)
KINDS = {
    "nan": "a NaN in one example of the device's input chunk (a bad record: follows the data)",
    "inf": "an Inf loss on the device, every time it runs that step (a bad chip)",
    "grad": "a NaN in one gradient leaf on the device, once (a transient fault)",
    "stall": "the device stalls before the all-reduce (a hang, named by the step timeout)",
    "corrupt": "one ulp of one weight on the device's replica (silent data corruption)",
}
#: --inject KIND -> what ``--recover`` does about it
RECOVERED = {
    "nan": "the example is quarantined, the step trained on the other chunks",
    "inf": "the device is excluded, the run goes on on the others",
    "grad": "the step is retried with the same batch",
    "stall": "a hang is not recovered inside the process (the stuck collective holds "
    "every device): it exits with code 75 for `python -m jaxstep.launch --restarts N` "
    "to restart the job from the last verified checkpoint",
    "corrupt": "the replica is repaired from the majority, the step run again",
}
GRAD_LEAF = "['Dense_0']['kernel']"
DIVERGENCE_EVERY = 10
STEP_TIMEOUT = 5.0


@dataclasses.dataclass(frozen=True)
class Injection:
    """A parsed ``--inject KIND@device=D,step=S``."""

    kind: str
    device_id: int
    step: int

    @classmethod
    def parse(cls, text: str) -> Injection:
        """Raises ValueError naming what is wrong and the expected form."""
        form = "expected KIND@device=D,step=S, e.g. nan@device=3,step=5"
        m = re.fullmatch(r"(\w+)@(.*)", text.strip())
        if not m:
            raise ValueError(f"--inject {text!r}: {form}")
        kind, rest = m.group(1).lower(), m.group(2)
        if kind not in KINDS:
            raise ValueError(
                f"--inject {text!r}: unknown kind {kind!r}; expected one of {list(KINDS)}"
            )
        fields: dict[str, int] = {}
        for part in rest.split(","):
            key, eq, value = part.partition("=")
            key = key.strip()
            if not eq or key not in ("device", "step") or not value.strip().isdigit():
                raise ValueError(f"--inject {text!r}: cannot read {part!r}; {form}")
            fields[key] = int(value)
        if set(fields) != {"device", "step"}:
            raise ValueError(f"--inject {text!r}: give both device and step; {form}")
        return cls(kind, fields["device"], fields["step"])


def _model() -> nn.Module:
    import flax.linen as nn

    class CNN(nn.Module):
        """Two convolutions and two dense layers for 8x8 digits."""

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.relu(nn.Conv(16, (3, 3))(x))
            x = nn.relu(nn.Conv(32, (3, 3), strides=(2, 2))(x))  # 4x4x32
            x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
            return nn.Dense(10)(x)

    return CNN()


def check(args: argparse.Namespace, device_ids: list[int]) -> str | None:
    """What is wrong with the arguments for these devices, or None."""
    if args.steps < 1:
        return f"--steps must be >= 1, got {args.steps}"
    if args.per_device < 2:
        return (
            f"--per-device must be >= 2 (an injected NaN sits in example 1), got {args.per_device}"
        )
    layout = getattr(args, "shard_state", None)
    replicas = getattr(args, "replicas", 1)
    if layout is not None and args.backend != "shard_map":
        return f"--shard-state {layout} needs --backend shard_map (pmap cannot shard a leaf)"
    if replicas != 1 and layout is None:
        return f"--replicas {replicas} needs --shard-state (groups hold a sharded state)"
    if replicas < 1 or len(device_ids) % replicas:
        return (
            f"--replicas {replicas} does not divide the {len(device_ids)} devices into groups "
            "of equal size"
        )
    m = getattr(args, "model_parallel", 1)
    if m < 1 or len(device_ids) % m:
        return (
            f"--model-parallel {m} does not divide the {len(device_ids)} devices into model "
            "groups of equal size"
        )
    if m > 1 and args.backend != "shard_map":
        return f"--model-parallel {m} needs --backend shard_map (pmap maps one device a chunk)"
    if m > 1 and (len(device_ids) // m) % replicas:
        return (
            f"--replicas {replicas} does not divide the {len(device_ids) // m} model groups of "
            f"--model-parallel {m} into replica groups of equal size"
        )
    inj = args.inject
    if inj is None:
        return None
    if inj.kind == "stall" and replicas > 1:
        return (
            f"--inject stall with --replicas {replicas}: a stall is a host callback inside "
            "the step, which a step with replica groups cannot hold (its program spans two "
            "meshes); inject it with --replicas 1"
        )
    if inj.kind == "corrupt" and layout is not None and replicas == 1:
        return (
            f"--inject corrupt with --shard-state {layout}: a sharded leaf has one owner and "
            "no replica to corrupt, and under 'optimizer' the parameters are gathered again "
            "from their owners at every step; run corrupt without --shard-state, or with "
            "--replicas 3 (every shard has twins to compare)"
        )
    if inj.device_id not in device_ids:
        return f"--inject: device {inj.device_id} is not one of the devices {device_ids}"
    if not 0 <= inj.step < args.steps:
        return f"--inject: step {inj.step} is not in 0..{args.steps - 1} (--steps {args.steps})"
    if inj.kind == "corrupt":
        found = math.ceil(inj.step / DIVERGENCE_EVERY) * DIVERGENCE_EVERY
        if found >= args.steps:
            return (
                f"--inject corrupt at step {inj.step}: the replicas are compared every "
                f"{DIVERGENCE_EVERY} steps, next at step {found}; use --steps {found + 1} or more"
            )
    return None


def run(args: argparse.Namespace, devices: list[jax.Device]) -> int:
    """The demo on ``devices``; returns an exit code. Builds the step with the injected
    fault, trains (:func:`_train`), then prints the per-device summary, the test
    accuracy and the plot (:func:`~jaxstep._src.cli._report.report`)."""
    import jax
    import optax

    from jaxstep._src import data
    from jaxstep._src.loop import History
    from jaxstep._src.step import make_train_step

    inj = args.inject
    train, test = data.digits(seed=args.seed)
    model = _model()
    m = getattr(args, "model_parallel", 1)
    batch_size = args.per_device * (len(devices) // m)  # a chunk a model group
    step = make_train_step(
        _loss(model),
        optax.adam(3e-3),
        backend=args.backend,
        devices=devices,
        has_aux=True,
        on_failure=args.policy,
        # Replica fingerprints cost a second program to compile: on for "corrupt" only.
        divergence_every=DIVERGENCE_EVERY if inj is not None and inj.kind == "corrupt" else None,
        faults=_faults(inj),
        shard_state=getattr(args, "shard_state", None),
        shard_min_size=0,
        replicas=getattr(args, "replicas", 1),
        model_parallel=m,
        model_rule=megatron if m > 1 else None,
    )
    units = list(step.devices)  # the history's columns: a model group a column
    # One compiled init, not one small compile per parameter.
    params = jax.jit(model.init)(jax.random.key(args.seed), train.image[:1])["params"]
    state = step.init(params)

    print(
        f"jaxstep demo: a CNN learns scikit-learn's digits ({len(train)} train / {len(test)} "
        f"test images) on {len(devices)} {devices[0].platform} devices, backend "
        f"{args.backend}, policy {args.policy!r}, {batch_size} examples a step "
        f"({args.per_device} per {'model group' if m > 1 else 'device'}), {args.steps} steps"
    )
    if step.options.shard_state is not None:
        print(_bytes_held(step, state))
    if m > 1:
        groups = ", ".join(f"({', '.join(str(d.id) for d in g)})" for g in step.options.groups)
        print(
            f"model_parallel={m}: model groups {groups}, each splitting the dense layers "
            f"(Megatron) and taking one chunk; {_bytes_held(step, state, 'model')}"
        )
    if inj is not None:
        print(f"injected at step {inj.step} on device {inj.device_id}: {KINDS[inj.kind]}")
        if _recovers(args):
            print(f"--recover: {_recovery_plan(inj.kind, args.policy)}")

    history = History()
    options = _fit_options(args, history)

    def batches(start: int) -> Iterator[dict[str, np.ndarray]]:
        # fit asks from state.step: a second fit's batch numbers count from batch 0 too
        return data.batches(train, batch_size, seed=args.seed, start=start)

    state, error = _train(args, step, state, batches, options)
    report(args, units, model, step, state, test, history, error, options)
    return EXIT_OK if error is None else EXIT_WORKER_FAILED


def megatron(path: str, shape: tuple[int, ...]) -> int | None:
    """The demo's ``model_rule``: the first dense layer's columns (and bias) and the
    second's rows split over a model group (Megatron's MLP); the convolutions whole."""
    return {"['Dense_0']['kernel']": 1, "['Dense_0']['bias']": 0, "['Dense_1']['kernel']": 0}.get(
        path
    )


def _bytes_held(step: TrainStep, state: TrainState, what: str = "shard") -> str:
    """How much of the state each device holds under ``shard_state`` (``what``:
    "model": under ``model_parallel``, said briefly)."""
    import jax

    first = step.devices[0]
    leaves = jax.tree.leaves(state)
    held = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == first)
    whole = sum(x.nbytes for x in leaves)
    if what == "model":
        return f"each device holds {held / 1024:.0f} KiB of the state's {whole / 1024:.0f} KiB"
    k = step.options.replicas
    groups = f", in {k} groups of {len(step.devices) // k} (replicas={k})" if k > 1 else ""
    return (
        f"shard_state={step.options.shard_state!r}{groups}: each device holds "
        f"{held / 1024:.0f} KiB of the state's {whole / 1024:.0f} KiB"
    )


def _loss(
    model: nn.Module,
) -> Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]:
    """The demo's loss function: cross-entropy, with the accuracy as aux."""
    import optax

    def loss_fn(params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        # apply returns (output, state) only when given mutable=
        logits = cast("jax.Array", model.apply({"params": params}, batch["image"]))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        accuracy = (logits.argmax(-1) == batch["label"]).mean()
        return loss, {"accuracy": accuracy}

    return loss_fn


def _faults(inj: Injection | None) -> list[Fault]:
    """The fault to build into the step for ``--inject`` (none for ``corrupt``: the demo
    corrupts a replica between two fits)."""
    from jaxstep._src.program import Fault

    if inj is None or inj.kind == "corrupt":
        return []
    spec: dict[str, tuple[FaultKind, FaultMode, dict[str, Any]]] = {
        "nan": ("input", "data", {"example": 1}),
        "inf": ("loss", "device", {"value": math.inf}),
        "grad": ("grad", "transient", {"leaf": GRAD_LEAF}),
        "stall": ("stall", "device", {"seconds": STEP_TIMEOUT + 2}),
    }
    kind, mode, extra = spec[inj.kind]
    return [Fault(kind, device_id=inj.device_id, step=inj.step, mode=mode, **extra)]


def _recovers(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "recover", False))


def _recovery_plan(kind: str, policy: str) -> str:
    """What ``--recover`` will do about an injected ``kind`` under ``--policy``: a
    policy other than raise handles most faults inside the step, before recover."""
    if policy == "raise" or kind in ("stall", "corrupt"):
        if kind == "corrupt" and policy == "drop":
            return "the replica is repaired inside the step (--policy drop), a recovery"
        return RECOVERED[kind]
    inside = "skips the step" if policy == "skip" else "leaves the device's chunk out"
    return f"--policy {policy} {inside} inside the step: nothing halts, nothing to recover"


def _fit_options(args: argparse.Namespace, history: History) -> dict[str, Any]:
    """``fit``'s keywords: the history, the callbacks asked for, the diagnosis, and for
    an injection the step timeout (a stall) or a checkpoint directory for the emergency
    save and the quarantine file (the others); with ``--recover`` a :class:`Recover`."""
    from jaxstep._src.callbacks import JsonlWriter
    from jaxstep._src.callbacks import Progress
    from jaxstep._src.callbacks import TensorBoardWriter
    from jaxstep._src.loop import Recover

    inj = args.inject
    callbacks: list[Progress | JsonlWriter | TensorBoardWriter] = [Progress(args.steps)]
    if args.jsonl:
        callbacks.append(JsonlWriter(args.jsonl))
    if args.tensorboard:
        callbacks.append(TensorBoardWriter(args.tensorboard))
    options: dict[str, Any] = {"history": history, "callbacks": callbacks, "diagnose": True}
    if inj is not None and inj.kind == "stall":
        options["step_timeout"] = STEP_TIMEOUT
    checkpoint_dir = getattr(args, "checkpoint_dir", None)
    if checkpoint_dir is None and inj is not None and inj.kind != "stall":
        checkpoint_dir = tempfile.mkdtemp(prefix="jaxstep-demo-")
    if checkpoint_dir is not None:  # the emergency save on a failure goes there
        options["checkpoint_dir"] = checkpoint_dir
    if _recovers(args):
        # The demo's faults are a transient, a bad record, a bad chip and a diverged
        # replica: each is recovered in place (no loss-spike check, so no rollback).
        options["recover"] = Recover()
    return options


def _train(
    args: argparse.Namespace,
    step: TrainStep,
    state: TrainState,
    batches: Callable[[int], Iterator[dict[str, np.ndarray]]],
    options: dict[str, Any],
) -> tuple[TrainState, TrainingWorkerError | None]:
    """``fit`` to ``args.steps`` steps (for ``corrupt``: to the injection's step, then
    one ulp on one replica, then on); a failure is printed and returned with the state
    it left (its last good one, when it has one)."""
    from jaxstep._src.core import TrainingWorkerError
    from jaxstep._src.loop import fit
    from jaxstep._src.testing import corrupt_replica

    inj = args.inject
    # The hang watchdog logs every Python stack: right for a job's log, noise here.
    logger = logging.getLogger("jaxstep")
    level = logger.level
    logger.setLevel(logging.ERROR)
    error = None
    with warnings.catch_warnings():
        # The rows a device's exclusion left untrained at the end: said in _recovered.
        warnings.filterwarnings("ignore", ".*carried after a device left the run")
        try:
            if inj is not None and inj.kind == "corrupt":
                state = fit(step, state, batches, num_steps=inj.step, **options)
                leaf = f"params{GRAD_LEAF}"
                state = corrupt_replica(step, state, inj.device_id, leaf, ulps=1)
                print(f"step {inj.step}: device {inj.device_id}'s copy of {leaf} moved by one ulp")
            done = int(step.host_state(state).step)
            state = fit(step, state, batches, num_steps=args.steps - done, **options)
        except TrainingWorkerError as err:
            error = err
            _print_failure(err)
            if err.state is not None:
                state = err.state
        finally:
            logger.setLevel(level)
    return state, error


def _print_failure(err: TrainingWorkerError) -> None:
    """The error as a user meets it, then the fields a program reads."""
    print(f"\njaxstep.TrainingWorkerError: {err}")
    print(
        f"\nerr.device_id={err.device_id}  err.step={err.step}  err.status={err.status!r}  "
        f"err.leaf={err.leaf!r}" + (f"  err.group={err.group}" if len(err.group) > 1 else "")
    )
    if err.diagnosis is not None:
        print(f"err.diagnosis.verdict={err.diagnosis.verdict!r}")
    checkpoint = getattr(err, "checkpoint", None)
    if checkpoint is not None:
        print(f"emergency checkpoint: {checkpoint}")
