"""``python -m deltafin``: the ``deltafin`` command (``torchrun ... -m deltafin.cli`` works as well)."""

from __future__ import annotations

import os
import sys

_pkg = sys.modules.get("deltafin")
if _pkg is not None and not hasattr(_pkg, "__version__"):
    # Run from the clone's parent folder, 'deltafin' resolved to the clone itself (a folder without
    # __init__.py, so a namespace package) and the package's __init__ never ran: import the real one.
    for _name in [m for m in sys.modules if m == "deltafin" or m.startswith("deltafin.")]:
        del sys.modules[_name]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deltafin.cli import main  # noqa: E402

sys.exit(main())
