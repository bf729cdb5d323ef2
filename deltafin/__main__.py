"""``python -m deltafin``: the ``deltafin`` command (``torchrun ... -m deltafin.cli`` works as well)."""

import sys

from deltafin.cli import main

sys.exit(main())
