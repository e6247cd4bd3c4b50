"""Where a step's time goes on each device: every kernel (XLA thunk) and runtime event
of the hand-written step and of jaxstep's, from one profiler trace of each, in
microseconds per device and step. What to read, with ``bench.py --hlo``, when a
ratio moves.

    .venv/bin/python scripts/kernels.py --size tiny --steps 40
    .venv/bin/python scripts/kernels.py --size mlp --top 25

On fake CPU devices every device's kernels run on the same few cores, and the
all-reduce waits for the last device to arrive: each microsecond of work per device
costs about ``n_devices / cores`` microseconds of step time. Events that only wait
(the all-reduce's rendezvous, the executor's own span) are left out of the table.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench
import jax
from jax.profiler import ProfileData

# One name for every device's span of the executable's call ("[3] ...Execute (jit_body)").
_program = re.compile(r"Execute \(jit_\w+\)")
# Events whose own time is waiting for the other devices or the executor's idling.
WAITS = ("ThunkExecutor::Execute", "all-reduce", "Rendezvous", "Wait", "end: ")


def self_times(events: list) -> list[tuple[str, int]]:
    """(name, time not spent in the events nested in it) of each event of a line: a
    conditional's own cost without its branch's kernels, which are listed apart."""
    events = sorted(events, key=lambda e: (e.start_ns, -e.duration_ns))
    out: list[list] = []  # [name, self ns, end ns]
    open_: list[list] = []
    for e in events:
        while open_ and open_[-1][2] <= e.start_ns:
            open_.pop()
        if open_:
            open_[-1][1] -= e.duration_ns
        entry = [e.name, e.duration_ns, e.start_ns + e.duration_ns]
        out.append(entry)
        open_.append(entry)
    return [(name, ns) for name, ns, _ in out]


def per_kernel(v: bench.Variant, steps: int) -> dict[str, float]:
    """Microseconds per device and step of each event on the devices' threads (its
    own time: what the events nested in it took is theirs)."""
    for _ in range(3):
        bench.run_block(v, 4)
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            bench.run_block(v, steps)
        (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        with open(path, "rb") as f:
            data = ProfileData.from_serialized_xspace(f.read())
    total: collections.Counter[str] = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if line.name.startswith("tf_XLA"):  # the runtime's device threads
                for name, ns in self_times(list(line.events)):
                    if not name.startswith(WAITS):
                        total[_program.sub("Execute (program)", name.split("] ")[-1])] += ns
    scale = 1e-3 / steps / bench.N_DEVICES
    return {name: ns * scale for name, ns in total.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="tiny", choices=sorted(bench.MODELS))
    parser.add_argument("--steps", type=int, default=40, help="traced steps per variant")
    parser.add_argument("--top", type=int, default=40, help="rows of the table")
    args = parser.parse_args()
    setup = bench.Setup(bench.MODELS[args.size])
    hand = setup.hand("hand", jax.jit(setup.shard_map(), donate_argnums=(0, 1)))
    mine = setup.jaxstep("jaxstep")
    times = {v.name: per_kernel(v, args.steps) for v in (hand, mine)}
    names = sorted(
        set(times["hand"]) | set(times["jaxstep"]),
        key=lambda k: -max(times["hand"].get(k, 0.0), times["jaxstep"].get(k, 0.0)),
    )
    print(f"{args.size}: microseconds per device and step, {args.steps} steps traced\n")
    print("| event | hand | jaxstep |\n| --- | --- | --- |")
    for name in names[: args.top]:
        row = [f"{times[v].get(name, 0.0):.1f}" if name in times[v] else "-" for v in times]
        print(f"| {name} | {' | '.join(row)} |")
    sums = [sum(t.values()) for t in times.values()]
    print(f"| **all events, not only those above** | {sums[0]:.1f} | {sums[1]:.1f} |")


if __name__ == "__main__":
    main()
