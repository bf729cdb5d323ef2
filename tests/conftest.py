"""The test session gets its own Deltafin home (catalog, chat history), so nothing lands in the user's."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _deltafin_home(tmp_path_factory):
    old = os.environ.get("DELTAFIN_HOME")
    os.environ["DELTAFIN_HOME"] = str(tmp_path_factory.mktemp("deltafin-home"))
    yield
    if old is None:
        os.environ.pop("DELTAFIN_HOME", None)
    else:
        os.environ["DELTAFIN_HOME"] = old
