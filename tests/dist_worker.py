"""One rank of a test launch over several processes (spawned by tests/test_distributed.py).

Rank 0 runs the same passes as the single-process reference and writes what it got; the other ranks
follow. ``fail = (rank, "exit" | "raise")`` makes that rank die or raise in its second step of the last model.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

LAUNCH_S = 240  # bound on one launch: a hang fails the test instead of stalling the run

CLASSIFY_LABELS = ["y", "no", "maybe"]  # one, two and five tokens under the byte tokenizer
CLASSIFY_TEXTS = ["The figures reconcile.", "Revenue is overstated by 4%.", "Q3?"]


def passes(eng, prompt: list[int], n: int) -> dict:
    """Greedy tokens of one generation, then two prompts prefilled together and a copied state stepped:
    every pass kind the commands use (one sequence, a batch, a copy); with a tokenizer, classify's label
    log-probabilities of a few texts too (a batched prefill, then the labels' tokens on copied states)."""
    import torch

    from deltafin.runtime.sampling import SamplingParams

    toks = [t for t, _ in eng.generate(prompt, n, SamplingParams(), stop_ids=())]
    states = [eng.new_state(), eng.new_state()]
    logits, _ = eng.prefill([prompt, prompt[::-1][:5]], states)
    twin = eng.copy_state(states[1])
    out = eng.step([(torch.tensor([3, 4], dtype=torch.long), twin), (torch.tensor([9]), states[0])],
                   all_logits=True)
    got = {"tokens": toks, "logits": [lg.tolist() for lg in logits] + [lg.tolist() for lg in out]}
    if eng.codec is not None:
        from deltafin.jobs.classify import Classifier

        clf = Classifier(eng, CLASSIFY_LABELS, "{input} ok? ")
        got["classify"] = clf.score([clf.prompt(t) for t in CLASSIFY_TEXTS])
    return got


def one_process(models: dict[str, str], prompt: list[int], n: int = 8, also=None) -> dict[str, dict]:
    """{name: passes(...)} of each model in this process, on one thread as the ranks run (the same kernels, so the
    same float results); ``also(engine, result)`` adds to a model's result before its engine closes."""
    import torch

    from deltafin.runtime.engine import Engine, EngineOptions

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = {}
        for name, m in models.items():
            eng = Engine(m, EngineOptions(exact=True, cache_gb=0.001, threads=2, max_len=64))
            try:
                ref[name] = passes(eng, prompt, n)
                if also is not None:
                    also(eng, ref[name])
            finally:
                eng.close()
        return ref
    finally:
        torch.set_num_threads(threads)


def worker(rank: int, world: int, port: int, models: list[str], out_path: str, fail: tuple | None = None,
           routing: str = "check") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    from deltafin.errors import DeltafinError
    from deltafin.runtime import cluster
    from deltafin.runtime.engine import Engine, EngineOptions

    got, error = {}, None
    try:
        for i, m in enumerate(models):
            eng = Engine(m, EngineOptions(exact=True, cache_gb=0.001, threads=2, dist_timeout_s=30, max_len=64,
                                       dist_routing=routing))
            try:
                if rank == 0:
                    got[m] = passes(eng, [5, 17, 99, 3, 42, 7, 250, 11], 8)
                else:
                    if fail and fail[0] == rank and i == len(models) - 1:
                        _arm(eng, fail[1])
                    eng.follow()
            finally:
                eng.close()
    except DeltafinError as e:
        error = f"{type(e).__name__}: {e}"
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"results": got, "error": error}, f)
    cluster.shutdown()


def _arm(eng, fail: str) -> None:
    step, calls = eng.local_step, [0]

    def local_step(batch, all_logits=False):
        calls[0] += 1
        if calls[0] == 2:
            if fail == "exit":
                os._exit(3)
            raise OSError("drive d1 stopped answering")
        return step(batch, all_logits)

    eng.local_step = local_step


def launch(world: int, models: list[str], out: Path, fail: tuple | None = None, routing: str = "check") -> dict:
    """Run ``worker`` on ``world`` spawned ranks over ``models``; what rank 0 wrote (results, error)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [mp.get_context("spawn").Process(target=worker, args=(r, world, port, models, str(out), fail, routing))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(LAUNCH_S)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} still running after {LAUNCH_S} s"
    return json.loads(out.read_text())
