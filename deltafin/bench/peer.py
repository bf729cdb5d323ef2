"""``deltafin bench peer``: Deltafin beside llama.cpp on the same checkpoint, every figure with the ratio.

The checkpoint (given, or a random Qwen3-MoE built here) is converted by llama.cpp's own converter and
``llama-quantize MXFP4_MOE`` (MXFP4 experts, Q8_0 rest), and by ``deltafin pack`` (MXFP4 experts, int8 trunk),
both timed. Then pairs run interleaved, the order alternating, each side in a fresh process; the CPU
pressure (/proc/pressure/cpu, "some") over each pair is recorded and pairs above ``--max-pressure`` are left
out of the medians (a shared machine's neighbours slow either side at random). Last, where a memory cap can
be set (systemd-run, or a cgroup v2 or v1 memory folder this process may write), one pair with memory capped below the
model and its files dropped from the page cache.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import time

from deltafin.bench import peer_run, peer_tools
from deltafin.errors import UsageError

LABELS = {"decode_depth0": "decode tok/s, depth 0", "decode_after_prompt": "decode tok/s after a {P}-token prompt",
          "decode_1thread": "decode tok/s, 1 thread", "prefill": "prefill tok/s, {P}-token prompt, experts cached"}
TARGETS = {"decode_depth0": 1.2, "decode_after_prompt": 1.2, "decode_1thread": 1.2, "prefill": 2.0, "convert": 1.0,
           "capped": 10.0}


def check_args(args) -> None:
    """Every argument checked before any long work: one line naming the value and the fix."""
    for name in ("pairs", "tokens", "prompt", "threads"):
        if getattr(args, name) < (0 if name == "pairs" else 1):
            raise UsageError(f"bench peer: --{name} {getattr(args, name)}: give a whole number >= "
                             f"{0 if name == 'pairs' else 1}")
    if args.pairs == 0 and args.no_capped:
        raise UsageError("bench peer: --pairs 0 with --no-capped leaves nothing to run; drop one of them")
    if not 0 < args.max_pressure <= 100:
        raise UsageError(f"bench peer: --max-pressure {args.max_pressure}: give a percentage in (0, 100]")
    if args.cap_gb is not None and args.cap_gb <= 0:
        raise UsageError(f"bench peer: --cap-gb {args.cap_gb}: give GB > 0 (or leave it out: half the model)")
    if args.checkpoint is not None:
        peer_tools.check_checkpoint(args.checkpoint)


def cpu_pressure_total() -> float | None:
    """Microseconds some task waited for a CPU since boot (None where the kernel has no PSI)."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().split("total=")[1])
    except (OSError, IndexError, ValueError):
        return None


