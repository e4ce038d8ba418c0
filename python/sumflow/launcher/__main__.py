"""``python -m sumflow.launcher``: the same as ``sumflow-run``."""

import sys

from sumflow.launcher.cli import main

sys.exit(main())
