"""``jaxstep doctor``: what a run would train on, and whether every device computes
the same bits. Lists the devices, runs one deterministic program on each local device
and compares the results bitwise (a silent-data-corruption scan: the majority's bits
are the reference), times a checked all-reduce, and prints the versions."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import platform
import socket
import time
from collections import Counter
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

PACKAGES = ("jax", "jaxlib", "optax", "flax", "chex", "numpy", "jaxstep")


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One device as JAX reports it."""

    device_id: int
    kind: str
    platform: str
    process_index: int
    host: str


@dataclasses.dataclass(frozen=True)
class ScanResult:
    """One device's run of the probe program.

    Attributes:
      device_id: ``jax.Device.id``.
      digest: sha256 of the result's bytes (first 16 hex digits).
      agrees: the bits equal the majority's.
      differing: how many elements differ from the majority's result.
      max_ulps: the largest distance from the majority's value, in units in the last
        place (0 when it agrees).
    """

    device_id: int
    digest: str
    agrees: bool
    differing: int
    max_ulps: int


@dataclasses.dataclass(frozen=True)
class AllReduce:
    """A timed ``psum`` over every device, its result checked exactly."""

    devices: int
    bytes_per_device: int
    seconds: float  # median of the timed runs
    correct: bool

    @property
    def bus_gbps(self) -> float:
        """NCCL's bus bandwidth: ``2 (n - 1) / n * bytes / time``, in GB/s."""
        n = self.devices
        return 2 * (n - 1) / max(n, 1) * self.bytes_per_device / self.seconds / 1e9


@dataclasses.dataclass(frozen=True)
class Report:
    """Everything ``jaxstep doctor`` found."""

    devices: list[DeviceInfo]
    scan: list[ScanResult]
    all_reduce: AllReduce
    versions: dict[str, str]

    @property
    def disagreeing(self) -> list[int]:
        """Ids of the devices whose probe result differs from the majority's."""
        return [r.device_id for r in self.scan if not r.agrees]

    @property
    def ok(self) -> bool:
        return not self.disagreeing and self.all_reduce.correct


def describe_devices(devices: Sequence[jax.Device]) -> list[DeviceInfo]:
    here, name = jax.process_index(), socket.gethostname()
    return [
        DeviceInfo(
            device_id=int(d.id),
            kind=str(d.device_kind),
            platform=str(d.platform),
            process_index=int(d.process_index),
            host=name if d.process_index == here else f"process {d.process_index}",
        )
        for d in devices
    ]


def _probe(key_data: jax.Array, size: int, rounds: int) -> jax.Array:
    """Matmuls, transcendentals and reductions from a fixed key: the same bits on
    every healthy device of one kind."""
    key = jax.random.wrap_key_data(key_data)
    x = jax.random.normal(key, (size, size), jnp.float32)
    w = jax.random.normal(jax.random.fold_in(key, 1), (size, size), jnp.float32) / np.sqrt(size)

    def body(_: int, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w) + 0.5 * jnp.sin(x) - 0.1 * jnp.exp(-jnp.abs(x))

    x = jax.lax.fori_loop(0, rounds, body, x)
    sums = jnp.stack([jnp.sum(x), jnp.sum(x * x), jnp.max(x), jnp.min(x)])
    return jnp.concatenate([x.reshape(-1), jnp.cumsum(x[0]), sums])


def _flip_last_bit(x: np.ndarray) -> np.ndarray:
    bits = np.array(x, copy=True).view(np.uint32)
    bits[0] ^= 1
    return bits.view(np.float32)