def memory_cap(nbytes: int, proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
               ) -> tuple[list[str] | None, str, str | None]:
    """(a command prefix that runs a command with memory capped at ``nbytes``, how, the cgroup folder made for it
    to remove after), or (None, why not, None): systemd-run, else a child of this process's cgroup v2 folder, else
    of its cgroup v1 memory controller's (page cache is charged to the cap in both)."""
    why = []
    if shutil.which("systemd-run"):
        wrap = ["systemd-run", "--scope", "--quiet", "-p", f"MemoryMax={nbytes}", "-p", "MemorySwapMax=0"]
        r = subprocess.run(wrap + ["true"], capture_output=True, text=True)
        if r.returncode == 0:
            return wrap, "systemd-run scope", None
        why.append(f"systemd-run: {(r.stderr.strip().splitlines() or ['failed'])[-1]}")
    else:
        why.append("no systemd-run")
    try:
        with open(proc) as f:
            lines = [ln.strip().split(":", 2) for ln in f if ln.count(":") >= 2]
    except OSError:
        lines = []
    v2 = next((rel for _, ctl, rel in lines if ctl == ""), None)
    v1 = next((rel for _, ctl, rel in lines if "memory" in ctl.split(",")), None)
    for kind, base, limits in (("v2", v2 and f"{root}{v2}", ("memory.max",)),
                               ("v1", v1 and f"{root}/memory{v1}", ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"))):
        if not base or not os.path.isfile(os.path.join(base, limits[0])) and not os.path.isfile(
                os.path.join(base, "cgroup.subtree_control")):
            why.append(f"no cgroup {kind} memory controller for this process")
            continue
        child = os.path.join(base, f"deltafin-peer-{os.getpid()}")
        try:
            os.makedirs(child, exist_ok=True)
            for name in limits:  # v1: memory, then memory + swap (where the kernel counts swap)
                if name == limits[0] or os.path.exists(os.path.join(child, name)):
                    with open(os.path.join(child, name), "w") as f:
                        f.write(str(nbytes))
        except OSError as e:
            why.append(f"cgroup {kind} {child}: {e.strerror}")
            continue
        return ["sh", "-c", f'echo $$ > {child}/cgroup.procs && exec "$@"', "sh"], f"cgroup {kind} {child}", child
    return None, "; ".join(why), None


def drop_cached(paths: list[str]) -> None:
    """Drop these files' pages from the page cache (only theirs: other programs' caches stay)."""
    for top in paths:
        for d, _, files in os.walk(top) if os.path.isdir(top) else [(os.path.dirname(top), [], [top])]:
            for name in files:
                fd = os.open(os.path.join(d, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})" if values else "-"


def _made(work: str) -> tuple[str, str]:
    """Where the GGUF and the pack go in the work folder."""
    return os.path.join(work, "model-mxfp4-moe.gguf"), os.path.join(work, "deltafin")


def _reusable(args, work: str) -> bool:
    """--reuse with a GGUF and a pack already in the work folder: nothing is converted (no converter needed)."""
    gguf, packed = _made(work)
    return args.reuse and os.path.isfile(gguf) and os.path.isfile(os.path.join(packed, "deltafin.json"))


def _prepare(args, work: str, tools) -> dict:
    """The checkpoint, the GGUF and the pack (each timed where made here); kept with --reuse."""
    ck = args.checkpoint or os.path.join(work, "checkpoint-" + ("small" if args.small else "issue"))
    if args.checkpoint is None:
        peer_tools.build_checkpoint(ck, "small" if args.small else "issue")
    gguf, packed = _made(work)
    out: dict = {"checkpoint": ck, "gguf": gguf, "packed": packed}
    if _reusable(args, work):
        return out
    bf16 = os.path.join(work, "model-bf16.gguf")
    pack_cmd = [sys.executable, "-m", "deltafin", "pack", ck, packed, "--drive", os.path.join(work, "drive"),
                "--create", "--overwrite", "--no-progress"]
    for side in ("llama", "deltafin"):  # each from a checkpoint out of the page cache
        if side == "llama":
            drop_cached([ck])
            t = cpu_pressure_total(), time.perf_counter()
            out["convert_s"], out["quantize_s"] = peer_tools.convert(tools, ck, bf16, gguf, args.threads)
            out["llama_convert_pressure"] = _pressure(*t)
            os.remove(bf16)
        else:  # a pack left in the folder would be resumed (nothing written): the timed one starts empty
            for d in (packed, os.path.join(work, "drive")):
                shutil.rmtree(d, ignore_errors=True)
            drop_cached([ck])
            t = cpu_pressure_total(), time.perf_counter()
            r = subprocess.run(pack_cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"deltafin pack failed (exit {r.returncode}): {r.stderr.strip()[-300:]}")
            out["pack_s"], out["pack_pressure"] = time.perf_counter() - t[1], _pressure(*t)
    return out


def _pressure(total0: float | None, t0: float) -> float | None:
    total = cpu_pressure_total()
    return None if total is None or total0 is None else (total - total0) / 1e4 / (time.perf_counter() - t0)


def _pairs(args, files: dict, tools) -> list[dict]:
    pairs = []
    for i in range(args.pairs):
        t = cpu_pressure_total(), time.perf_counter()
        order = ("llama", "deltafin") if i % 2 == 0 else ("deltafin", "llama")
        got = {}
        for side in order:
            got[side] = (peer_run.llama_side(tools.bench, files["gguf"], args.threads, args.tokens, args.prompt)
                         if side == "llama" else
                         peer_run.deltafin_side(files["packed"], args.threads, args.tokens, args.prompt))
        got["pressure"], got["order"] = _pressure(*t), order[0]
        pairs.append(got)
        load = "unknown" if got["pressure"] is None else f"{got['pressure']:.1f}%"
        print(f"pair {i + 1}/{args.pairs} ({order[0]} first, CPU pressure {load}): " + ", ".join(
            f"{k} {got['llama'][k]:.1f} / {got['deltafin'][k]:.1f}" for k in peer_run.FIGURES), flush=True)
    return pairs


def _capped(args, files: dict, tools, model_bytes: int) -> dict:
    cap = int(args.cap_gb * 1e9) if args.cap_gb else model_bytes // 2
    wrap, how, child = memory_cap(cap)
    if wrap is None:
        return {"skipped": f"no memory cap could be set here ({how})", "cap_bytes": cap}
    r = {"cap_bytes": cap, "how": how}
    try:
        drop_cached([files["gguf"]])
        r["llama"], r["llama_mode"] = peer_run.llama_capped(tools.bench, files["gguf"], args.threads, 8, wrap)
        drop_cached([files["packed"], os.path.join(os.path.dirname(files["packed"]), "drive")])
        d = peer_run.deltafin_side(files["packed"], args.threads, args.tokens, args.prompt, wrap,
                                   cache_gb=max(cap / 1e9 - 0.8, 0.1))
    finally:
        if child is not None:
            with contextlib.suppress(OSError):  # empty once its processes have left
                os.rmdir(child)
    r["deltafin"], r["deltafin_hit_rate"] = d["decode_capped"], d["hit_rate"]
    r["deltafin_read_bound_tok_s"], r["raw_GBps"] = d.get("read_bound_tok_s"), d.get("raw_GBps")
    r["deltafin_one_read_bound_tok_s"], r["one_read_GBps"] = d.get("one_read_bound_tok_s"), d.get("one_read_GBps")
    r["deltafin_misses_per_token"] = d.get("misses_per_token")
    return r


def report(args, files: dict, pairs: list[dict], capped: dict, version: str) -> dict:
    quiet = [p for p in pairs if p["pressure"] is None or p["pressure"] < args.max_pressure]
    use = quiet or pairs
    P = args.prompt
    print(f"\nllama.cpp {version} vs Deltafin, {args.threads} threads, {len(quiet)} of {len(pairs)} pairs under "
          f"{args.max_pressure:g}% CPU pressure" + ("" if quiet else " (none: every pair is reported, all noisy)"))
    print("| figure | llama.cpp (median, range) | Deltafin (median, range) | Deltafin / llama.cpp per pair | target |")
    print("| --- | --- | --- | --- | --- |")
    rec = {"figures": {}}
    for k in peer_run.FIGURES if use else ():
        lv, dv = [p["llama"][k] for p in use], [p["deltafin"][k] for p in use]
        ratios = [d / v for d, v in zip(dv, lv, strict=True)]
        rec["figures"][k] = {"llama": lv, "deltafin": dv, "ratio": ratios}
        print(f"| {LABELS[k].format(P=P)} | {summary(lv)} | {summary(dv)} | **{statistics.median(ratios):.2f}** "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | >= {TARGETS[k]} |")
    if "pack_s" in files:
        conv = files["convert_s"] + files["quantize_s"]
        print(f"| bf16 checkpoint -> 4-bit (convert {files['convert_s']:.0f} s + quantize {files['quantize_s']:.0f} s "
              f"vs deltafin pack) | {conv:.0f} s | {files['pack_s']:.0f} s | **{conv / files['pack_s']:.2f}** | >= 1.0 |")
    if "skipped" in capped:
        print(f"larger than memory: skipped, {capped['skipped']}")
    else:
        print(f"| memory capped at {capped['cap_bytes'] / 1e9:.2f} GB, files dropped from the page cache | "
              f"{capped['llama']:.2f} tok/s ({capped.get('llama_mode', 'mmap')}) | {capped['deltafin']:.2f} tok/s (cache "
              f"hits {capped['deltafin_hit_rate']:.2f}) | **{capped['deltafin'] / capped['llama']:.1f}** | >= 10 |")
        bound = capped.get("deltafin_read_bound_tok_s")
        if bound:
            warm = statistics.median(p["deltafin"]["decode_depth0"] for p in use) if use else None
            both = "" if warm is None else (
                f"; {capped['deltafin'] / min(bound, warm):.2f} of min(that, its warm decode {warm:.1f} tok/s in the "
                f"pairs above), the step's bound when the reads overlap the math, and "
                f"{capped['deltafin'] * (1 / bound + 1 / warm):.2f} of the bound when they do not")
            print(f"Deltafin under the cap: {capped['deltafin'] / bound:.2f} of its read bound, {bound:.1f} tok/s (the "
                  f"expert bytes it read a token, after cache hits, at the {capped['raw_GBps']:.2f} GB/s raw direct "
                  f"rate of the same files; target >= 0.9){both}")
            one = capped.get("deltafin_one_read_bound_tok_s")
            if one:
                after = "" if warm is None else (
                    f"; with the warm step after them, {1 / (1 / one + 1 / warm):.1f} tok/s, of which Deltafin ran "
                    f"{capped['deltafin'] * (1 / one + 1 / warm):.2f}")
                print(f"Its misses read one at a time ({capped['deltafin_misses_per_token']:.1f} expert files a token, "
                      f"each read once its layer's routing is known): {capped['one_read_GBps']:.2f} GB/s a whole file, "
                      f"{one:.1f} tok/s, {capped['deltafin'] / one:.2f} of it{after}")
    if not use:  # --pairs 0: the capped pair alone
        return rec | {"pairs": pairs, "files": files, "capped": capped, "llama_cpp_version": version}
    roof = [p["deltafin"]["roofline_tok_s"] for p in use]
    frac = [p["deltafin"]["decode_depth0"] / p["deltafin"]["roofline_tok_s"] for p in use]
    d0 = use[0]["deltafin"]
    print(f"Deltafin decode / memory roofline: {statistics.median(frac):.2f} ({min(frac):.2f}-{max(frac):.2f}) of {summary(roof)} tok/s "
          f"({d0['bytes_per_token'] / 1e6:.0f} MB a token / {statistics.median(p['deltafin']['bandwidth_GBps'] for p in use):.1f}"
          f" GB/s read bandwidth in the same runs; target >= 0.6); repeatable tokens: "
          f"{all(p['deltafin']['repeatable'] for p in pairs)}")
    return rec | {"pairs": pairs, "files": files, "capped": capped, "llama_cpp_version": version,
                  "roofline_fraction": frac}


def run(args) -> dict | None:
    check_args(args)
    work = args.dir or os.path.join(os.getcwd(), "bench-peer")
    tools = peer_tools.find_llama_cpp(args.llama_cpp, args.converter, need_converter=not _reusable(args, work))
    os.makedirs(work, exist_ok=True)
    files = _prepare(args, work, tools)
    version = tools.version()
    pairs = _pairs(args, files, tools)
    model_bytes = os.path.getsize(files["gguf"])
    capped = _capped(args, files, tools, model_bytes) if not args.no_capped else {"skipped": "--no-capped"}
    rec = report(args, files, pairs, capped, version)
    if args.json:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(args.json, rec)
    return rec


def add_args(sub) -> None:
    b = sub.add_parser("peer", help="Deltafin beside llama.cpp on the same checkpoint: decode, prefill, convert "
                                    "time, larger than memory, each with the per-pair ratio")
    b.add_argument("--checkpoint", metavar="DIR", help="bf16 Qwen3-MoE checkpoint (default: build a random one "
                   "of the laptop-size shape, 10.2 GB, in --dir)")
    b.add_argument("--small", action="store_true", help="build a small random checkpoint instead (a quick run)")
    b.add_argument("--llama-cpp", metavar="DIR", help="folder holding llama-bench and llama-quantize (default: PATH)")
    b.add_argument("--converter", metavar="PATH", help="llama.cpp's convert_hf_to_gguf.py (default: found near "
                   "llama-bench)")
    b.add_argument("--dir", help="work folder for the checkpoint, the GGUF and the pack (default: ./bench-peer)")
    b.add_argument("--reuse", action="store_true", help="keep a GGUF and pack already in --dir (no convert timing)")
    b.add_argument("--pairs", type=int, default=6, help="interleaved pairs (the order alternates); 0: the larger-than-memory pair alone")
    b.add_argument("--tokens", type=int, default=64, help="decoded tokens timed per figure")
    b.add_argument("--prompt", type=int, default=512, help="prompt tokens (prefill, and decode after a prompt)")
    b.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of both engines")
    b.add_argument("--max-pressure", type=float, default=5.0, help="leave out pairs above this CPU pressure, %%")
    b.add_argument("--cap-gb", type=float, default=None, help="memory cap of the larger-than-memory pair "
                   "(default: half the GGUF)")
    b.add_argument("--no-capped", action="store_true", help="skip the larger-than-memory pair")
    b.add_argument("--json", metavar="PATH")

