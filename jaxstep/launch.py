"""``python -m jaxstep.launch -n 2 train.py ARGS``: N local processes of one
``jax.distributed`` job on fake CPU devices (docs/multihost.md). The launcher lives in
:mod:`jaxstep.distributed`; this module is its documented command."""

import sys

from jaxstep._src.distributed.launch import child_env as child_env
from jaxstep._src.distributed.launch import free_port as free_port
from jaxstep._src.distributed.launch import launch as launch
from jaxstep._src.distributed.launch import main as main

__all__ = ["child_env", "free_port", "launch", "main"]

if __name__ == "__main__":
    sys.exit(main())
