"""Pictures of a run from its :class:`jaxstep.History` (matplotlib): a device x step
heatmap of gradient norms with failures, skipped steps and overflows marked, and the
loss curve of every device with the recoveries of ``fit(..., recover=...)`` marked,
and where the job's time went (:func:`goodput`).

    fig = jaxstep.plot.overview(history, "run.png")
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING
from typing import Any

import numpy as np

from jaxstep._src.core import Status
from jaxstep._src.loop import History
from jaxstep._src.loop import timeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.figure import FigureBase
    from matplotlib.image import AxesImage

__all__ = [
    "COLORBAR_LABEL",
    "FAILURE_COLOR",
    "GOODPUT_COLORS",
    "OVERFLOW_COLOR",
    "RECOVERY_COLOR",
    "goodput",
    "grad_norm_heatmap",
    "loss_curves",
    "marks",
    "overview",
]

#: Status bits that are recorded but are not failures (loss-scale overflows).
_NOT_FAILURES = int(Status.OVERFLOW)
#: The colour of a failure: the heatmap's cross, the loss panel's dashed line.
FAILURE_COLOR = "#e41a1c"
#: The colour of a loss-scale overflow's dot on the heatmap.
OVERFLOW_COLOR = "#ff7f00"
DROPPED_COLOR = "#ffffff"  # the outline of a chunk left out (on_failure="drop")
REPAIRED_COLOR = "#4daf4a"  # the outline of a replica repaired from the majority
#: The colour of the line at a step ``fit(..., recover=...)`` recovered.
RECOVERY_COLOR = "#377eb8"
#: The heatmap colour bar's label.
COLORBAR_LABEL = "gradient norm (before averaging)"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(
            "jaxstep.plot draws with matplotlib: pip install 'jaxstep[demo]' "
            "(or pip install matplotlib)"
        ) from err
    chosen = os.environ.get("MPLBACKEND") or {"matplotlib.pyplot", "IPython"} & set(sys.modules)
    if not chosen:
        matplotlib.use("Agg")  # files only; a notebook or a pyplot user has chosen already
    import matplotlib.pyplot as plt

    return plt


def _arrays(history: History) -> dict[str, np.ndarray]:
    if not len(history):
        raise ValueError("the history is empty: pass it to jaxstep.fit(..., history=h) first")
    return history.as_arrays()


def marks(history: History) -> dict[str, np.ndarray]:
    """Where the pictures put their marks: what a test of a run's picture checks.

    Args:
      history: a run's :class:`jaxstep.History`.

    Returns:
      ``failures``, ``overflows``, and under ``on_failure="drop"`` the chunks left out
      (``dropped``) and the replicas repaired (``repaired``), each an ``(n, 2)`` array
      of ``(step, device_id)`` pairs; ``skipped``, and under ``fit(..., recover=...)``
      each recovery action's (``recoveries``), arrays of steps.

    Raises:
      ValueError: the history is empty.

    Example:
      Device 3's gradient fails at step 1 under ``on_failure="skip"``:

      >>> import jaxstep
      >>> from jaxstep.testing import Fault, tiny_step
      >>> tiny = tiny_step(on_failure="skip", faults=[Fault("grad", device_id=3, step=1)])
      >>> history = jaxstep.History()
      >>> state = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3), history=history)
      >>> where = jaxstep.plot.marks(history)
      >>> where["failures"].tolist(), where["skipped"].tolist()
      ([[1, 3]], [1])
    """
    a = _arrays(history)
    steps = a["step"].astype(np.int64)
    at = _rows(history, a)
    found = {k: np.stack([steps[v[:, 0]], v[:, 1]], axis=1) for k, v in at.items() if v.ndim == 2}
    return found | {
        "skipped": steps[at["skipped"]],
        "recoveries": np.asarray([r.step for r in history.recoveries], np.int64),
    }


def _rows(history: History, a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """:func:`marks` by history row instead of step: ``(row, device_id)`` pairs, and
    rows for ``skipped`` (a step run again under ``recover`` has a row per try)."""
    ids = a["device_ids"]
    failed = (a["status"] & ~_NOT_FAILURES) != 0
    overflow = (a["status"] & _NOT_FAILURES) != 0

    def pairs(mask: np.ndarray) -> np.ndarray:
        t, d = np.nonzero(mask)
        return np.stack([t, ids[d]], axis=1).astype(np.int64)

    def listed(per_row: list[tuple[int, ...]]) -> np.ndarray:
        # a History built by hand may leave these out: no device was
        found = [
            (t, d) for t, ids in zip(range(len(a["step"])), per_row, strict=False) for d in ids
        ]
        return np.asarray(found, np.int64).reshape(-1, 2)

    return {
        "failures": pairs(failed),
        "overflows": pairs(overflow),
        "dropped": listed(history.dropped),
        "repaired": listed(history.repaired),
        "skipped": np.flatnonzero(a["skipped"]),
    }


def _columns(steps: np.ndarray) -> np.ndarray:
    """Where each history row is drawn: at its step; or, once steps repeat or jump (a
    failed try run again or a rollback under ``fit(..., recover=...)``, two runs in one
    history), each row in the order run, counted from the first step (the step axis's
    labels still name the steps: :func:`_label_steps`)."""
    steps = steps.astype(np.int64)
    if len(steps) < 2 or bool(np.all(np.diff(steps) == 1)):
        return steps
    return steps[0] + np.arange(len(steps))


def _label_steps(ax: Axes, steps: np.ndarray) -> None:
    """The step axis's tick labels: the step of the row at each tick, when
    :func:`_columns` draws rows in the order run."""
    from matplotlib.ticker import FuncFormatter
    from matplotlib.ticker import MaxNLocator

    columns = _columns(steps)
    if np.array_equal(columns, steps):
        return

    def label(x: float, _: int) -> str:
        k = round(x) - int(columns[0])
        return str(int(steps[k])) if abs(x - round(x)) < 1e-6 and 0 <= k < len(steps) else ""

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(label))
    ax.set_xlabel("step (in the order run: a step tried again has a column per try)")


def _recovery_columns(history: History, steps: np.ndarray) -> list[int]:
    """Where each recovery's line is drawn: at its step, or (rows drawn in the order
    run) at the first row of its step after the previous recovery's: the failed try."""
    columns = _columns(steps)
    if np.array_equal(columns, steps):
        return [r.step for r in history.recoveries]
    found, start = [], 0
    for record in history.recoveries:
        hits = np.flatnonzero(steps[start:] == record.step)
        if not len(hits):  # not in the history (built by hand): at its step
            found.append(record.step)
            continue
        row = start + int(hits[0])
        found.append(int(columns[row]))
        start = row + 1
    return found


