"""Small real data for the demo and the notebooks: scikit-learn's bundled digits
(1797 8x8 images, shipped with the package, nothing downloaded), split once, then
served as global batches that are the same whenever batch ``i`` is made."""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

__all__ = ["Split", "batches", "digits"]


class Split(NamedTuple):
    """A split of the digits; ``len(split)`` is its number of examples.

    Attributes:
      image: the images, ``(n, 8, 8, 1)`` float32 in [0, 1].
      label: the digits shown, ``(n,)`` int32 in 0..9.

    Example:
      >>> from jaxstep import data
      >>> train, test = data.digits(test_fraction=0.5)
      >>> len(test), test.image.shape, test.label.shape, test.label.dtype.name
      (898, (898, 8, 8, 1), (898,), 'int32')
    """

    image: np.ndarray
    label: np.ndarray

    def __len__(self) -> int:
        return len(self.label)


def _digits_table() -> np.ndarray:
    """The ``(1797, 65)`` table ``load_digits`` reads (64 pixels in 0..16, the label).

    Read straight from scikit-learn's package data: importing scikit-learn itself
    costs seconds (scipy and more) and is not needed to read one small CSV file.
    """
    spec = importlib.util.find_spec("sklearn")  # locates it without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the digits data comes with scikit-learn: pip install 'jaxstep[demo]' "
            "(or pip install scikit-learn)"
        )
    path = pathlib.Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    if path.exists():
        return np.loadtxt(path, delimiter=",", dtype=np.float64)
    from sklearn.datasets import load_digits  # a layout this function does not know

    raw = load_digits()
    return np.concatenate([raw.data, raw.target[:, None]], axis=1)


def digits(*, test_fraction: float = 0.2, seed: int = 0) -> tuple[Split, Split]:
    """scikit-learn's digits (1797 8x8 images), shuffled with ``seed`` and split in
    two. Nothing is downloaded: the data ships with scikit-learn.

    Args:
      test_fraction: the share of the examples in the test split, in (0, 1).
      seed: the seed of the shuffle.

    Returns:
      ``(train, test)``, two :class:`Split` s.

    Raises:
      ImportError: scikit-learn is missing (``pip install 'jaxstep[demo]'``).
      ValueError: ``test_fraction`` is not in (0, 1).

    Example:
      >>> from jaxstep import data
      >>> train, test = data.digits()
      >>> len(train), len(test), train.image.shape[1:]
      (1438, 359, (8, 8, 1))
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    table = _digits_table()
    image = (table[:, :64].reshape(-1, 8, 8, 1) / 16.0).astype(np.float32)
    label = table[:, 64].astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(label))
    n_test = round(len(label) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return Split(image[train], label[train]), Split(image[test], label[test])


def batches(
    data: Split, batch_size: int, *, seed: int = 0, start: int = 0, stop: int | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """Global batches ``{"image", "label"}`` of ``batch_size`` examples, steps
    ``start``, ``start + 1``, ... (up to ``stop``, or forever).

    Each epoch is a fresh shuffle (``seed``, epoch) cut into ``len(data) //
    batch_size`` batches, so batch ``i`` is the same whenever it is made: resuming at
    ``start`` sees the data a run that never stopped would have seen (what
    ``fit(..., batches=lambda start: data.batches(train, size, start=start))`` needs to
    resume exactly).

    Args:
      data: a :class:`Split`.
      batch_size: examples a batch, at most ``len(data)`` (the last partial batch of
        each epoch is left out).
      seed: the seed of the shuffles.
      start: the first batch's number.
      stop: the number after the last batch's, or None for no end.

    Yields:
      ``{"image": (batch_size, 8, 8, 1) float32, "label": (batch_size,) int32}``.

    Raises:
      ValueError: ``batch_size`` is not in ``1..len(data)`` (at the first batch).

    Example:
      >>> from jaxstep import data
      >>> train, _ = data.digits()
      >>> first = next(data.batches(train, 64))
      >>> first["image"].shape, first["label"].shape
      ((64, 8, 8, 1), (64,))
    """
    if not 0 < batch_size <= len(data):
        raise ValueError(f"batch_size must be in 1..{len(data)}, got {batch_size}")
    per_epoch = len(data) // batch_size  # the last partial batch of each epoch is dropped
    orders: dict[int, np.ndarray] = {}
    i = start
    while stop is None or i < stop:
        epoch, k = divmod(i, per_epoch)
        if epoch not in orders:
            orders.clear()
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(len(data))
        rows = orders[epoch][k * batch_size : (k + 1) * batch_size]
        yield {"image": data.image[rows], "label": data.label[rows]}
        i += 1
