"""Data sources for the checkpoint tests: a callable ``start -> iterable`` and a grain
loader over the same examples as ``tests.models.make_batches``."""

from __future__ import annotations

import numpy as np

from tests.models import BATCH
from tests.models import make_batches


def callable_source(num: int, seed: int = 1):
    batches = make_batches(num, seed)

    def from_position(start: int):
        return iter(batches[start:])

    return from_position


class _Examples:
    """A grain random-access source: example i of the concatenated batches."""

    def __init__(self, num: int, seed: int):
        self.batches = make_batches(num, seed)

    def __len__(self) -> int:
        return len(self.batches) * BATCH

    def __getitem__(self, i: int) -> dict:
        b, r = divmod(int(i), BATCH)
        return {k: np.asarray(v[r]) for k, v in self.batches[b].items()}

    def __repr__(self) -> str:  # grain records it in its state; keep it stable
        return f"_Examples({len(self)})"


def grain_loader(num: int, seed: int = 1):
    import grain

    source = _Examples(num, seed)
    return grain.DataLoader(
        data_source=source,
        sampler=grain.samplers.IndexSampler(
            num_records=len(source), shuffle=True, num_epochs=1, seed=7
        ),
        operations=[grain.transforms.Batch(batch_size=BATCH, drop_remainder=True)],
        worker_count=0,
    )