def _colorbar(fig: FigureBase, image: AxesImage, axes: Axes | list[Axes], **kwargs: Any) -> None:
    from matplotlib.ticker import LogFormatter

    bar = fig.colorbar(image, ax=axes, label=COLORBAR_LABEL, pad=0.01, **kwargs)
    # Plain numbers (not 2x10^0); minor ticks labelled only over a narrow range.
    bar.ax.yaxis.set_major_formatter(LogFormatter())
    bar.ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))


def grad_norm_heatmap(history: History, ax: Axes | None = None, *, colorbar: bool = True) -> Axes:
    """Gradient norm of each device (rows) at each step (columns), log colour scale.
    Failures are red crosses, overflows orange dots, skipped steps grey bands;
    non-finite norms are black.

    Args:
      history: a run's :class:`jaxstep.History`.
      ax: the matplotlib axes to draw on (default: a new figure's).
      colorbar: draw the colour bar beside it.

    Returns:
      The axes (the image is ``ax.images[0]``).

    Raises:
      ValueError: the history is empty.
      ImportError: matplotlib is missing (``pip install 'jaxstep[demo]'``).

    Example:
      >>> import jaxstep
      >>> tiny = jaxstep.testing.tiny_step(divergence_every=None)
      >>> history = jaxstep.History()
      >>> state = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(4), history=history)
      >>> ax = jaxstep.plot.grad_norm_heatmap(history)
      >>> ax.images[0].get_array().shape  # a row a device, a column a step
      (8, 4)
    """
    plt = _pyplot()
    from matplotlib.colors import LogNorm

    a = _arrays(history)
    ax = ax if ax is not None else plt.figure(figsize=(10, 4)).gca()
    steps, ids = a["step"], a["device_ids"]
    columns = _columns(steps)
    norms = a["device_grad_norm"].T.astype(np.float64)
    good = np.isfinite(norms) & (norms > 0)
    cmap = plt.get_cmap("viridis").with_extremes(bad="black")
    lo, hi = (norms[good].min(), norms[good].max()) if good.any() else (1e-3, 1.0)
    image = ax.imshow(
        np.ma.masked_where(~good, norms),
        aspect="auto",
        interpolation="nearest",
        origin="lower",
        cmap=cmap,
        norm=LogNorm(vmin=lo, vmax=max(hi, lo * 1.0001)),
        extent=(columns[0] - 0.5, columns[-1] + 0.5, -0.5, len(ids) - 0.5),
    )
    if colorbar:
        _colorbar(ax.figure, image, ax)
    row = {int(d): i for i, d in enumerate(ids)}
    m = _rows(history, a)
    for s in columns[m["skipped"]]:
        ax.axvspan(s - 0.5, s + 0.5, color="0.6", alpha=0.5, lw=0, gid="skipped")
    size = float(np.clip(4000 / max(len(steps), len(ids) * 4), 70, 160))
    for kind, color, marker in (
        ("failures", FAILURE_COLOR, "X"),
        ("overflows", OVERFLOW_COLOR, "o"),
    ):
        if len(m[kind]):
            ax.scatter(
                columns[m[kind][:, 0]],
                [row[int(d)] for d in m[kind][:, 1]],
                s=size,
                c=color,
                marker=marker,
                edgecolors="white",
                linewidths=0.5,
                label=kind[:-1],
                gid=kind,
                zorder=3,
            )
    # on_failure="drop": an outline around the cell of a chunk left out (its failure's X
    # inside it) or of a replica repaired from the majority
    for kind, color, marker in (("dropped", DROPPED_COLOR, "s"), ("repaired", REPAIRED_COLOR, "D")):
        if len(m[kind]):
            ax.scatter(
                columns[m[kind][:, 0]],
                [row[int(d)] for d in m[kind][:, 1]],
                s=size * 2.2,
                facecolors="none",
                edgecolors=color,
                marker=marker,
                linewidths=1.5,
                label=kind,
                gid=kind,
                zorder=4,
            )
    ax.set_yticks(range(len(ids)), [f"device {d}" for d in ids])
    ax.set_xlabel("step")
    _label_steps(ax, steps)
    title = "gradient norm per device (red X: failed, grey: skipped step"
    if len(m["dropped"]) or len(m["repaired"]):
        title += ", square: left out, diamond: repaired"
    ax.set_title(title + ")")
    return ax


