"""The words of a failure: each status's cause, in the chain's order input -> loss ->
gradient -> model state -> parameters -> the rest (the earliest is the root cause), and
what to try for each, or for a replay's verdict."""

from __future__ import annotations

from jaxstep._src.core.health import Status

CAUSES: tuple[tuple[Status, str], ...] = (
    (Status.INPUT_NONFINITE, "non-finite input"),
    (Status.LOSS_NONFINITE, "non-finite loss"),
    (Status.GRAD_NONFINITE, "non-finite gradient"),
    (Status.MODEL_STATE_NONFINITE, "non-finite model state"),
    (Status.OVERFLOW, "scaled gradient overflowed at the minimum loss scale"),
    (Status.PARAM_NONFINITE, "non-finite parameter after the update"),
    (Status.CHECK_FAILED, "failed check"),
    (Status.DIVERGED, "replica diverged from the majority"),
    (Status.HUNG, "device did not finish the step"),
    (Status.LOSS_SPIKE, "loss spike"),
)

HINTS: dict[Status, str] = {
    Status.INPUT_NONFINITE: (
        "the batch itself holds NaN or Inf: check the data pipeline for rows {rows} of "
        "the global batch"
    ),
    Status.LOSS_NONFINITE: (
        "the input was finite but the loss was not: look for log, sqrt or division of "
        "out-of-range values in loss_fn on rows {rows} of the global batch"
    ),
    Status.GRAD_NONFINITE: (
        "the loss was finite but a gradient was not: look for sqrt/log at 0 or overflow "
        "in the layer that owns {leaf}, or nearer the output: the leaf named is the first "
        "non-finite one in the parameters' tree order, and a NaN that arises near the "
        "output spreads, in the backward pass, to the gradients of every layer below it; "
        "clipping (optax.clip_by_global_norm) does not help against NaN"
    ),
    Status.MODEL_STATE_NONFINITE: (
        "the new model state (e.g. BatchNorm statistics) of {leaf} was not finite on rows "
        "{rows} of the global batch: look for extreme inputs or a variance of 0"
    ),
    Status.OVERFLOW: (
        "the fp16 gradients overflow even at DynamicLossScale's minimum_scale: lower "
        "minimum_scale, keep the overflowing layer in float32, or use bf16 (no scale needed)"
    ),
    Status.PARAM_NONFINITE: (
        "the update overflowed the parameters: lower the learning rate or clip gradients"
    ),
    Status.CHECK_FAILED: "your check in aux['checks'] returned False on this device",
    Status.DIVERGED: (
        "this device's copy of the state differs from the others (silent data corruption). "
        "One divergence does not tell a bad chip from a one-off corruption, so do not leave "
        "the device out yet: go on on every device from a copy that agrees with the "
        "majority (error.state when it was rebuilt from one, else the latest verified "
        "checkpoint; fit(recover=jaxstep.Recover()) does this itself); if the same device "
        "diverges again, suspect the chip and leave it out (make_train_step(devices=[...]))"
    ),
    Status.HUNG: (
        "this device did not finish its part of the step: suspect the chip, its link, or "
        "its host process (see the Python stacks logged by each process). The step is still "
        "stuck, so this process cannot train again: restart it (in a notebook, restart the "
        "kernel) and go on from the latest verified checkpoint with fit(..., "
        "checkpoint_dir=..., resume=True)"
    ),
    Status.LOSS_SPIKE: "the loss jumped far above its recent range on this device's rows {rows}",
}

# What to try when a replay's verdict (``fit(diagnose=True)``) says it is not the data:
# the status hints above are about the data and the model.
VERDICT_HINTS: dict[str, str] = {
    "device": (
        "the failure stayed on this device when its rows moved to another: suspect the "
        "chip, not the data; leave it out (make_train_step(devices=...) without it, or "
        "fit(recover=jaxstep.Recover()), which excludes it) and resume from the last "
        "checkpoint"
    ),
    "transient": (
        "the step passed when run again from the same state: a transient fault of the "
        "chip or its link; run it again (fit(recover=jaxstep.Recover()) retries it)"
    ),
}


def describe(status: Status, leaves: dict[Status, str], check: str | None) -> str:
    """Plain words for a status: ``non-finite gradient in ['dense2']['kernel']``."""
    parts = []
    for flag, words in CAUSES:
        if flag not in status:
            continue
        if flag in leaves:
            words = f"{words} in {leaves[flag]}"
        elif flag is Status.CHECK_FAILED and check is not None:
            words = f"failed check {check!r}"
        parts.append(words)
    return parts[0] + (f" (with {', '.join(parts[1:])})" if len(parts) > 1 else "")


def rank(status: Status) -> int:
    """Where a status's first cause sits in the chain input -> loss -> gradient ->
    model state -> parameters -> the rest: the earliest is the root cause."""
    return next((i for i, (flag, _) in enumerate(CAUSES) if flag in status), len(CAUSES))
