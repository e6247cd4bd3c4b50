"""The small arrays a step threads through every call (:class:`Extras`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxstep._src.step._backends import Backend


class Extras:
    """The small arrays every call of a step takes, placed on its devices: the chunk
    each device holds (a replay moves them; the random keys follow) and the faults'
    bookkeeping (what fired). Shared with the dropping rerun's runtime, so a fault that
    fired in one does not fire again in the other."""

    def __init__(self, backend: Backend, n_faults: int, fired: np.ndarray | None = None):
        self.backend = backend
        self.n_faults = n_faults
        self.split = {"chunk": True, **({"fired": False} if n_faults else {})}
        values: dict[str, np.ndarray] = {"chunk": np.arange(len(backend.devices), dtype=np.int32)}
        if n_faults:
            values["fired"] = np.zeros(n_faults, bool) if fired is None else fired
        self.placed: dict[str, Any] = backend.place_extras(values, self.split)

    def with_chunks(self, chunks: np.ndarray) -> dict[str, Any]:
        """The extras with device ``i`` holding chunk ``chunks[i]`` (a replay)."""
        values = {"chunk": np.asarray(chunks, np.int32)}
        return {**self.placed, **self.backend.place_extras(values, {"chunk": True})}

    def fired(self) -> np.ndarray:
        """Which faults fired (a host copy)."""
        return np.asarray(self.backend.read_first(self.placed["fired"]))
