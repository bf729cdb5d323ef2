"""Deltafin's own folder for small per-user files (the packed-model catalog, chat history).

$DELTAFIN_HOME, else $XDG_DATA_HOME/deltafin, else ~/.deltafin.
"""

from __future__ import annotations

import os


def home() -> str:
    if os.environ.get("DELTAFIN_HOME"):
        return os.path.abspath(os.environ["DELTAFIN_HOME"])
    if os.environ.get("XDG_DATA_HOME"):
        return os.path.join(os.environ["XDG_DATA_HOME"], "deltafin")
    return os.path.join(os.path.expanduser("~"), ".deltafin")


def path(name: str) -> str:
    """home()/name, creating home() on first use."""
    h = home()
    os.makedirs(h, exist_ok=True)
    return os.path.join(h, name)
