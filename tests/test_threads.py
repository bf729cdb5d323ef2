"""The decode steps' thread policy (runtime/threads.py): it keeps the count that measures fastest, tries again
later, and changes no result (the fast path's logits are the same at any thread count)."""

from __future__ import annotations

import pytest
import torch

from deltafin.runtime.threads import ThreadPolicy
from tests import tiny_families as tf


def _drive(policy: ThreadPolicy, cost: dict[int, float], steps: int) -> list[int]:
    used = []
    for _ in range(steps):
        n = policy.next()
        used.append(n)
        policy.done(n, cost[n])
    return used


def test_keeps_the_fastest_count_and_tries_again_later():
    p = ThreadPolicy(8, trial=2, every=5)
    assert p.options == [8, 4, 1]
    used = _drive(p, {8: 3.0, 4: 1.0, 1: 2.0}, 6)
    assert used == [8, 8, 4, 4, 1, 1] and p.best == 4 and p.trials == 1
    assert _drive(p, {8: 3.0, 4: 1.0, 1: 2.0}, 5) == [4] * 5  # kept until the next trial
    used = _drive(p, {8: 0.5, 4: 1.0, 1: 2.0}, 6)  # the load went away: all threads win again
    assert used == [8, 8, 4, 4, 1, 1] and p.best == 8 and p.trials == 2


def test_ties_go_to_more_threads_and_one_thread_has_nothing_to_try():
    p = ThreadPolicy(2, trial=1)
    _drive(p, {2: 1.0, 1: 1.0}, 2)
    assert p.best == 2
    one = ThreadPolicy(1)
    assert _drive(one, {1: 1.0}, 3) == [1, 1, 1] and one.trials == 0
    with pytest.raises(ValueError, match="compute threads must be >= 1"):
        ThreadPolicy(0)


def test_adapting_threads_changes_no_logit(tmp_path):
    tf.build("glm4_moe", tmp_path / "src")
    model = tf.pack_to(tmp_path, tf.DEFAULT)
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for adapt in (False, True):
            eng = tf.engine(model, exact=False, adapt_threads=adapt)
            seen: list[torch.Tensor] = []
            try:
                list(eng.generate(tf.prompt(9), 12, stop_ids=(), on_logits=lambda lg: seen.append(lg.clone())))
                assert (eng.threads is not None) == adapt and torch.get_num_threads() == 2
                if adapt:
                    assert eng.threads.trials >= 1 and eng.threads.options == [2, 1]
            finally:
                eng.close()
            runs.append(torch.stack(seen))
        assert torch.equal(runs[0].view(torch.int32), runs[1].view(torch.int32))
    finally:
        torch.set_num_threads(n)
