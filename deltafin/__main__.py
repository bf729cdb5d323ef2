"""``python -m deltafin``: the same as the ``deltafin`` command."""

from __future__ import annotations

import sys

from deltafin.cli import main

sys.exit(main())
