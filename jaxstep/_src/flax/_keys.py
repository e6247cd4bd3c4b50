"""One key per linen or NNX RNG stream, from the step's key (already folded with the
step and the device)."""

from __future__ import annotations

import zlib

import jax


def stream_key(rng: jax.Array, name: str) -> jax.Array:
    """A key of its own for the stream ``name``, stable however the model grows."""
    if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng)  # a raw jax.random.PRNGKey
    return jax.random.fold_in(rng, zlib.crc32(name.encode()) & 0x7FFFFFFF)
