import sys

from jaxstep._src.cli import main

sys.exit(main())
