import sys

from jaxstep.cli import main

sys.exit(main())