def loss_curves(history: History, ax: Axes | None = None) -> Axes:
    """The loss of every device (thin lines) and their mean (black); steps with a
    failure get a red dashed line, each recovery of ``fit(..., recover=...)`` a blue
    one labelled with its action.

    Args:
      history: a run's :class:`jaxstep.History`.
      ax: the matplotlib axes to draw on (default: a new figure's).

    Returns:
      The axes.

    Raises:
      ValueError: the history is empty.
      ImportError: matplotlib is missing (``pip install 'jaxstep[demo]'``).

    Example:
      >>> import jaxstep
      >>> tiny = jaxstep.testing.tiny_step(divergence_every=None)
      >>> history = jaxstep.History()
      >>> state = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(4), history=history)
      >>> ax = jaxstep.plot.loss_curves(history)
      >>> len(ax.lines)  # a line a device, and their mean
      9
    """
    plt = _pyplot()
    a = _arrays(history)
    ax = ax if ax is not None else plt.figure(figsize=(10, 3)).gca()
    steps = a["step"]
    columns = _columns(steps)
    losses = a["device_loss"].astype(np.float64)
    cmap = plt.get_cmap("tab10" if len(a["device_ids"]) <= 10 else "viridis")
    for i, d in enumerate(a["device_ids"]):
        color = cmap(i % 10) if len(a["device_ids"]) <= 10 else cmap(i / len(a["device_ids"]))
        ax.plot(columns, losses[:, i], lw=0.8, alpha=0.8, color=color, label=f"device {d}")
    ax.plot(columns, a["loss"], lw=2.0, color="black", label="mean")
    for s in np.unique(columns[_rows(history, a)["failures"][:, 0]]):
        ax.axvline(s, color=FAILURE_COLOR, ls="--", lw=1.2, gid="failure-steps")
    _recoveries(history, ax, _recovery_columns(history, steps))
    ax.set_xlabel("step")
    _label_steps(ax, steps)
    ax.set_ylabel("loss per device\n(non-finite: gaps)")
    # Above the curves, where it hides none of them.
    ax.legend(
        ncol=min(len(a["device_ids"]) + 1 + bool(history.recoveries), 9),
        fontsize="small",
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        frameon=False,
    )
    ax.set_xlim(columns[0] - 0.5, columns[-1] + 0.5)
    return ax


def _recoveries(history: History, ax: Axes, columns: list[int]) -> None:
    """A dashed line at each recovery's column, its action written along the line's top
    (one legend entry for them all)."""
    for i, (record, x) in enumerate(zip(history.recoveries, columns, strict=True)):
        ax.axvline(
            x,
            color=RECOVERY_COLOR,
            ls="--",
            lw=1.2,
            gid="recoveries",
            label="recovery" if i == 0 else "_nolegend_",
            zorder=3,
        )
        ax.text(
            x,
            0.97,
            f" {record.action}",
            transform=ax.get_xaxis_transform(),  # x: step, y: fraction of the panel
            rotation=90,
            ha="right",
            va="top",
            fontsize="small",
            color=RECOVERY_COLOR,
            gid="recovery-labels",
        )


