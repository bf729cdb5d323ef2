"""Shared fixtures: the test session gets its own Deltafin home (catalog, chat history), so nothing lands in the
user's; ``one_thread`` for modules of tiny tensors."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _deltafin_home(tmp_path_factory):
    old = os.environ.get("DELTAFIN_HOME")
    os.environ["DELTAFIN_HOME"] = str(tmp_path_factory.mktemp("deltafin-home"))
    yield
    if old is None:
        os.environ.pop("DELTAFIN_HOME", None)
    else:
        os.environ["DELTAFIN_HOME"] = old


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: thread start-up costs more than it saves, and spinning threads stall a busy CI box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
