"""A call that must return in time: run it in a thread and fail the test, instead of hanging it, if it does not."""

from __future__ import annotations

import threading


def bounded(fn, seconds: float, what: str):
    """``fn()``'s value (or its exception, re-raised here) if it returns within ``seconds``; else an assertion
    error saying ``what`` must never happen."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            out["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: {what}"
    if "error" in out:
        raise out["error"]
    return out["value"]
