"""What ``jaxstep demo`` prints once training ends: the per-device table (loss, gradient
norm, failures, chunks left out), what the recoveries left behind (the quarantine file,
the devices the run ended on), the test accuracy and the plot."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING
from typing import Any

if TYPE_CHECKING:
    import flax.linen as nn
    import jax

    from jaxstep._src.core import TrainingWorkerError
    from jaxstep._src.core import TrainState
    from jaxstep._src.data import Split
    from jaxstep._src.loop import History
    from jaxstep._src.step import TrainStep

__all__ = ["report", "summary"]


def report(
    args: argparse.Namespace,
    devices: list[jax.Device],
    model: nn.Module,
    step: TrainStep,
    state: TrainState,
    test: Split,
    history: History,
    error: TrainingWorkerError | None,
    options: dict[str, Any],
) -> None:
    """After training: the per-device summary, what was recovered (the quarantine file,
    the devices left), the test accuracy (when there is a state to test), where the
    run's time went (``history.goodput()``), the plots if asked."""
    import jax
    import numpy as np

    from jaxstep._src.plot import goodput
    from jaxstep._src.plot import overview

    usable = error is None or error.state is not None
    host = step.host_state(state) if usable else None
    # Steps trained: the history also holds the failed tries that a recovery ran again.
    trained = len(history) if host is None else int(host.step)
    print()
    summary(history, args.steps, devices, error, trained=trained)
    _recovered(history, step, options)
    if host is not None:
        params = jax.tree.map(np.asarray, host.params)
        logits = jax.jit(model.apply)({"params": params}, test.image)
        accuracy = float(np.mean(np.asarray(logits).argmax(-1) == test.label))
        print(f"test accuracy {accuracy:.3f} after {trained} steps")
    print(history.goodput())
    if args.plot and len(history):
        overview(history, args.plot)
        print(f"plot saved to {args.plot}")
    if getattr(args, "goodput", None) and history.ledger.calls:
        goodput(history, args.goodput)
        print(f"goodput plot saved to {args.goodput}")
    if error is None:
        print(f"finished {trained} steps")


def _recovered(history: History, step: TrainStep, options: dict[str, Any]) -> None:
    """What the recoveries left behind (each was printed when taken, and summed up at
    the end of fit): the quarantined examples on disk, the devices the run ended on."""
    from pathlib import Path

    from jaxstep._src.checkpoint import read_quarantine

    actions = {r.action for r in history.recoveries}
    directory = options.get("checkpoint_dir")
    if "quarantined" in actions and directory is not None:
        found = read_quarantine(directory)
        print(
            f"quarantined examples, by batch (indices into the batch): {dict(found)} in "
            f"{Path(directory) / 'quarantine.jsonl'} (jaxstep.read_quarantine)"
        )
    if "excluded" in actions:
        ids = [d.id for d in step.devices]
        print(f"the run ended on {len(ids)} devices: {ids}")
        for batch, start, stop in history.left_over:
            print(
                f"rows {start}..{stop - 1} of batch {batch} were not trained: the run ended "
                f"with fewer rows carried than the {len(ids)} a step needs (history.left_over)"
            )


def _left_out(history: History) -> dict[int, str]:
    """Per device id: the steps its chunk was left out of the mean (``drop``) and the
    global batch rows of that chunk, e.g. ``1 (step 5: rows 80..95)``, first and last."""
    found: dict[int, list[str]] = {}
    for step, ids, spans in zip(history.step, history.dropped, history.dropped_rows, strict=True):
        for k, device_id in enumerate(ids):
            rows = f": rows {spans[k][0]}..{spans[k][1] - 1}" if k < len(spans) else ""
            found.setdefault(device_id, []).append(f"step {step}{rows}")
    return {d: f"{len(s)} ({', '.join(s[:2])})" for d, s in found.items()}


def summary(
    history: History,
    steps: int,
    devices: list[jax.Device],
    error: TrainingWorkerError | None = None,
    *,
    trained: int | None = None,
) -> None:
    """The per-device table: id, process, mean loss and gradient norm, failures (a
    hung step never reaches the history: it is taken from ``error``). ``trained``: the
    steps trained, when the history also holds failed tries run again (``recover``)."""
    import numpy as np

    from jaxstep._src.core import Status

    if not len(history):
        print("no step finished")
        return
    a = history.as_arrays()
    rows = []
    left_out = _left_out(history)
    for i, device_id in enumerate(a["device_ids"]):
        loss, norm = a["device_loss"][:, i], a["device_grad_norm"][:, i]
        bad = (a["status"][:, i] & ~int(Status.OVERFLOW)) != 0  # overflows: no failure
        # a step once, however often it was tried
        failed = list(dict.fromkeys(int(a["step"][t]) for t in np.flatnonzero(bad)))
        if error is not None and error.step not in failed:
            failed += [f.step for f in error.failures if f.device_id == device_id]
        rows.append(
            (
                str(device_id),
                str(devices[i].process_index),
                f"{np.mean(loss[np.isfinite(loss)]):.4f}" if np.isfinite(loss).any() else "-",
                f"{np.mean(norm[np.isfinite(norm)]):.4f}" if np.isfinite(norm).any() else "-",
                (f"{len(failed)} (step {', '.join(str(t) for t in failed[:3])})")
                if len(failed)
                else "0",
                left_out.get(int(device_id), "0"),
            )
        )
    header = ("device", "process", "mean loss", "mean grad norm", "failures", "left out")
    finite = a["loss"][np.isfinite(a["loss"])]
    last = f"last finite loss {finite[-1]:.4f}" if finite.size else "no finite loss"
    dropped = sum(len(ids) for ids in history.dropped)
    repaired = sum(len(ids) for ids in history.repaired)
    trained = len(history) if trained is None else trained
    title = f"{trained} of {steps} steps, {int(a['skipped'].sum())} skipped, "
    if history.recoveries:
        title += f"{len(history.recoveries)} recovered, "
    if dropped:
        title += f"{dropped} left out, "
    if repaired and not history.recoveries:  # under recover each repair is one of them
        title += f"{repaired} repaired, "
    title += last
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for row in (header, *rows):
            print("  ".join(f"{c:>14}" for c in row))
        return
    table = Table(*header, title=title)
    for row in rows:
        table.add_row(*row, style="red" if row[-2] != "0" else None)
    Console().print(table)
