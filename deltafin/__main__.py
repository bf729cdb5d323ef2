"""``python -m deltafin``: the ``deltafin`` command (``torchrun ... -m deltafin.cli`` works as well)."""

from __future__ import annotations

import sys

from deltafin.cli import main

sys.exit(main())