def overview(
    history: History, path: str | os.PathLike[str] | None = None, *, dpi: int = 100
) -> Figure:
    """The heatmap (:func:`grad_norm_heatmap`) above the loss curves
    (:func:`loss_curves`) in one figure, with one colour bar beside both.

    Args:
      history: a run's :class:`jaxstep.History`.
      path: where to save it as PNG, or None.
      dpi: the figure's resolution.

    Returns:
      The matplotlib ``Figure``.

    Raises:
      ValueError: the history is empty.
      ImportError: matplotlib is missing (``pip install 'jaxstep[demo]'``).

    Example:
      >>> import jaxstep
      >>> tiny = jaxstep.testing.tiny_step(divergence_every=None)
      >>> history = jaxstep.History()
      >>> state = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(4), history=history)
      >>> fig = jaxstep.plot.overview(history)
      >>> len(fig.axes)  # the heatmap, the loss curves, the colour bar
      3
    """
    plt = _pyplot()
    rows = len(_arrays(history)["device_ids"])
    fig, (top, bottom) = plt.subplots(
        2,
        1,
        figsize=(11, 3 + 0.3 * rows + 3),
        height_ratios=(1 + 0.1 * rows, 1),
        sharex=True,
        layout="constrained",
        dpi=dpi,
    )
    grad_norm_heatmap(history, top, colorbar=False)
    loss_curves(history, bottom)
    # One colour bar beside both panels keeps their step axes aligned.
    _colorbar(fig, top.images[0], [top, bottom], shrink=0.6)
    top.set_xlabel("")
    if path is not None:
        fig.savefig(os.fspath(path), dpi=dpi)
    return fig


#: the colour of each bucket of :func:`goodput` (``"productive"`` and the badput ones)
GOODPUT_COLORS = {
    "productive": "#4daf4a",
    "startup": "#999999",
    "data": "#a6cee3",
    "checkpoint": "#377eb8",
    "diagnosis": "#984ea3",
    "recovery": "#ff7f00",
    "wasted": "#e41a1c",
    "other": "#dddddd",
}


def goodput(history: History, path: str | os.PathLike[str] | None = None) -> Figure:
    """Where the job's time went, over the run: the seconds each bucket of
    :meth:`jaxstep.History.goodput` has taken so far, stacked, against the job's wall
    time in fit (every fit call, every process before a restart), with the goodput in
    the title.

    Args:
      history: a run's :class:`jaxstep.History` (also that of a fit that raised).
      path: where to save the figure (a PNG), or None.

    Returns:
      The matplotlib figure.

    Raises:
      ValueError: no fit call filled the history yet.
      ImportError: matplotlib is missing (``pip install 'jaxstep[demo]'``).

    Example:
      >>> import jaxstep
      >>> tiny = jaxstep.testing.tiny_step(divergence_every=None)
      >>> history = jaxstep.History()
      >>> state = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(4), history=history)
      >>> fig = jaxstep.plot.goodput(history)
      >>> [t.get_text() for t in fig.axes[0].get_legend().get_texts()][:2]
      ['productive', 'startup']
    """
    spans = timeline(history)
    if not spans:
        raise ValueError("the history holds no fit call yet: pass one fit filled")
    plt = _pyplot()
    report = history.goodput()
    names = list(GOODPUT_COLORS)
    wall = np.concatenate([[0.0], np.cumsum([seconds for _, seconds, _, _ in spans])])
    shares = np.zeros((len(names), len(spans) + 1))
    for i, (bucket, seconds, _, _) in enumerate(spans):
        shares[:, i + 1] = shares[:, i]
        shares[names.index(bucket), i + 1] += seconds
    fig, ax = plt.subplots(figsize=(10, 3.5))
    shown = [k for k, name in enumerate(names) if shares[k, -1] > 0]
    ax.stackplot(
        wall,
        shares[shown],
        labels=[names[k] for k in shown],
        colors=[GOODPUT_COLORS[names[k]] for k in shown],
    )  # each bucket rises while its spans run: the top edge is the wall time itself
    ax.set_xlim(0.0, wall[-1])
    ax.set_xlabel("wall time in fit (s)")
    ax.set_ylabel("seconds so far")
    ax.set_title(
        f"goodput {100 * report.goodput:.1f}%: {report.steps['productive']} steps kept "
        f"of {report.wall_s:.1f} s"
    )
    ax.legend(loc="upper left", fontsize="small", frameon=False)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
