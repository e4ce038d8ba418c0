"""``python -m sumflow.sim``: the same as ``sumflow sim``."""

import sys

from sumflow.sim.cli import main

sys.exit(main())
