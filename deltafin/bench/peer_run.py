"""One side of one ``bench peer`` pair, each in a process of its own: llama-bench, or Deltafin's engine.

Both measure the same figures on the same checkpoint: decode tok/s at depth 0 (T threads and 1 thread), decode
after a P-token prompt, and prefill of P tokens with every expert in memory. Deltafin's side also measures
the memory roofline in the same process: read bandwidth / bytes a token touches (every trunk matrix but the
embedding, one embedding row, k experts per MoE layer). ``python -m deltafin.bench.peer_run JSON`` runs
Deltafin's side and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

FIGURES = ("decode_depth0", "decode_after_prompt", "decode_1thread", "prefill")


def llama_side(bench: str, gguf: str, threads: int, tokens: int, prompt: int, wrap: list[str] | None = None
               ) -> dict:
    """The four figures from three llama-bench calls (-r 1: one measured run after its warm-up, like ours)."""
    def one(extra: list[str], t: int) -> list[dict]:
        cmd = (wrap or []) + [bench, "-m", gguf, "-t", str(t), "-r", "1", "-o", "json", *extra]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"llama-bench failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
        return json.loads(r.stdout)

    a = one(["-p", str(prompt), "-n", str(tokens)], threads)
    pp = next(x for x in a if x["n_prompt"] > 0)
    tg = next(x for x in a if x["n_gen"] > 0)
    deep = one(["-p", "0", "-n", str(tokens), "-d", str(prompt)], threads)[0]
    single = one(["-p", "0", "-n", str(tokens)], 1)[0]
    return {"decode_depth0": tg["avg_ts"], "decode_after_prompt": deep["avg_ts"], "decode_1thread": single["avg_ts"],
            "prefill": pp["avg_ts"], "version": f"{tg.get('build_number')} ({tg.get('build_commit')})",
            "model_bytes": tg.get("model_size")}


def llama_capped(bench: str, gguf: str, threads: int, tokens: int, wrap: list[str]) -> tuple[float, str]:
    """(decode tok/s at depth 0 under a memory cap, how llama.cpp held the weights). llama.cpp maps the model, and
    what does not fit is read again; by default its CPU backend also copies weights into repacked buffers, which are
    not file pages the kernel can drop, so a cap below the model kills it: then the run is repeated with
    ``--repack 0`` (the weights read from the mapping alone)."""
    base = wrap + [bench, "-m", gguf, "-t", str(threads), "-r", "1", "-o", "json", "-p", "0", "-n", str(tokens)]
    errors = []
    for extra, how in (([], "mmap, repacked (its default)"), (["--repack", "0"], "mmap, --repack 0")):
        r = subprocess.run(base + extra, capture_output=True, text=True)
        if r.returncode == 0:
            return json.loads(r.stdout)[0]["avg_ts"], how
        errors.append(f"{how}: exit {r.returncode} {r.stderr.strip()[-160:]}")
    raise RuntimeError(f"llama-bench under the cap failed: {'; '.join(errors)}")


def deltafin_side(model: str, threads: int, tokens: int, prompt: int, wrap: list[str] | None = None,
                  cache_gb: float | None = None) -> dict:
    """Deltafin's figures from a fresh process (``cache_gb`` given: the capped run, decode only, no warm-all)."""
    spec = {"model": model, "threads": threads, "tokens": tokens, "prompt": prompt, "cache_gb": cache_gb}
    cmd = (wrap or []) + [sys.executable, "-m", "deltafin.bench.peer_run", json.dumps(spec)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"Deltafin's run failed (exit {r.returncode}): {r.stderr.strip()[-400:]}")
    return json.loads(lines[-1])


def _decode(engine, state, first: int, tokens: int, read: list | None = None) -> tuple[float, list[int]]:
    """tok/s over ``tokens`` greedy one-token steps after one untimed step; the tokens, to check repeats.
    ``read``: gets the expert bytes the timed steps read appended."""
    tok, out = engine.forward([first], state).argmax().item(), []
    b0, t = engine.source.stats.bytes_read, time.perf_counter()
    for _ in range(tokens):
        tok = engine.forward([tok], state).argmax().item()
        out.append(tok)
    tps = tokens / (time.perf_counter() - t)
    if read is not None:
        read.append(engine.source.stats.bytes_read - b0)
    return tps, out


