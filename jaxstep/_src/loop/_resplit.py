"""Rows re-split over the step's devices on several processes: once a device left a
multi-process run (``fit(..., recover=jaxstep.Recover())`` excluded it), or on a resume
at a data position inside a batch.

Each process passes only its own rows, for the devices it held when the batches were
laid out (``origin``), and a step takes one global array whose every device holds the
same number of rows. When a device of process 1 leaves a 2 x 4 run, process 1 still
holds 4 devices' rows for its 3 devices, and no host loop can hand rows to another (the
coordination service is for small values, not batches). So the rows travel on the
devices: each process places its rows on its devices left, padded to the most any one
holds, and one compiled all-gather over the devices left gives every process every
process's rows (:func:`exchange`). Every process then holds the same global batch, in
the data's order (the chunks of the devices it was laid out for, as before any left),
and runs the same :class:`~jaxstep._src.loop._carry.Carry` on it: each step trains the
largest multiple of devices x micro-batches of the rows at hand and carries the rest,
identically on every process, so every process knows where every row is without
another word. A process passes its devices' chunks of the step's rows to the step
(:func:`jaxstep.distributed.local_batch`), the same layout as any step's: the step, the
replay, the quarantine's rows and ids and the records see nothing new.

The rows carried are held by every process (all of them: the next step may give them to
any device), with the process each came from (:class:`~jaxstep._src.loop._pending.Shared`):
an early stop or a failure hands each process back the untrained rows it passed, and a
checkpoint's data position (the first row not trained, counting the rows of a batch
every process's together, in the data's order) is the same on every process; a resume
from it re-splits again, so it trains exactly the rows the run had not. At the end at
most ``unit - 1`` rows of each shape are left, listed in ``History.left_over`` (the same
on every process).

Batches every process reads whole (``fit(global_batches=True)``, the same global batch
on every process, as :func:`jaxstep.data.batches` makes it) need none of this: fit cuts
each process's rows itself (:class:`Whole`), keeps the batch with them
(``Item.shared``), and once a device left, every process runs the same carry on the
batch it read: no row travels between processes, nothing waits on the devices, and
the steps overlap the host as before. Only batches a process holds its own rows of
(a plain iterator of local rows) go through the all-gather below.

The cost, paid only once rows must move: every step's batch goes through the devices
twice (the all-gather, then the step's own placement of each process's chunks) and
once through each host, and the host reads the gathered rows (after the step before,
on the devices) before it dispatches the next step: steps no longer overlap the host.
The read waits through the loop's ``ready`` (:class:`~jaxstep._src.loop._peers.Peers`), so a
peer lost meanwhile is a hang reported, not a wait forever. Rows travel as bytes: a
device would make 64-bit ids 32-bit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from jaxstep._src.checkpoint import Cursor
from jaxstep._src.core import processes
from jaxstep._src.core import validate
from jaxstep._src.loop._carry import AT_START
from jaxstep._src.loop._carry import Carry
from jaxstep._src.loop._carry import Span
from jaxstep._src.loop._carry import unit_of
from jaxstep._src.loop._pending import Item
from jaxstep._src.loop._pending import Shared
from jaxstep._src.step import Runtime
from jaxstep._src.step import join_presplit


def carry_for(
    runtime: Runtime,
    start: int,
    resumed: Cursor,
    presplit: bool,
    carried: bool = False,
    ready: Callable[[jax.Array], None] = jax.block_until_ready,
    everyone: bool = False,
) -> Carry | Resplit | None:
    """The carry a fit call starts with (None: none needed): for a resume inside a batch
    (``resumed``: rows of the first batch trained already, later batches' rows not
    trained: ``Source.resumed``) or from a checkpoint of a run that carried rows
    (``carried``), or for a step that lost devices in an earlier fit call
    (:class:`Resplit` on several processes, else
    :class:`~jaxstep._src.loop._carry.Carry`). ``start``: the data's count of the first
    batch pulled; ``ready``: a :class:`Resplit`'s wait for the rows it gathers;
    ``everyone``: every process reads the batches whole (:class:`Whole`)."""
    origin = runtime.origin or runtime.devices
    many = processes.spans_processes(origin)
    inside = bool(resumed.rows or resumed.then)
    if not (inside or runtime.origin is not None or (carried and not many)):
        return None  # (several processes at a batch's start: every batch divides)
    if many:
        return Resplit(origin, runtime, start, presplit, resumed, ready, everyone)
    return Carry(unit_of(runtime), presplit, start=start, resumed=resumed)


def after_leaving(
    carry: Carry | Resplit | None,
    before: Sequence[jax.Device],
    runtime: Runtime,
    *,
    start: int,
    presplit: bool,
    ready: Callable[[jax.Array], None] = jax.block_until_ready,
    everyone: bool = False,
) -> Carry | Resplit:
    """``carry`` (made when None) once devices of ``before`` left the run and the steps
    train on ``runtime``'s: the rows that do not divide by the devices left are
    carried, on several processes once every process's rows are gathered
    (:class:`Resplit`, its batches laid out for ``before``'s devices)."""
    if carry is None:
        if processes.spans_processes(before):
            return Resplit(before, runtime, start, presplit, ready=ready, everyone=everyone)
        carry = Carry(unit_of(runtime), presplit=presplit, start=start)
    if isinstance(carry, Resplit):
        carry.now_on(runtime)
    else:
        carry.unit = unit_of(runtime)
    return carry


class Resplit:
    """The loop's carry on several processes (see the module's text): a
    :class:`~jaxstep._src.loop._carry.Carry` over the global batch every process gathers.

    Args:
      origin: the step's devices the batches are laid out for (before any left the
        run): each process passes the chunks of its devices among them, in their order.
      runtime: the step's runtime now (its devices train the rows).
      start: the data's count of the first batch fit pulled.
      presplit: batches come ``(n_devices, per_device, ...)`` (``n_devices``: this
        process's devices of ``origin``).
      resumed: where a resume starts (:class:`~jaxstep._src.loop._carry.Carry`'s;
        rows of a batch counted every process's together).
      ready: returns once gathered rows can be read (:func:`exchange`).
      everyone: every process reads the batches whole (:class:`Whole`: each item comes
        with all its rows, nothing is gathered).
    """

    def __init__(
        self,
        origin: Sequence[jax.Device],
        runtime: Runtime,
        start: int,
        presplit: bool,
        resumed: Cursor = AT_START,
        ready: Callable[[jax.Array], None] = jax.block_until_ready,
        everyone: bool = False,
    ):
        self.origin = list(origin)
        self.everyone = everyone
        #: this process's chunks of a batch (its devices among ``origin``)
        self.chunks = sum(d.process_index == jax.process_index() for d in origin)
        self.ready = ready
        self.devices = list(runtime.devices)
        self.presplit = presplit
        self.carry = Tagged(unit_of(runtime), start=start, resumed=resumed)

    def now_on(self, runtime: Runtime) -> None:
        """Devices left the run: the steps train on ``runtime``'s."""
        self.devices = list(runtime.devices)
        self.carry.unit = unit_of(runtime)

    def take(self, item: Item) -> Item | None:
        """The step's batch from ``item``'s rows and those carried of their shape: this
        process's devices' chunks of it, with all its rows (``Item.shared``); None when
        fewer rows than a step needs are at hand (all carried on). Every
        process takes the same rows. ``item`` pulled from the data: its rows are gathered
        from every process first (a collective: every process takes every batch)."""
        if item.shared is None:  # (never with batches every process read whole)
            batch = jax.tree.map(np.asarray, item.batch)
            if self.presplit:
                batch = join_presplit(batch, self.chunks)
            per = validate.batch(batch, self.chunks) // self.chunks  # rows a chunk
            size = per * len(self.origin)  # every process's
            if self.carry.trained_before(item.seq, size) >= size:
                return None  # trained whole before a resume: every process passes it over
            whole = exchange(batch, per, self.origin, self.devices, self.ready)
        else:  # read whole, or queued again by a recovery: every process's rows at hand
            whole = (item.shared.rows, item.shared.owner)
        taken = self.carry.take(item._replace(batch=whole, shared=None, placed=None))
        if taken is None:
            return None
        rows, owner = taken.batch
        mine = processes.local_batch(rows, self.devices)
        return taken._replace(batch=mine, shared=Shared(rows, owner, self.everyone))

    def release(self) -> list[Item]:
        """The rows carried, as items to queue again or hand back: each holds the rows
        this process passed (``batch``) and every process's (``shared``)."""
        out = []
        for item in self.carry.release():
            rows, owner = item.batch
            shared = Shared(rows, owner, self.everyone)
            out.append(item._replace(batch=shared.own(), shared=shared))
        return out

    def left(self) -> list[Span]:
        """Where the rows carried are in the data (rows of a batch counted every
        process's together)."""
        return self.carry.left()

    def finish(self, cut_short: bool = False) -> list[Span]:
        """The data ended (or the call's count of steps): the rows still carried,
        listed (:meth:`Carry.finish`)."""
        return self.carry.finish(cut_short)


class Whole:
    """``fit(global_batches=True)`` on several processes: every process reads each
    global batch whole (the same on every process), so fit cuts this process's rows
    itself (what :func:`jaxstep.distributed.local_batch` does for a user who passes
    them) and keeps the whole batch with them (``Item.shared``, each row's owner the
    process whose devices it was laid out for): once a device left, each process takes
    the rows it now trains from the batch it read (:class:`Resplit`, nothing gathered).

    Args:
      origin: the step's devices the batches are laid out for (before any left).
      presplit: batches come ``(len(origin), per_device, ...)``.
    """

    def __init__(self, origin: Sequence[jax.Device], presplit: bool):
        self.origin = list(origin)
        self.presplit = presplit
        here = jax.process_index()
        #: this process's chunks of a batch (its devices' positions among ``origin``)
        self.mine = np.asarray([i for i, d in enumerate(origin) if d.process_index == here])
        self.owners = np.asarray([d.process_index for d in origin], np.int32)

    def local(self, batch: Any) -> Any:
        """This process's rows of the global ``batch``, as it would pass them."""
        if self.presplit:
            return jax.tree.map(lambda x: np.asarray(x)[self.mine], batch)
        return processes.local_batch(batch, self.origin)

    def item(self, batch: Any, seq: int, placed: Any = None) -> Item:
        """The loop's item for the global ``batch`` (the ``seq``-th pulled): this
        process's rows, every row with its owner beside them.

        Raises:
          ValueError: a batch that does not divide by the devices it is laid out for
            (every process's rows together), or whose leaves disagree on their rows.
        """
        rows = jax.tree.map(np.asarray, batch)
        n = len(self.origin)
        if self.presplit:
            rows = join_presplit(rows, n)
        what = "devices the batches are laid out for (fit(global_batches=True): every row)"
        per = validate.batch(rows, n, what=what) // n
        shared = Shared(rows, np.repeat(self.owners, per), everyone=True, as_given=batch)
        return Item(self.local(batch), seq, shared=shared, placed=placed)


class Tagged(Carry):
    """A carry whose rows are ``(rows, owner)``: the batch and the process each row came
    from, kept together through every join and split."""

    def user_rows(self, rows: Any) -> Any:
        """The batch's rows less their owners (what a warning describes)."""
        return rows[0]


def exchange(
    rows: Any,
    per: int,
    origin: Sequence[jax.Device],
    devices: Sequence[jax.Device],
    ready: Callable[[jax.Array], None] = jax.block_until_ready,
) -> tuple[Any, np.ndarray]:
    """Every process's ``rows`` of one batch, on every process: the global batch in the
    layout of ``origin`` (chunk ``i``: ``origin[i]``'s), and the process each row came
    from. A collective over ``devices`` (the step's devices now): every process calls it
    with its rows of the same batch.

    Args:
      rows: this process's rows (host arrays): the chunks of its devices among
        ``origin``, in their order, joined.
      per: the rows of a chunk (the same on every process).
      origin: the devices the batch is laid out for.
      devices: the devices the rows travel through (each process holds at least one).
      ready: returns once the gathered rows can be read (the loop's raises a lost
        peer's error rather than wait for rows that will never come).
    """
    here = [k for k, d in enumerate(devices) if d.process_index == jax.process_index()]
    route = Route.of([d.process_index for d in origin], [d.process_index for d in devices], per)
    sharding, gather = _gather(tuple(devices))

    def place(x: np.ndarray) -> jax.Array:
        # as bytes: a device would make 64-bit values 32-bit (ids, hashes), bools ints
        width = x.dtype.itemsize * math.prod(x.shape[1:])
        raw = np.ascontiguousarray(x).view(np.uint8).reshape(len(x), width)
        padded = np.zeros((route.slot * len(here), raw.shape[1]), np.uint8)
        padded[: len(raw)] = raw
        parts = [
            jax.device_put(padded[j * route.slot : (j + 1) * route.slot], devices[k])
            for j, k in enumerate(here)
        ]
        shape = (route.slot * len(devices), raw.shape[1])
        return jax.make_array_from_single_device_arrays(shape, sharding, parts)

    leaves, tree = jax.tree.flatten(rows)
    gathered = gather([place(x) for x in leaves])
    if gathered:
        ready(gathered[0])
    back = []
    for g, x in zip(gathered, leaves, strict=True):  # back from bytes, in the data's order
        raw = np.asarray(g.addressable_data(0))[route.order]
        back.append(raw.view(x.dtype).reshape(len(raw), *x.shape[1:]))
    return jax.tree.unflatten(tree, back), route.owner


class Route(NamedTuple):
    """How one batch's rows travel (:func:`exchange`), the same on every process: each
    process's rows over its devices, ``slot`` rows a device (the last padded), and where
    the global batch's rows are in the gathered slots.

    Attributes:
      slot: the rows each device carries (the most any process needs, its rows over its
        devices, rounded up).
      order: for each row of the global batch (the layout of ``origin``), its index
        among the gathered slots (device ``k``'s are ``k * slot ..``).
      owner: for each row of the global batch, the process that passed it.
    """

    slot: int
    order: np.ndarray
    owner: np.ndarray

    @classmethod
    def of(cls, origin: Sequence[int], devices: Sequence[int], per: int) -> Route:
        """The route for batches laid out for devices of the processes ``origin`` (in the
        step's order before any left), ``per`` rows a chunk, travelling through devices
        of the processes ``devices``."""
        on = {p: [k for k, q in enumerate(devices) if q == p] for p in sorted(set(origin))}
        counts = {p: per * origin.count(p) for p in on}
        slot = max(-(-counts[p] // len(on[p])) for p in on)
        # each process's rows, in the order it passed them: its devices' slots, unpadded
        passed = {
            p: np.concatenate(
                [
                    k * slot + np.arange(max(0, min(slot, counts[p] - j * slot)))
                    for j, k in enumerate(ks)
                ]
            )
            for p, ks in on.items()
        }
        # then the chunks in the order of origin: each the next of its process's
        order, seen = [], dict.fromkeys(on, 0)
        for p in origin:
            order.append(passed[p][seen[p] * per : (seen[p] + 1) * per])
            seen[p] += 1
        owner = np.repeat(np.asarray(origin, dtype=np.int32), per)
        return cls(slot, np.concatenate(order), owner)


@functools.lru_cache(maxsize=8)
def _gather(devices: tuple[jax.Device, ...]) -> tuple[NamedSharding, Any]:
    """Rows sharded over ``devices`` (the sharding they are placed with), and a
    compiled copy of them onto every one of the devices (an all-gather)."""
    mesh = Mesh(np.array(devices), ("rows",))
    everywhere = NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, PartitionSpec("rows")), jax.jit(
        lambda tree: tree, out_shardings=everywhere
    )
