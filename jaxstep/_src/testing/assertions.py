"""Assertions for tests of training code: exactly this device failed, the replicas
agree, a run matches plain single-device optax. Each raises ``AssertionError`` with a
message that says what was expected, what happened and where."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxstep._src.core import HostKey
from jaxstep._src.core import Status
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import TrainState
from jaxstep._src.core.names import without_root
from jaxstep._src.step import TrainStep
from jaxstep._src.step import runtime_of

_UNCHECKED: Any = object()


def assert_fails(
    err_or_callable: TrainingWorkerError | Callable[[], Any] | Any,
    *,
    device_id: int | Sequence[int],
    step: int,
    status: Status | int = _UNCHECKED,
    leaf: str | None = _UNCHECKED,
    has_status: Status | int = _UNCHECKED,
) -> TrainingWorkerError:
    """Asserts that a run failed on exactly this device, at this step, for this cause.

    Checks ``err.device_id``, ``err.step``, and that the error blames this device and
    no other (a healthy device blamed fails the assertion), then the status flags and
    the leaf, when given. Blamed are ``err.root_causes``: a device whose failure
    follows from the first's through a collective in the model (cross-device
    BatchNorm spreads one device's NaN input to every device's loss; the message says
    "likely follows from device 3's input") is not blamed.

    Args:
      err_or_callable: a :class:`jaxstep.TrainingWorkerError`, a
        ``pytest.raises(...)`` result holding one, or a function of no arguments that
        should raise one (e.g. ``lambda: jaxstep.fit(step, state, batches)``).
      device_id: the ``jax.Device.id`` that must fail (not its position); a sequence
        (in any order) when several devices fail at that step; the first failure
        (``err.device_id``) must be one of them.
      step: the step that must fail.
      status: the exact :class:`jaxstep.Status` flags of the first failing device. A
        NaN in the input also makes the loss and gradients non-finite:
        ``Status.INPUT_NONFINITE | Status.LOSS_NONFINITE | Status.GRAD_NONFINITE``.
        Omitted: not checked.
      has_status: flags the first failing device must have, among others (e.g.
        ``Status.INPUT_NONFINITE`` where BatchNorm adds ``MODEL_STATE_NONFINITE``).
        Omitted: not checked.
      leaf: the ``jax.tree_util.keystr`` of the leaf named, e.g. ``"['w']"`` (a
        parameter also as ``"params['w']"``, as ``corrupt_replica`` takes it), or None
        for a failure without one. Omitted: not checked.

    Returns:
      The error, for further checks.

    Raises:
      AssertionError: the run did not fail, or failed elsewhere, or otherwise.

    Example:
      >>> import jaxstep
      >>> from jaxstep.testing import Fault, assert_fails, tiny_step
      >>> tiny = tiny_step(faults=[Fault("grad", device_id=3, step=1, leaf="['w']")])
      >>> err = assert_fails(
      ...     lambda: jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3), diagnose=False),
      ...     device_id=3, step=1, status=jaxstep.Status.GRAD_NONFINITE, leaf="['w']")
      >>> err.reason
      "non-finite gradient in ['w']"
    """
    __tracebackhide__ = True  # pytest: report the failure at the caller
    want_ids = [device_id] if isinstance(device_id, int) else list(device_id)
    want = f"a failure on device {_ids(want_ids)} at step {step}"
    if status is not _UNCHECKED:
        want += f" with status {_flags(status)}"
    if has_status is not _UNCHECKED:
        want += f" with status including {_flags(has_status)}"
    if leaf is not _UNCHECKED:
        want += f" in leaf {leaf!r}"
    err = _error(err_or_callable, want)
    problems = []
    got_ids = [f.device_id for f in err.root_causes]
    followers = [f.device_id for f in err.failures if f.device_id not in got_ids]
    if sorted(got_ids) != sorted(want_ids) or err.device_id not in want_ids:
        healthy_blamed = [i for i in got_ids if i not in want_ids]
        missed = [i for i in want_ids if i not in got_ids]
        parts = [f"failing devices are {_ids([f.device_id for f in err.failures])}"]
        if followers:
            parts[0] += f" ({_ids(followers)} follow from device {err.device_id}: not blamed)"
        if healthy_blamed:
            parts.append(f"blamed, but should be healthy: {_ids(healthy_blamed)}")
        if missed:
            parts.append(f"not blamed: {_ids(missed)}")
        problems.append("; ".join(parts))
    if err.step != step:
        problems.append(f"failed at step {err.step}, not {step}")
    if status is not _UNCHECKED and err.status != status:
        problems.append(f"status is {_flags(err.status)}, not {_flags(status)}")
    if has_status is not _UNCHECKED and (err.status & has_status) != has_status:
        problems.append(f"status is {_flags(err.status)}, without {_flags(has_status)}")
    if leaf is not _UNCHECKED and without_root(err.leaf, "params") != without_root(leaf, "params"):
        problems.append(f"leaf is {err.leaf!r}, not {leaf!r}")
    if problems:
        raise AssertionError(
            f"expected {want}, but: " + "; ".join(problems) + f"\nthe error was:\n{err}"
        )
    return err


def assert_replicas_equal(step: TrainStep, tree: Any) -> None:
    """Asserts that every device holds the same copy of ``tree``, bit for bit.

    ``tree`` is a replicated (or, under pmap, stacked) pytree from ``step``: a
    ``TrainState``, ``state.params``, ... Data parallel training keeps the copies
    identical; one that differs is a diverged replica.

    Args:
      step: the step that placed ``tree``.
      tree: the replicated pytree to compare.

    Raises:
      AssertionError: naming the devices whose copy differs from the majority's, and
        the leaves that differ (``chex.assert_trees_all_equal``'s report).

    Example:
      >>> from jaxstep.testing import assert_replicas_equal, tiny_step
      >>> tiny = tiny_step(divergence_every=None)
      >>> assert_replicas_equal(tiny.step, tiny.state())  # every copy alike: passes
    """
    __tracebackhide__ = True  # pytest: report the failure at the caller
    runtime = runtime_of(step)
    copies = [_raw_keys(runtime.read_at(tree, i)) for i in range(len(step.devices))]
    ids = [d.id for d in step.devices]
    # Group equal copies; the largest group is taken as the correct one.
    groups: list[list[int]] = []
    for i, copy in enumerate(copies):
        for group in groups:
            if _equal(copies[group[0]], copy):
                group.append(i)
                break
        else:
            groups.append([i])
    if len(groups) == 1:
        return
    groups.sort(key=len, reverse=True)
    major = groups[0]
    lines = [f"the replicas differ: devices {_ids([ids[i] for i in major])} agree, and"]
    for group in groups[1:]:
        try:
            chex.assert_trees_all_equal(copies[major[0]], copies[group[0]])
            diff = "(no difference found by chex)"
        except AssertionError as e:
            diff = str(e)
        lines.append(f"devices {_ids([ids[i] for i in group])} hold another copy: {diff}")
    raise AssertionError("\n".join(lines))


def assert_matches_reference(
    step: TrainStep,
    params: Any,
    batches: Iterable[Any],
    *,
    model_state: Any = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> TrainState:
    """Trains ``step`` from ``params`` on ``batches`` and asserts that after every step
    the mean loss and the parameters (and the model state) match a plain single-device
    optax loop.

    The reference is what data parallelism promises: the loss is the mean over
    devices of ``loss_fn`` on each device's chunk (evaluated with ``jax.vmap`` over
    the chunks, under the step's axis name, so a loss that uses collectives works),
    its gradient goes through ``step.options.optimizer.update`` and ``optax.apply_updates``.

    Args:
      step: from ``jaxstep.make_train_step`` (the run starts from
        ``step.init(params, model_state=model_state)``, without ``rng``: a loss_fn that
        draws random numbers has no single-device reference).
      params: the initial parameters.
      model_state: the model's initial state (BatchNorm statistics), or None. The
        reference passes it to ``loss_fn(..., model_state=...)`` on each chunk and, as
        the step does, averages the float leaves of the new ones over the devices.
      batches: global batches, as for :func:`jaxstep.fit`.
      rtol, atol: tolerances of ``chex.assert_trees_all_close`` (the two sum the
        gradients in different orders).

    Returns:
      The final state of ``step``.

    Raises:
      AssertionError: a step failed, or its loss or parameters differ from the
        reference; the message names the step and the leaf.
      TypeError: ``loss_fn`` takes ``model_state`` and none was given (or the other
        way round); refused before anything runs.

    Example:
      >>> from jaxstep.testing import assert_matches_reference, tiny_step
      >>> tiny = tiny_step(divergence_every=None)
      >>> state = assert_matches_reference(tiny.step, tiny.params(), tiny.batches(3))
      >>> int(state.step)  # three steps, each as a single-device optax loop takes it
      3
    """
    __tracebackhide__ = True  # pytest: report the failure at the caller
    _model_state_matches(step.options.loss_fn, model_state)
    n = len(step.devices)
    state = step.init(params, model_state=model_state)
    ref_params = jax.tree.map(jnp.asarray, params)
    ref_ms = None if model_state is None else jax.tree.map(jnp.asarray, model_state)
    ref_opt = step.options.optimizer.init(ref_params)
    reference = _reference_step(step, n)
    for t, batch in enumerate(batches):
        state, out = step(state, batch)
        table = step.table(out)
        if table.failed:
            rows = jax.tree.leaves(batch)[0].shape[0] // n
            err = TrainingWorkerError(step.failures(table, rows))
            raise AssertionError(
                f"step {t} failed, so the run cannot match the single-device reference:\n{err}"
            )
        ref_params, ref_opt, ref_ms, ref_loss = reference(ref_params, ref_opt, ref_ms, batch)
        np.testing.assert_allclose(
            table.mean_loss,
            float(ref_loss),
            rtol=rtol,
            atol=atol,
            err_msg=f"step {t}: the mean loss differs from the single-device reference",
        )
        host = step.host_state(state)
        for what, got, want in (
            ("parameters", host.params, ref_params),
            ("model state", host.model_state, ref_ms),
        ):
            if want is None:
                continue
            try:
                chex.assert_trees_all_close(got, want, rtol=rtol, atol=atol)
            except AssertionError as e:
                raise AssertionError(
                    f"after step {t} the {what} differ from the single-device optax "
                    f"reference (tree 0: {step.options.backend} on {n} devices, tree 1: "
                    f"reference): {e}"
                ) from None
    return state


def _model_state_matches(loss_fn: Callable[..., Any], model_state: Any) -> None:
    """Refuses a call whose ``model_state`` does not match ``loss_fn``'s signature, which
    would otherwise fail inside the user's loss ("missing 1 required keyword-only
    argument") once the step is traced. A signature Python cannot read is not checked."""
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return
    name = f"{getattr(loss_fn, '__name__', type(loss_fn).__name__)}{sig}"
    param = sig.parameters.get("model_state")
    if model_state is None and param is not None and param.default is param.empty:
        raise TypeError(
            f"{name} takes model_state but assert_matches_reference got none: pass the "
            "model's initial state, assert_matches_reference(step, params, batches, "
            "model_state=...), as step.init(params, model_state=...) takes it. Nothing ran"
        )
    var_keyword = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    if model_state is not None and param is None and not var_keyword:
        raise TypeError(
            f"assert_matches_reference got model_state=, but {name} takes no model_state: "
            "add the keyword to loss_fn (it returns the new state in aux['model_state']), "
            "or leave model_state out. Nothing ran"
        )


def _reference_step(step: TrainStep, n: int) -> Callable[[Any, Any, Any, Any], Any]:
    axis = step.options.axis_name

    def mean_loss(params: Any, model_state: Any, batch: Any) -> tuple[jax.Array, Any]:
        chunks = jax.tree.map(lambda x: x.reshape((n, -1, *x.shape[1:])), batch)

        def one(chunk: Any) -> tuple[jax.Array, Any]:
            kwargs = {} if model_state is None else {"model_state": model_state}
            out = step.options.loss_fn(params, chunk, **kwargs)
            if not step.options.has_aux:
                return out, None
            loss, aux = out
            return loss, None if model_state is None else aux["model_state"]

        losses, new = jax.vmap(one, axis_name=axis)(chunks)
        # the step averages the float leaves of the new model state over the devices
        new = jax.tree.map(
            lambda x: jnp.mean(x, axis=0) if jnp.issubdtype(x.dtype, jnp.inexact) else x[0],
            new,
        )
        return jnp.mean(losses), new

    @jax.jit
    def update(
        params: Any, opt_state: Any, model_state: Any, batch: Any
    ) -> tuple[Any, Any, Any, jax.Array]:
        (loss, new_ms), grads = jax.value_and_grad(mean_loss, has_aux=True)(
            params, model_state, batch
        )
        updates, opt_state = step.options.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_ms, loss

    return update


def _error(err_or_callable: Any, want: str) -> TrainingWorkerError:
    if isinstance(err_or_callable, TrainingWorkerError):
        return err_or_callable
    held = getattr(err_or_callable, "value", None)  # pytest.raises(...) -> ExceptionInfo
    if isinstance(held, TrainingWorkerError):
        return held
    if not callable(err_or_callable):
        raise TypeError(
            "assert_fails takes a jaxstep.TrainingWorkerError, a pytest.raises() result "
            f"or a function that raises one, got {type(err_or_callable).__name__}"
        )
    try:
        err_or_callable()
    except TrainingWorkerError as err:
        return err
    raise AssertionError(f"expected {want}, but the run finished without a TrainingWorkerError")


def _raw_keys(tree: Any) -> Any:
    """Typed PRNG keys as their raw data, which chex compares like any array."""
    return jax.tree.map(
        lambda x: x.data if isinstance(x, HostKey) else x,
        tree,
        is_leaf=lambda x: isinstance(x, HostKey),
    )


def _equal(a: Any, b: Any) -> bool:
    try:
        chex.assert_trees_all_equal(a, b)
    except AssertionError:
        return False
    return True


def _ids(ids: Sequence[int]) -> str:
    return str(ids[0]) if len(ids) == 1 else str(list(ids))


def _flags(status: Status | int) -> str:
    names = [f.name for f in Status if f & int(status)]
    return " | ".join(f"Status.{name}" for name in names) or "Status(0)"
