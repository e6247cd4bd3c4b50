"""The one place a step's options are spelled: :class:`Options`, built and checked once
by :func:`jaxstep.make_train_step`, read by every layer below it (the traced program,
the host driver, its inputs)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jaxstep._src.core import BACKEND_NAMES
from jaxstep._src.core import POLICIES
from jaxstep._src.core import SHARD_STATES
from jaxstep._src.core import BackendName
from jaxstep._src.core import Policy
from jaxstep._src.core import ShardState
from jaxstep._src.core import processes
from jaxstep._src.core import validate
from jaxstep._src.program._chips import MODEL_AXIS
from jaxstep._src.program._cross_checks import DEFAULT_DIVERGENCE_EVERY
from jaxstep._src.program._cross_checks import LossSpike
from jaxstep._src.program._faults import NO_FAULTS
from jaxstep._src.program._faults import Armed
from jaxstep._src.program._faults import Context
from jaxstep._src.program._faults import Fault
from jaxstep._src.program._faults import Injector
from jaxstep._src.program._padding import Kept
from jaxstep._src.program._scaling import DynamicLossScale
from jaxstep._src.program._shards import DEFAULT_SHARD_MIN_SIZE
from jaxstep._src.program._shards import ShardRule

AXIS = "devices"  # the default collective axis name (make_train_step(axis_name=...))
#: ``model_rule(path, shape) -> dim | None``: the dimension of a parameter split over the
#: model axis (None: whole on every device of a model group)
ModelRule = Callable[[str, tuple[int, ...]], "int | None"]


@dataclasses.dataclass(frozen=True)
class Options:
    """Everything a step is built with (the keywords of :func:`jaxstep.make_train_step`,
    documented there), checked once in ``__post_init__``; ``TrainStep.options``.

    It lives in the program layer, next to the traced code that reads most of it, and
    is also what that code is a function of (the traced per-device program takes it
    whole: there is no second, partial copy of the options): here the classes it
    checks against (:class:`LossSpike`, :class:`DynamicLossScale`, :class:`Fault`) are
    importable without reaching up a layer, and the host driver above reads it as is.
    Besides the options it holds what follows from them alone: ``injector`` (the
    faults resolved against the devices) and ``device_ids``.

    With ``model_parallel = m > 1`` the devices the user passes form model groups of
    ``m`` consecutive devices; ``devices`` then holds each group's first device (the
    unit the host speaks of: chunk ``i`` runs on group ``i``, row ``i`` of the health
    table is it, ``device_ids[i]`` names it) and ``groups`` every device of each.

    Raises:
      ValueError, TypeError: an option is invalid; the message names it and the fix.
    """

    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    backend: BackendName = "shard_map"
    #: the step's devices, in order (a tuple; ``make_train_step`` resolves None)
    devices: Sequence[jax.Device] = dataclasses.field(default_factory=jax.devices)
    has_aux: bool = False
    on_failure: Policy = "raise"
    max_consecutive_skips: int | None = 10
    max_dropped: int | None = None
    max_consecutive_drops: int | None = 3
    divergence_every: int | None = DEFAULT_DIVERGENCE_EVERY
    loss_spike: LossSpike | None = None
    verify_update: bool = False
    faults: Sequence[Fault] = ()
    donate: bool = True
    axis_name: str = AXIS
    microbatches: int = 1
    loss_scale: DynamicLossScale | None = None
    shard_state: ShardState | None = None
    shard_min_size: int = DEFAULT_SHARD_MIN_SIZE
    replicas: int = 1
    shard_rule: ShardRule | None = None
    model_parallel: int = 1
    model_rule: ModelRule | None = None
    #: the model groups, each a tuple of ``model_parallel`` devices, in order (internal:
    #: set from ``devices`` when empty; a step rebuilt after an exclusion passes them
    #: along with its ``devices``, each group's first device, and keeps those groups)
    groups: tuple[tuple[jax.Device, ...], ...] = ()
    #: after ``TrainStep.exclude_devices`` under ``shard_state`` with one group: the
    #: layout kept from before (each leaf's axis; a leaf it no longer divides held
    #: padded), which replaces the rule; None otherwise (internal: not a keyword)
    kept: Kept | None = None
    #: the faults resolved against the devices (what the traced program injects)
    injector: Injector = dataclasses.field(init=False, repr=False, compare=False)
    #: ``jax.Device.id`` of each device, in order
    device_ids: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check(self)
        _check_model(self)
        devices, groups = _groups(self)
        if self.backend == "pmap" and processes.spans_processes(devices):
            raise ValueError(
                "backend='pmap' with devices of several processes is not supported: use "
                "backend='shard_map' (the default; the same checks, state replicated), or "
                "pass devices=jax.local_devices() for one process's devices"
            )
        set_ = object.__setattr__  # frozen: normalized once, here
        set_(self, "devices", devices)
        set_(self, "groups", groups)
        set_(self, "faults", tuple(self.faults))
        set_(self, "injector", Injector(self.faults, devices, groups))
        set_(self, "device_ids", tuple(d.id for d in devices))
        if self.n % self.replicas:
            units = (
                f"{self.n} devices"
                if self.model_parallel == 1
                else f"{self.n} model groups ({self.n * self.model_parallel} devices, "
                f"model_parallel={self.model_parallel})"
            )
            raise ValueError(
                f"replicas={self.replicas} does not divide the {units}: the step's "
                f"devices form replicas groups of equal size; pass a divisor of {self.n} "
                f"(e.g. {_divisors(self.n)}) or other devices"
            )
        if self.max_dropped is not None and not 0 <= self.max_dropped < self.n:
            raise ValueError(
                f"max_dropped must be None or 0 <= max_dropped < {self.n} (the device "
                f"count: a step needs one healthy device), got {self.max_dropped!r}"
            )

    @property
    def n(self) -> int:
        """The number of devices (of model groups, under ``model_parallel``: the units
        that each take a chunk of the batch and a row of the health table)."""
        return len(self.device_ids)

    @property
    def mesh_devices(self) -> tuple[jax.Device, ...]:
        """Every device of the step, in order (``devices`` and the rest of each model
        group)."""
        return tuple(d for g in self.groups for d in g)

    def group_ids(self, device_id: int) -> tuple[int, ...]:
        """The ids of the model group holding device ``device_id`` (``(device_id,)``
        without a model axis; ``()`` for a device not in the step)."""
        return next(
            (tuple(d.id for d in g) for g in self.groups if device_id in {d.id for d in g}), ()
        )

    @functools.cached_property
    def mesh(self) -> Mesh:
        """The step's mesh: one axis (``axis_name``) over the devices; under
        ``model_parallel = m > 1``, ``(axis_name, MODEL_AXIS)`` of shape ``(n, m)``,
        a model group a row."""
        devices = np.array(self.mesh_devices, dtype=object)
        if self.model_parallel == 1:
            return Mesh(devices, (self.axis_name,))
        return Mesh(devices.reshape(self.n, self.model_parallel), (self.axis_name, MODEL_AXIS))

    def on_devices(self, fn: Callable[..., Any], in_specs: Any, out_specs: Any) -> Any:
        """``fn`` mapped over the step's mesh with ``jax.shard_map``: manual over the
        data axis (``axis_name``); under ``model_parallel`` the model axis is left to
        XLA, so ``fn`` sees each leaf with its global shape and the model group
        partitions it."""
        manual = {} if self.model_parallel == 1 else {"axis_names": frozenset({self.axis_name})}
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False, **manual
        )

    def summary(self) -> str:
        """The loss's name and the options that differ from the defaults, for a step's
        ``repr``."""
        ids = list(self.device_ids)
        shown = ids if len(ids) <= 8 else [*ids[:4], "...", *ids[-2:]]
        parts = [
            f"backend={self.backend!r}",
            f"devices={len(ids)} {shown} ({self.devices[0].platform})",
            f"on_failure={self.on_failure!r}",
            f"axis_name={self.axis_name!r}",
            f"divergence_every={self.divergence_every}",
        ]
        optional = {
            "microbatches": self.microbatches if self.microbatches != 1 else None,
            "loss_spike": self.loss_spike,
            "loss_scale": self.loss_scale,
            "verify_update": self.verify_update or None,
            "shard_state": self.shard_state,
            "replicas": self.replicas if self.replicas != 1 else None,
            "shard_rule": getattr(self.shard_rule, "__name__", "rule") if self.shard_rule else None,
            "model_parallel": self.model_parallel if self.model_parallel != 1 else None,
            "model_rule": getattr(self.model_rule, "__name__", "rule") if self.model_rule else None,
            "faults": len(self.faults) or None,
            "max_consecutive_skips": (
                self.max_consecutive_skips if self.on_failure == "skip" else None
            ),
        }
        parts += [f"{k}={v!r}" for k, v in optional.items() if v is not None]
        name = getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)
        return f"{name}, {', '.join(parts)}"

    def arm(
        self,
        step: jax.Array,
        chunk: jax.Array,
        rows: int | jax.Array,
        fired: jax.Array | None,
        *,
        position: jax.Array | None = None,
        device_id: jax.Array | None = None,
    ) -> Armed:
        """The faults of the device at ``position`` (or ``device_id``: -1 for none) at
        ``step``, holding ``rows`` of chunk ``chunk`` (a count: all of them), with
        ``fired`` the transient ones that fired already (None: none): the one seam the
        traced step injects through (:data:`NO_FAULTS` when the step has none)."""
        if not self.injector:
            return NO_FAULTS
        if device_id is None:
            device_id = jnp.asarray(self.device_ids, jnp.int32)[position]
        if fired is None:
            fired = jnp.zeros(len(self.injector.faults), bool)
        rows = jnp.arange(rows) if isinstance(rows, int) else rows
        return Armed(self.injector, Context(step, device_id, chunk, rows, fired))

    @property
    def group_size(self) -> int:
        """The devices a sharded leaf is split over: ``n / replicas``."""
        return self.n // self.replicas

    @property
    def dropped_limit(self) -> int:
        """``on_failure="drop"``: the most devices one step may leave out (default:
        fewer than half)."""
        return (self.n - 1) // 2 if self.max_dropped is None else self.max_dropped


def _check(options: Options) -> None:
    """The checks of every option but the devices, in the order make_train_step made
    them (the first invalid option is the one named)."""
    o = options
    if not callable(o.loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(o.loss_fn).__name__}")
    if not (hasattr(o.optimizer, "init") and hasattr(o.optimizer, "update")):
        raise TypeError(
            f"optimizer must be an optax.GradientTransformation, got "
            f"{type(o.optimizer).__name__}; e.g. optax.adam(1e-3)"
        )
    if o.backend not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {o.backend!r}; expected 'shard_map' or 'pmap'")
    if o.on_failure not in POLICIES:
        raise ValueError(
            f"unknown on_failure policy {o.on_failure!r}; expected 'raise', 'skip' or 'drop'"
        )
    if not (isinstance(o.axis_name, str) and o.axis_name):
        raise TypeError(f"axis_name must be a non-empty str, got {o.axis_name!r}")
    validate.positive_or_none("max_consecutive_skips", o.max_consecutive_skips)
    validate.positive_or_none("max_consecutive_drops", o.max_consecutive_drops)
    if o.max_dropped is not None and (
        isinstance(o.max_dropped, bool) or not isinstance(o.max_dropped, int)
    ):
        raise TypeError(f"max_dropped must be an int or None, got {o.max_dropped!r}")
    validate.positive_or_none("microbatches", o.microbatches)
    if o.loss_scale is not None and not isinstance(o.loss_scale, DynamicLossScale):
        raise TypeError(
            f"loss_scale must be a jaxstep.DynamicLossScale or None, got {o.loss_scale!r}"
        )
    validate.positive_or_none("divergence_every", o.divergence_every)
    _check_sharding(o)
    if o.loss_spike is not None and not isinstance(o.loss_spike, LossSpike):
        raise TypeError(f"loss_spike must be a jaxstep.LossSpike or None, got {o.loss_spike!r}")
    for f in o.faults:
        if not isinstance(f, Fault):
            raise TypeError(f"faults must hold jaxstep.testing.Fault objects, got {f!r}")
        if f.kind == "param" and not o.verify_update:
            raise ValueError(
                f"{f!r} corrupts the checked new parameters, which only verify_update=True "
                "checks: build the step with verify_update=True"
            )
        if f.kind == "stall" and o.replicas > 1:
            raise ValueError(
                f"{f!r} needs a host callback inside the step, which a step with "
                f"replicas={o.replicas} cannot hold: its program spans two meshes (the "
                "state's and the step's), and JAX lowers a callback only in a program on "
                "one mesh; test a hang with replicas=1"
            )


def _check_sharding(o: Options) -> None:
    """``shard_state`` and ``shard_min_size``."""
    if o.shard_state is not None and o.shard_state not in SHARD_STATES:
        raise ValueError(
            f"unknown shard_state {o.shard_state!r}; expected None (every device holds the "
            "whole state), 'optimizer' (ZeRO-1: the optimizer state sharded) or 'params' "
            "(FSDP: parameters and optimizer state sharded)"
        )
    if o.shard_state is not None and o.backend != "shard_map":
        raise ValueError(
            f"shard_state={o.shard_state!r} needs backend='shard_map': a pmap step holds "
            "every state leaf whole on each device and cannot shard one; build the step "
            "with backend='shard_map' (the default), or with shard_state=None"
        )
    size = o.shard_min_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise TypeError(
            f"shard_min_size must be an int >= 0 (elements: smaller leaves stay "
            f"replicated), got {size!r}"
        )
    k = o.replicas
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise TypeError(f"replicas must be an int >= 1 (groups of devices), got {k!r}")
    if k > 1 and o.shard_state is None:
        raise ValueError(
            f"replicas={k} needs shard_state: replicas groups hold a sharded state, whole "
            "in each group (HSDP); pass shard_state='params' or 'optimizer', or replicas=1 "
            "(without shard_state every device holds the whole state already)"
        )
    if o.shard_rule is not None and not callable(o.shard_rule):
        raise TypeError(
            f"shard_rule must be a function (path, shape) -> axis | None, got {o.shard_rule!r}"
        )
    if o.shard_rule is not None and o.shard_state is None:
        raise ValueError(
            "shard_rule needs shard_state: the rule says where the sharded state's leaves "
            "are split; pass shard_state='params' or 'optimizer'"
        )


def _check_model(o: Options) -> None:
    """``model_parallel`` and ``model_rule`` (the devices are checked with the groups)."""
    m = o.model_parallel
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise TypeError(f"model_parallel must be an int >= 1 (devices per model group), got {m!r}")
    if o.model_rule is not None and not callable(o.model_rule):
        raise TypeError(
            f"model_rule must be a function (path, shape) -> dim | None, got {o.model_rule!r}"
        )
    if m == 1:
        return
    if o.backend == "pmap":
        raise ValueError(
            f"model_parallel={m} needs backend='shard_map': pmap maps one device per "
            "chunk and cannot split a parameter over a model group; build the step with "
            "backend='shard_map' (the default)"
        )
    if o.axis_name == MODEL_AXIS:
        raise ValueError(
            f"axis_name={o.axis_name!r} is the model axis's name (jaxstep.MODEL_AXIS) under "
            "model_parallel: pass another axis_name (the default 'devices')"
        )


def _groups(o: Options) -> tuple[tuple[jax.Device, ...], tuple[tuple[jax.Device, ...], ...]]:
    """The step's units (each model group's first device) and its model groups."""
    if o.groups:  # rebuilt (an exclusion): the groups whose first device stays
        leads = {g[0].id: g for g in o.groups}
        given = [d for d in o.devices]
        if all(d.id in leads for d in given):
            groups = tuple(leads[d.id] for d in given)
            return tuple(g[0] for g in groups), groups
    every = validate.devices(o.devices)
    m = o.model_parallel
    if len(every) % m:
        raise ValueError(
            f"model_parallel={m} does not divide the {len(every)} devices: the devices form "
            f"model groups of {m} consecutive devices; pass a model_parallel of "
            f"{_divisors(len(every))}, or devices=jax.devices()[:{len(every) // m * m}]"
        )
    groups = tuple(tuple(every[i : i + m]) for i in range(0, len(every), m))
    for g in groups:
        if len({d.process_index for d in g}) > 1:
            raise ValueError(
                f"model group of devices {[d.id for d in g]} spans processes "
                f"{sorted({d.process_index for d in g})}: a model group's collectives run "
                "on one host's fast interconnect; pass a model_parallel that divides each "
                "process's device count (order devices process by process)"
            )
    return tuple(g[0] for g in groups), groups


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