def scan(
    devices: Sequence[jax.Device],
    *,
    size: int = 256,
    rounds: int = 8,
    corrupt: int | None = None,
) -> list[ScanResult]:
    """Runs the probe on each device (one program, compiled once, no collective) and
    compares this process's results bitwise.

    Args:
      devices: the devices to scan (results are compared for this process's own).
      size: the probe's matrix side.
      rounds: how many matmul rounds.
      corrupt: a device id whose result gets its last bit flipped before the
        comparison, to see what a disagreeing device looks like (tests, demos).

    Returns:
      One :class:`ScanResult` per local device, in ``devices`` order. Without a
      majority (two devices that differ, or every result different) none agrees.
    """
    devices = list(devices)
    if corrupt is not None and corrupt not in [d.id for d in devices]:
        raise ValueError(
            f"--corrupt {corrupt}: no such device; the devices are {[d.id for d in devices]}"
        )
    mesh = Mesh(np.array(devices, dtype=object), ("d",))

    def each(key: jax.Array) -> jax.Array:
        # Varying: every device computes its own copy, none is shared or skipped.
        return _probe(jax.lax.pcast(key, "d", to="varying"), size, rounds)[None]

    fn = jax.jit(jax.shard_map(each, mesh=mesh, in_specs=P(), out_specs=P("d")))
    out = fn(jax.device_put(jax.random.key_data(jax.random.key(0)), NamedSharding(mesh, P())))
    mine = {s.device.id: np.asarray(s.data)[0] for s in out.addressable_shards}
    local = [d for d in devices if d.id in mine]
    results = [_flip_last_bit(mine[d.id]) if d.id == corrupt else mine[d.id] for d in local]
    digests = [hashlib.sha256(r.tobytes()).hexdigest()[:16] for r in results]
    common, count = Counter(digests).most_common(1)[0]
    reference = results[digests.index(common)] if count * 2 > len(results) else None
    found = []
    for d, result, digest in zip(local, results, digests, strict=True):
        if reference is None:
            differing, ulps = -1, -1
        else:
            a = result.view(np.int32).astype(np.int64)
            b = reference.view(np.int32).astype(np.int64)
            differing, ulps = int(np.sum(a != b)), int(np.max(np.abs(a - b)))
        found.append(ScanResult(int(d.id), digest, differing == 0, differing, ulps))
    return found


def time_all_reduce(
    devices: Sequence[jax.Device], *, bytes_per_device: int = 1 << 20, repeats: int = 10
) -> AllReduce:
    """Times a ``psum`` of ``bytes_per_device`` float32 bytes from every device and
    checks its result exactly (device i sends i + 1 everywhere)."""
    n = len(devices)
    mesh = Mesh(np.array(list(devices), dtype=object), ("d",))
    per = bytes_per_device // 4
    fn = jax.jit(
        jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    )
    x = jax.device_put(
        np.repeat(np.arange(1, n + 1, dtype=np.float32), per), NamedSharding(mesh, P("d"))
    )
    out = fn(x).block_until_ready()  # compile and warm up
    correct = bool(np.all(np.asarray(out) == n * (n + 1) / 2))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return AllReduce(n, per * 4, float(np.median(times)), correct)


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    client = jax.devices()[0].client
    name, version = str(client.platform), str(getattr(client, "platform_version", ""))
    found["backend"] = name if version in ("", name) else f"{name} ({version})"
    return found


def run(
    devices: Sequence[jax.Device] | None = None, *, corrupt: int | None = None, size: int = 256
) -> Report:
    """The whole check-up on ``devices`` (default ``jax.devices()``)."""
    devices = list(jax.devices() if devices is None else devices)
    return Report(
        devices=describe_devices(devices),
        scan=scan(devices, size=size, corrupt=corrupt),
        all_reduce=time_all_reduce(devices),
        versions=versions(),
    )


def format_report(report: Report) -> str:
    lines = [f"{len(report.devices)} devices:"]
    lines.append(f"  {'id':>6}  {'process':>7}  {'host':<20} kind")
    for d in report.devices:
        lines.append(f"  {d.device_id:>6}  {d.process_index:>7}  {d.host:<20} {d.kind}")
    lines.append("")
    lines.append(
        f"silent-data-corruption scan: the same program on {len(report.scan)} local devices, "
        "results compared bitwise"
    )
    for r in report.scan:
        if r.agrees:
            verdict = "agrees"
        elif r.differing < 0:
            verdict = "DISAGREES (no majority to compare with)"
        else:
            verdict = f"DISAGREES: {r.differing} element(s) differ, by up to {r.max_ulps} ulp(s)"
        lines.append(f"  device {r.device_id:>6}  {r.digest}  {verdict}")
    if report.disagreeing:
        lines.append(
            f"device(s) {report.disagreeing} computed different bits from the same program "
            "and inputs: suspect the chip(s); run without them (make_train_step(devices=...)) "
            "and run jaxstep doctor again"
        )
    a = report.all_reduce
    lines.append("")
    bandwidth = (
        f"{a.bus_gbps:.2f} GB/s bus bandwidth" if a.devices > 1 else "one device: no traffic"
    )
    lines.append(
        f"all-reduce: psum of {a.bytes_per_device / 2**20:.1f} MiB per device over {a.devices} "
        f"device(s): {a.seconds * 1e3:.2f} ms median ({bandwidth}), "
        + ("result exact" if a.correct else "RESULT WRONG: a device or the interconnect is bad")
    )
    if len(report.scan) == 1:
        lines.append("(one local device: nothing to compare its bits with; try --devices 8)")
    lines.append("")
    lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in report.versions.items()))
    lines.append("")
    lines.append("doctor: all good" if report.ok else "doctor: PROBLEMS FOUND (see above)")
    return "\n".join(lines)