def bytes_per_token(packed) -> int:
    """What one decode token reads: the trunk's matrices once (the embedding: one row), k experts a layer."""
    tc = packed.text_config
    trunk = packed.trunk_records()
    emb = trunk.pop("model.embed_tokens.weight")
    per = sum(t.nbytes for t in trunk.values()) + emb.nbytes // tc["vocab_size"]
    one = {L: sum(t.nbytes for t in packed.read_expert(L, 0).values()) for L in packed.moe_layers}
    return per + sum(one.values()) * tc["num_experts_per_tok"]


def _worker(spec: dict) -> dict:
    import torch

    from deltafin.bench.kernels import bandwidth
    from deltafin.runtime.engine import Engine, EngineOptions

    T, N, P = spec["threads"], spec["tokens"], spec["prompt"]
    torch.set_num_threads(T)
    capped = spec["cache_gb"] is not None
    gb = spec["cache_gb"] if capped else None
    eng = Engine(spec["model"], EngineOptions(exact=False, cache_gb=gb, max_len=P + N + 8))
    packed, E = eng.packed, eng.packed.num_experts
    rng = torch.Generator().manual_seed(0)
    ids = torch.randint(0, packed.text_config["vocab_size"], (P,), generator=rng).tolist()
    if capped:  # the read bound of the same run: the timed steps' expert bytes at the drive's raw direct rate
        import glob

        from deltafin.bench.disk import raw_read_gbps

        read: list[int] = []
        tps, _ = _decode(eng, eng.new_state(), ids[0], N, read)
        src, per_tok = eng.source.stats, read[0] / N
        files = sorted(f for d in packed.drives for f in glob.glob(f"{d.path}/**/*.dfx", recursive=True))
        size = max((os.path.getsize(f) for f in files[:256]), default=0)
        raw = raw_read_gbps(files[:256], size, 4) if files else 0.0
        # one whole-file read at a time, as a layer whose routing leaves one miss reads it: its latency counts
        one = raw_read_gbps(files[256:320] or files[:64], size, 1) if files else 0.0
        return {"decode_capped": tps, "bytes_read": src.bytes_read, "hit_rate": src.hit_rate,
                "bytes_read_per_token": per_tok, "raw_GBps": raw, "one_read_GBps": one,
                "read_bound_tok_s": raw * 1e9 / per_tok if per_tok else float("inf"),
                "one_read_bound_tok_s": one * 1e9 / per_tok if per_tok else float("inf"),
                "misses_per_token": per_tok / size if size else 0.0}  # expert files read a timed token
    all_bytes = sum(packed.file_bytes(L) * E for L in packed.moe_layers)
    assert eng.cache_bytes >= all_bytes, f"the cache ({eng.cache_bytes} B) cannot hold every expert ({all_bytes} B)"
    for L in packed.moe_layers:  # every expert in memory, as llama.cpp's mapped model is once warm
        for _ in eng.source.fetch(L, list(range(E))):
            pass
    bw0 = bandwidth("cpu")
    r = {}
    with torch.inference_mode():
        r["decode_depth0"], toks = _decode(eng, eng.new_state(), ids[0], N)
        _, again = _decode(eng, eng.new_state(), ids[0], N)
        st = eng.new_state()
        t = time.perf_counter()
        eng.prefill([ids], [st])
        r["prefill"] = P / (time.perf_counter() - t)
        r["decode_after_prompt"], _ = _decode(eng, st, ids[-1], N)
        policy, eng.threads = eng.threads, None  # exactly one thread: the adaptive count would set its own
        torch.set_num_threads(1)
        r["decode_1thread"], _ = _decode(eng, eng.new_state(), ids[0], N)
        torch.set_num_threads(T)
        eng.threads = policy
    r["bandwidth_GBps"] = max(bw0, bandwidth("cpu"))
    r["bytes_per_token"] = bytes_per_token(packed)
    r["roofline_tok_s"] = r["bandwidth_GBps"] * 1e9 / r["bytes_per_token"]
    r["repeatable"] = toks == again
    r["misses_after_warm"] = eng.source.stats.misses - sum(E for _ in packed.moe_layers)
    eng.close()
    return r


if __name__ == "__main__":
    print(json.dumps(_worker(json.loads(sys.argv[1]))), flush=True)
