"""A follower rank under ``torchrun``: open the same engine as rank 0, then run the steps rank 0 sends.

Rank 0 runs the user's command (``run``, ``chat``, ``serve``, ``batch``, ``classify``) unchanged; every other
rank runs this instead, with the same arguments, until rank 0 closes its engine.
"""

from __future__ import annotations


def run(args) -> int:
    from deltafin.interfaces.cmd_run import open_engine

    args.quiet = True
    eng = open_engine(args)
    try:
        eng.follow()
    finally:
        eng.close()
    return 0
