"""``shard_state="params"`` (FSDP, ZeRO-3): a device's own part of the step when the
parameters arrive as shards.

Each sharded parameter is gathered through :func:`checked_gather`, an all-gather whose
backward receives this device's own cotangent of the whole parameter, before any
device's is mixed in: it checks it (its sum of squares, non-finite exactly when the
cotangent is, the flag and the norm of ``gradient_health``), masks it when the device
is left out (``on_failure="drop"``) and reduce-scatters it. Autodiff's own transpose of
an all-gather would reduce-scatter it out of reach. The per-leaf sums leave the
backward as the cotangents of per-device scalar *probes*, so the health row has the
leaf and the norm as under the replicated layout. The loss runs under
``jax.checkpoint`` with :func:`regather_policy`: the backward gathers each parameter
again instead of keeping every gathered parameter alive.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import io_callback

from jaxstep._src.core import Batch
from jaxstep._src.core import PyTree
from jaxstep._src.core import Status
from jaxstep._src.core import TrainState
from jaxstep._src.core import health
from jaxstep._src.core import validate
from jaxstep._src.core.names import leaf_name
from jaxstep._src.program import _cross_checks as cross_checks
from jaxstep._src.program._chips import each_chip
from jaxstep._src.program._device import DeviceWork
from jaxstep._src.program._device import loss as loss_of
from jaxstep._src.program._device import microbatched_work
from jaxstep._src.program._device import status_bits
from jaxstep._src.program._faults import Armed
from jaxstep._src.program._faults import poisoned
from jaxstep._src.program._faults import spiked
from jaxstep._src.program._grid import Grid
from jaxstep._src.program._grid import Links
from jaxstep._src.program._local import Beat
from jaxstep._src.program._local import Here
from jaxstep._src.program._local import LocalPart
from jaxstep._src.program._local import chunk_key
from jaxstep._src.program._local import row_of
from jaxstep._src.program._model import unit_prints
from jaxstep._src.program._model_dims import model_dims
from jaxstep._src.program._options import Options
from jaxstep._src.program._padding import Pad
from jaxstep._src.program._padding import cut
from jaxstep._src.program._padding import pad_to
from jaxstep._src.program._policies import OnFailure
from jaxstep._src.program._shards import Plan

#: the ``checkpoint_name`` of a gathered parameter (never saved for the backward)
GATHERED = "jaxstep_gathered"


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def checked_gather(
    shard: jax.Array,
    probe: jax.Array,
    one: jax.Array,
    faults: tuple[jax.Array, jax.Array],
    scale: jax.Array,
    axis: int,
    links: Links,
    flags: tuple[bool, bool, bool, bool],
    pad: Pad | None,
) -> tuple[jax.Array, jax.Array]:
    """``(all_gather(shard), 0 * one)``. Backward: this device's own cotangent of the
    whole parameter, divided by ``scale`` (the loss scale, as ``DynamicLossScale.unscale``
    does); its sum of squares is ``probe``'s cotangent; it is zeroed when the cotangent
    of the second output (the drop mask) is 0, and reduce-scattered as ``shard``'s.
    ``faults``: an injected loss fault's factor (1: none) and gradient fault's value
    (0: none), applied to the cotangent before the check, each with a select (the
    arithmetic stays the step's own until a fault fires). ``flags``: (masked, spiked,
    poisoned, scaled), what the backward does of these (static). ``links``: the
    collectives of the device's group (a gather and a reduce-scatter inside it, and
    the scattered block summed across its twins, ``make_train_step(replicas=k)``).
    ``pad``: a leaf held padded (after an exclusion): the gathered leaf is cut to its
    logical length before the loss sees it, and the cotangent padded with zeros before
    it is scattered (the padding's gradient is 0: its optimizer state stays 0)."""
    del probe, faults, scale, flags
    whole = links.gather(shard, axis)
    return (whole if pad is None else cut(whole, axis, pad[0])), one * 0


def _gather_fwd(
    shard: jax.Array,
    probe: jax.Array,
    one: jax.Array,
    faults: tuple[jax.Array, jax.Array],
    scale: jax.Array,
    axis: int,
    links: Links,
    flags: tuple[bool, bool, bool, bool],
    pad: Pad | None,
) -> tuple[tuple[jax.Array, jax.Array], tuple[Any, jax.Array]]:
    out = checked_gather(shard, probe, one, faults, scale, axis, links, flags, pad)
    return out, (faults, scale)


def _gather_bwd(
    axis: int,
    links: Links,
    flags: tuple[bool, bool, bool, bool],
    pad: Pad | None,
    residuals: tuple[tuple[jax.Array, jax.Array], jax.Array],
    cotangents: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array, Any, jax.Array]:
    ((factor, poison), scale), (g, keep) = residuals, cotangents
    masked, spiked_loss, injected, scaled = flags
    if spiked_loss:  # an injected loss fault reaches the gradient as a real one would
        g = spiked(g, factor)
    if injected:  # an injected gradient fault is checked like a real one
        g = poisoned(g, poison)
    if scaled:  # unscaled before the sum, as the replicated step does (no overflow in it)
        g = (g.astype(jnp.float32) / scale).astype(g.dtype)
    squares = jnp.sum(jnp.square(g.astype(jnp.float32)))
    if masked:  # a cond, not a multiply (NaN * 0 is NaN): the healthy branch is free
        g = jax.lax.cond(keep > 0, lambda x: x, jnp.zeros_like, g)
    if pad is not None:
        g = pad_to(g, axis, pad[1])
    shard = links.scatter(g, axis)
    nothing = (jnp.zeros_like(factor), jnp.zeros_like(poison))
    return shard, squares, jnp.zeros_like(keep), nothing, jnp.zeros_like(scale)


checked_gather.defvjp(_gather_fwd, _gather_bwd)


def regather_policy(prim: Any, *_: Any, **params: Any) -> bool:
    """``jax.checkpoint`` policy: save everything but the gathered parameters, so the
    backward gathers each again (ZeRO-3's "reshard after forward"). Both the gather (a
    ``custom_vjp_call`` holding an ``all_gather``) and its name must be unsaveable:
    with the name alone, the named value's producer (the same array) is saved."""
    if str(prim) == "name":
        return bool(params["name"] != GATHERED)
    if str(prim) == "custom_vjp_call":
        return not _gathers(params.get("call_jaxpr"))
    return str(prim) != "all_gather"


def _gathers(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` holds an ``all_gather`` (a leaf split over the model axis
    gathers inside a ``shard_map`` nested over it: looked into)."""
    eqns = getattr(getattr(jaxpr, "jaxpr", jaxpr), "eqns", ())
    return any(
        str(e.primitive) == "all_gather"
        or (str(e.primitive) == "shard_map" and _gathers(e.params.get("jaxpr")))
        for e in eqns
    )


def gathered_work(
    options: Options,
    state: TrainState,
    batch: Batch,
    key: jax.Array | None,
    model_state: PyTree,
    faults: Armed,
    *,
    policy: OnFailure,
    plan: Plan,
    grid: Grid,
    check_replicas: bool,
    keep: jax.Array | None,
) -> tuple[DeviceWork, tuple[str, ...]]:
    """``device_work`` with the sharded parameters gathered through
    :func:`checked_gather`. Its gradients: each sharded leaf's already
    reduce-scattered (this device's shard of the sum), each replicated leaf's local;
    its health: the local cotangents'. ``keep``: 0 leaves this device's cotangents out
    of the sums (None: as ``policy`` keeps them, by what its forward pass tells);
    ``check_replicas``: the gathered copies' fingerprints come back too."""
    batch = faults.input(batch)
    in_bad, in_leaf = health.first_nonfinite(jax.tree.leaves(batch))  # before the backward
    validate.rng_for(options.loss_fn, key is not None)  # at trace time only
    shards, treedef = jax.tree.flatten(state.params)
    gathering = Gathering(options, plan, grid, state, faults, masked=policy.leaves_out)
    args = (batch,) if key is None else (batch, key)

    def f(shards: list[jax.Array], probes: list[jax.Array], one: jax.Array) -> Any:
        full, sink = gathering.gather(shards, probes, one)
        params = jax.tree.unflatten(treedef, full)
        value, aux = loss_of(options, params, *args, model_state=model_state)
        copies = None
        if check_replicas:  # this device's gathered copies: a bad link shows here
            copies = (cross_checks.fingerprint(full), health.first_nonfinite(full)[1])
        return (gathering.scaled(value), sink), (value, aux, copies)

    probes = [jnp.zeros((), jnp.float32) for _ in gathering.indices]
    (scaled, _), vjp, (value, aux, copies) = jax.vjp(
        jax.checkpoint(f, policy=regather_policy),
        shards,
        probes,
        jnp.ones((), jnp.float32),
        has_aux=True,
    )
    checks, aux = validate.checks(aux)
    new_ms, aux = validate.model_state(aux, model_state)
    ms_bad, ms_leaf = health.first_nonfinite(jax.tree.leaves(new_ms))
    check_failed = ~jnp.stack(list(checks.values())) if checks else jnp.zeros((0,), bool)
    # an injected loss fault, as it fires: the forward's verdict below sees it (a
    # device whose loss the fault made non-finite is left out under drop before its
    # cotangent is scattered, as a device whose own loss is)
    value = spiked(value, gathering.factor)
    if keep is None:  # what the forward tells, before any cotangent is scattered
        forward = in_bad | ~jnp.isfinite(value) | ms_bad | health.any_true(check_failed)
        keep = policy.forward_keep(forward)
    grads, flags, _ = vjp((jnp.ones_like(scaled), keep))
    grads, squares, grad_leaf = gathering.local_health(grads, flags)
    status = status_bits(options, in_bad, value, ~jnp.isfinite(squares), ms_bad, check_failed)
    prints, param_leaf = (None, None) if copies is None else copies
    work = DeviceWork(
        jax.tree.unflatten(treedef, grads),
        new_ms,
        status,
        in_leaf,
        squares,
        grad_leaf,
        ms_leaf,
        check_failed,
        value,
        aux,
        prints,
        param_leaf,
    )
    return work, tuple(checks)


class Gathering:
    """One device's gathers of its sharded parameters (traced): each through a
    :func:`checked_gather` with this device's injected gradient fault and the loss
    scale, and what its backward tells (the gathered leaves' squares and first
    non-finite one) joined with the replicated leaves' own health."""

    def __init__(
        self,
        options: Options,
        plan: Plan,
        grid: Grid,
        state: TrainState,
        faults: Armed,
        *,
        masked: bool,
    ):
        self.options, self.plan, self.links = options, plan, grid.links
        #: each parameter's dimension over the model axis (its gather runs per chip)
        self.model = model_dims(options, state.params)
        self.masked = masked  # the drop mask's cotangent leaves a device out
        self.scaler, self.scale = options.loss_scale, state.loss_scale
        self.scaling = self.scaler is not None and self.scale is not None
        #: the positions of the gathered (sharded) leaves, and of the replicated ones
        self.indices = [i for i, a in enumerate(plan.params) if a is not None]
        self.local = [i for i, a in enumerate(plan.params) if a is None]
        names = [leaf_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.params)]
        self.poisons: list[jax.Array | None] = [None] * len(names)
        #: an injected loss fault's factor (None: the step has none)
        self.factor = faults.loss_factor()
        self.poisons = [faults.leaf_value("grad", names, i) for i in range(len(names))]

    def gather(
        self, shards: list[jax.Array], probes: list[jax.Array], one: jax.Array
    ) -> tuple[list[jax.Array], jax.Array]:
        """The whole parameters (the replicated leaves as they are) and the sink the
        drop mask's cotangent flows back through."""
        full, sink = list(shards), jnp.zeros((), jnp.float32)
        factor = (
            self.scale.scale
            if self.scaling and self.scale is not None
            else jnp.ones((), jnp.float32)
        )
        masked = self.masked
        spiking, nothing = self.factor is not None, jnp.zeros((), jnp.float32)
        for k, i in enumerate(self.indices):
            poison = self.poisons[i]
            faults = (
                jnp.ones((), jnp.float32) if self.factor is None else self.factor,
                nothing if poison is None else poison,
            )
            x, z = checked_gather(
                shards[i],
                probes[k],
                one,
                faults,
                factor,
                self.plan.params[i],
                self.links.of_leaf(self.model[i]),
                (masked, spiking, poison is not None, self.scaling),
                None if (held := self.plan.param_pads[i]) is None else held[1],
            )
            full[i] = checkpoint_name(x, GATHERED)
            sink = sink + z
        return full, sink

    def scaled(self, value: jax.Array) -> jax.Array:
        """The loss the backward starts from (times the loss scale, when there is one)."""
        if self.scaler is None or self.scale is None:
            return value
        return self.scaler.scale_loss(self.scale, value)

    def local_health(
        self, grads: list[jax.Array], flags: list[jax.Array]
    ) -> tuple[list[jax.Array], jax.Array, jax.Array]:
        """The replicated leaves' local gradients with their faults and unscaled (the
        gathered leaves' came back unscaled), the squared norm of every local cotangent
        and the first non-finite leaf in tree order (``flags``: the gathered leaves'
        squares from their backward)."""
        grads = list(grads)
        for i in self.local:  # the replicated leaves' faults, on their local gradients
            grads[i] = poisoned(spiked(grads[i], self.factor), self.poisons[i])
        if self.scaler is not None and self.scale is not None:
            unscaled = self.scaler.unscale(self.scale, [grads[i] for i in self.local])
            for i, g in zip(self.local, unscaled, strict=True):
                grads[i] = g
        squares, first_local, _ = health.gradient_health([grads[i] for i in self.local])
        gathered_first = health.first_true([~jnp.isfinite(q) for q in flags], self.indices)
        local_first = jnp.where(
            first_local >= 0,
            jnp.asarray(self.local or [0], jnp.int32)[jnp.maximum(first_local, 0)],
            -1,
        )
        gathered_squares = sum(flags, jnp.zeros((), jnp.float32))
        return grads, squares + gathered_squares, health.earliest(gathered_first, local_first)


def local_part(
    options: Options,
    policy: OnFailure,
    plan: Plan,
    grid: Grid,
    state: TrainState,
    batch: Batch,
    at: Here,
    *,
    beat: Beat | None,
    check_replicas: bool,
    sharded: Sequence[bool],
) -> tuple[LocalPart, Callable[[jax.Array], tuple[PyTree, PyTree]]]:
    """:func:`jaxstep._src.program._local.local_part` under ``"params"``: the parameters'
    gathers are its first collectives, so the heartbeat comes before them (a device
    that stalls blocks the others in its first gather). Returns the part and its
    ``rerun(left_out)``: the work again with this device's cotangents zeroed when
    ``left_out`` (``drop``: after a failure only its gradients showed)."""
    token = at.token
    if beat is not None:  # every gather waits for the beat
        m = options.model_parallel

        def tell(chip: jax.Array, position: jax.Array, number: jax.Array, t: jax.Array) -> Any:
            # each device of a model group beats by its place in the mesh's order
            shape = jax.ShapeDtypeStruct((), jnp.int32)
            return io_callback(beat, shape, position * m + chip, number, t)

        done = each_chip(m, tell, at.position, state.step, jnp.maximum(token, 0))
        zero = jnp.minimum(done, 0)
        token = token + zero
        params = jax.tree.map(lambda x: x + zero.astype(x.dtype), state.params)
        state = dataclasses.replace(state, params=params)
    key = chunk_key(state, at.chunk)

    def work(
        keep: jax.Array | None, checked: bool
    ) -> tuple[DeviceWork, jax.Array, tuple[str, ...]]:
        fn = functools.partial(
            gathered_work, policy=policy, plan=plan, grid=grid, check_replicas=checked, keep=keep
        )
        return microbatched_work(
            options, state, batch, key, at.faults, options.microbatches, fn, scattered=True
        )

    found, microbatch, check_names = work(None, check_replicas)
    status = found.status | jnp.minimum(token, 0)  # keeps an injected stall ahead
    row = row_of(found, found.grad_leaf, found.grad_squares, microbatch)
    prints = None
    if check_replicas:
        assert found.prints is not None and found.param_leaf is not None
        if grid.grouped:  # every leaf as this device holds it: a shard among its twins
            prints = unit_prints(options, state, None, at.prints)
        else:  # a shard: its gathered copy (a bad link shows)
            rest = len(jax.tree.leaves((state.opt_state, state.model_state)))
            base = jnp.concatenate([found.prints, jnp.zeros((rest,), jnp.uint32)])
            prints = unit_prints(options, state, sharded, at.prints, base)
        row["param_leaf"] = found.param_leaf
        status |= jnp.where(found.param_leaf >= 0, int(Status.PARAM_NONFINITE), 0)
    row["status"] = status

    def rerun(left_out: jax.Array) -> tuple[PyTree, PyTree]:
        again = work(jnp.where(left_out, 0.0, 1.0), False)[0]
        return again.grads, again.model_state

    return LocalPart(found, found.grads, row, prints, check_names), rerun
