"""The streaming engine: exact against the all-resident path, independent of cache size and reader threads,
clear errors on bad reads, replicas, sampling and stop rules, stats."""

from __future__ import annotations

import json
import os

import pytest
import torch

from deltafin.errors import ReadError, UsageError
from deltafin.models import registry
from deltafin.models.base import ResidentExperts
from deltafin.runtime.engine import Engine, EngineOptions
from deltafin.runtime.sampling import SamplingParams
from deltafin.store import manifest as mf
from deltafin.store.model_dir import PackedModel
from tests import tiny_families as tf

PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]


def _engine(root, **kw) -> Engine:
    return Engine(str(root / "model"), EngineOptions(**{"exact": True, **kw}))


def _resident_logits(root, ids: list[int]) -> torch.Tensor:
    pm = PackedModel.open(str(root / "model"))
    model = registry.build(pm.family, pm.text_config, pm.trunk_records())
    experts = ResidentExperts({(L, e): pm.read_expert(L, e) for L in pm.moe_layers for e in range(pm.num_experts)})
    state = model.new_state(64)
    return model.forward(torch.tensor(ids), state, experts)


def test_streaming_equals_resident_bit_for_bit(k3_model):
    ref = _resident_logits(k3_model, PROMPT)
    for cache_gb, threads in ((0.0, 1), (0.0, 8), (1.0, 2)):
        eng = _engine(k3_model, cache_gb=cache_gb, threads=threads)
        try:
            state = eng.new_state()
            got = eng.model.forward(torch.tensor(PROMPT), state, eng.source)
        finally:
            eng.close()
        assert torch.equal(got, ref), f"cache {cache_gb} GB, {threads} threads"


def test_generation_independent_of_cache_and_threads(k3_model):
    outs = []
    for cache_gb, threads in ((0.0, 1), (1.0, 6)):
        eng = _engine(k3_model, cache_gb=cache_gb, threads=threads)
        try:
            toks = [t for t, _ in eng.generate(PROMPT, 12, SamplingParams())]
            outs.append((toks, eng.last_stats))
        finally:
            eng.close()
    assert outs[0][0] == outs[1][0]
    cold, warm = outs[0][1], outs[1][1]
    assert cold.cache_hit_rate == 0.0 and warm.cache_hit_rate > 0.0
    assert warm.bytes_read < cold.bytes_read


def test_cached_experts_come_as_one_group_and_decode_the_same(k3_model, monkeypatch):
    """StreamingExperts.fetch_groups: the cached experts first, as one list, then each read alone, the requested
    ids once each (as fetch gives them). On the fast CPU path a decode step runs a group's small experts in one call
    (kernels.glu_many), and the logits of warm-cache steps (one token, and three: each expert on its own rows) are
    those of the experts run one by one, bit for bit."""
    from deltafin.kernels import cpu
    from deltafin.runtime.source import StreamingExperts

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    eng = _engine(k3_model, cache_gb=1.0, threads=2, exact=False)
    try:
        src, L = eng.source, eng.packed.moe_layers[0]
        assert sorted([e for e, _ in g] for g in src.fetch_groups(L, [0, 3, 5])) == [[0], [3], [5]]  # cold: read
        assert [[e for e, _ in g] for g in src.fetch_groups(L, [0, 3, 5, 7])] == [[0, 3, 5], [7]]
        assert sorted(e for e, _ in src.fetch(L, [7, 1, 0])) == [0, 1, 7]
        steps = []
        for grouped in (True, False):
            if not grouped:
                monkeypatch.delattr(StreamingExperts, "fetch_groups")
            state = eng.new_state()
            with eng.math():
                eng.model.forward(torch.tensor(PROMPT), state, eng.source)  # fills the cache
                cpu.USED.discard("mxfp4_q8_situ_many")
                steps.append([eng.model.forward(torch.tensor(t), state, eng.source) for t in ([9], [4], [9], [3, 8, 1])])
            assert ("mxfp4_q8_situ_many" in cpu.USED) == grouped
        assert all(torch.equal(a, b) for a, b in zip(*steps, strict=True))
    finally:
        eng.close()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("guess", [False, True])
def test_stats_account_for_reads(k3_model, guess, monkeypatch):
    from deltafin.runtime import source

    monkeypatch.setattr(source.StreamingExperts, "guess_reads", property(lambda self: True))  # every guess read
    eng = _engine(k3_model, cache_gb=0.0, guess_next=guess)
    try:
        toks = [t for t, _ in eng.generate(PROMPT, 4, SamplingParams())]
        st = eng.last_stats.to_json()
    finally:
        eng.close()
    for key in ("tokens", "text", "decode_tok_s", "ttft_s", "bytes_read", "cache_hit_rate", "io_wait_s",
                "expert_math_s", "trunk_math_s", "per_drive"):
        assert key in st
    assert st["tokens"] == toks and st["ttft_s"] > 0 and st["decode_tok_s"] > 0
    pm = PackedModel.open(str(k3_model / "model"))
    assert st["bytes_read"] == st["reads"] * pm.file_bytes(pm.moe_layers[0])
    drives = sum(d["bytes"] for d in st["per_drive"].values())  # this run only
    if not guess:
        assert drives == st["bytes_read"] and st["guessed"] == 0
        return
    # the drives also read the guessed experts no layer asked for (some may still be landing)
    unused = (st["guessed"] - st["guess_used"] - st["guess_cancelled"]) * pm.file_bytes(pm.moe_layers[0])
    assert st["guessed"] > 0 and st["bytes_read"] <= drives <= st["bytes_read"] + unused


def test_sampling_seeded_and_top_k_one_is_greedy(k3_model):
    eng = _engine(k3_model, cache_gb=1.0)
    try:
        greedy = [t for t, _ in eng.generate(PROMPT, 8)]
        a = [t for t, _ in eng.generate(PROMPT, 8, SamplingParams(1.0, 0.9, 0, seed=3))]
        b = [t for t, _ in eng.generate(PROMPT, 8, SamplingParams(1.0, 0.9, 0, seed=3))]
        k1 = [t for t, _ in eng.generate(PROMPT, 8, SamplingParams(1.5, 1.0, 1, seed=9))]
        stop = [t for t, _ in eng.generate(PROMPT, 8, stop_ids=(greedy[2],))]
    finally:
        eng.close()
    assert a == b
    assert k1 == greedy
    assert stop == greedy[:2] and eng.last_stats.stop_reason == "stop token"


def test_missing_expert_file_names_drive_and_file(k3_model, tmp_path):
    root = tf.copy_packed(k3_model, tmp_path / "copy")
    pm = PackedModel.open(str(root / "model"))
    L = pm.moe_layers[0]
    victims = [pm.expert_path(L, e) for e in range(pm.num_experts)]
    for p in victims:
        os.unlink(p)
    eng = _engine(root, cache_gb=0.0)
    try:
        with pytest.raises(ReadError) as err:
            list(eng.generate(PROMPT, 2))
    finally:
        eng.close()
    msg = str(err.value)
    assert any(f"drive {d.label}" in msg for d in pm.drives), msg
    assert any(p in msg for p in victims), msg


def test_replica_serves_a_failed_read(k3_model, tmp_path):
    # every expert with a replica on the other drive, then the primaries of one layer deleted
    root = tf.copy_packed(k3_model, tmp_path / "copy", replicas=True)
    doc = json.load(open(root / "model" / mf.MANIFEST))
    L0 = doc["experts"]["layers"][0]
    for e, loc in enumerate(doc["experts"]["locations"][str(L0)]):
        os.unlink(mf.resolve_under(doc["drives"][loc[0]]["path"], mf.expert_relpath(doc["model_id"], L0, e)))
    ref = _resident_logits(k3_model, PROMPT)
    eng = _engine(root, cache_gb=0.0)
    try:
        got = eng.model.forward(torch.tensor(PROMPT), eng.new_state(), eng.source)
    finally:
        eng.close()
    assert torch.equal(got, ref)
    # the failed primary reads were counted on their drive, and served from the replicas
    assert sum(d["errors"] for d in eng.source.per_drive().values()) > 0


def test_context_limit_is_a_clear_error(k3_model):
    eng = _engine(k3_model, cache_gb=0.0, max_len=8)
    try:
        with pytest.raises(UsageError, match="context limit"):
            list(eng.generate(PROMPT + [1, 2], 2))
        with pytest.raises(UsageError, match="empty"):
            list(eng.generate([], 2))
    finally:
        eng.close()


def test_keep_freed_memory_on_glibc_unless_the_user_tunes_malloc(monkeypatch):
    """A CPU engine has glibc's malloc keep freed blocks (no mmap per large block, no trimming); a user's own
    malloc settings, or DELTAFIN_KEEP_FREED_MEMORY=0, leave it alone."""
    import os
    import sys

    from deltafin.runtime import host_memory

    monkeypatch.setattr(host_memory, "_done", False)
    for name, value in (("DELTAFIN_KEEP_FREED_MEMORY", "0"), ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"),
                        ("MALLOC_ARENA_MAX", "2")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert host_memory.keep_freed_memory() is False and host_memory._done is False
    glibc = sys.platform.startswith("linux") and bool(os.confstr("CS_GNU_LIBC_VERSION"))
    for k in [k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"]:
        monkeypatch.delenv(k)
    monkeypatch.delenv("DELTAFIN_KEEP_FREED_MEMORY", raising=False)
    assert host_memory.keep_freed_memory() is glibc
    assert host_memory.keep_freed_memory() is glibc  # once is enough; a second call says the same


def test_a_trunk_the_gpu_cannot_hold_runs_on_the_cpu_or_is_refused_before_it_loads(k3_model, monkeypatch):
    """On CUDA a trunk larger than the GPU is split (runtime/offload_plan.py); a GPU too small for the head and one
    layer runs every layer on the CPU, and what --gpu-layers/--gpu-memory-gb ask for that the GPU cannot hold gets
    one line naming the option and the fix, before any trunk byte is read."""
    from deltafin.runtime import engine as eng_mod

    monkeypatch.setattr(eng_mod, "resolve_device", lambda d: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 8 << 30))
    read = []
    with monkeypatch.context() as m:
        m.setattr(PackedModel, "trunk_records", lambda self, *a, **k: read.append(1) or {})
        for kw, msg in ((dict(gpu_layers=2), r"--gpu-layers 2: .*more than the memory free on cuda \(0\.00 GB\) "
                                             r"holds; give --gpu-layers 0$"),
                        (dict(gpu_memory_gb=0.5), r"--gpu-memory-gb 0\.50 \(0\.00 GB of it is free\): the head and "
                                                  r"the last layer need 2\.15 GB .*--gpu-memory-gb 2\.15 or more")):
            with pytest.raises(UsageError, match=msg) as e:
                Engine(str(k3_model / "model"), EngineOptions(device="cuda", **kw))
            assert "\n" not in str(e.value) and not read
    eng = Engine(str(k3_model / "model"), EngineOptions(device="cuda", cache_gb=0.0))
    try:
        assert eng.offload.gpu_layers == 0 and eng.device.type == "cpu" and eng.device_label == "cpu"
        assert eng.offload.describe().startswith("GPU: none, CPU: layers 0-") and "+ head" in eng.offload.describe()
        assert len(list(eng.generate([1, 2, 3], 2, stop_ids=()))) == 2
    finally:
        eng.close()


def test_the_gpu_memory_cap_names_the_device_by_its_index(k3_model, monkeypatch):
    """--gpu-memory-gb caps the caching allocator through torch.cuda.set_per_process_memory_fraction, which takes
    a device index: "cuda" alone has none (the current device's is given). Stopped right after the call."""
    from deltafin.runtime import engine as eng_mod

    class Capped(Exception):
        pass

    got = []

    def cap(fraction, device=None):
        got.append((fraction, device))
        raise Capped

    monkeypatch.setattr(eng_mod, "resolve_device", lambda d: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", cap)
    with pytest.raises(Capped):
        Engine(str(k3_model / "model"), EngineOptions(device="cuda", gpu_memory_gb=20.0))
    assert got == [(pytest.approx(20e9 / (80 << 30)), 0)]


def _cgroup(tmp_path, lines: str, files: dict[str, str]) -> tuple[str, str]:
    proc, root = tmp_path / "cgroup", tmp_path / "fs"
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc.write_text(lines)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return str(proc), str(root)


def test_available_memory_is_bounded_by_the_processs_cgroup_limit(tmp_path):
    import psutil

    from deltafin.runtime import host_memory

    system = psutil.virtual_memory().available
    gb = 1 << 30
    # v2: the group's own limit (2 GB, 1.5 used of which 0.5 inactive page cache), its parent's none ("max")
    proc, root = _cgroup(tmp_path / "v2", "0::/box/job\n", {
        "box/job/memory.max": str(2 * gb), "box/job/memory.current": str(3 * gb // 2),
        "box/job/memory.stat": f"anon 1\ninactive_file {gb // 2}\n", "box/memory.max": "max",
        "box/memory.current": str(5 * gb)})
    assert host_memory.available_bytes(proc, root) == min(system, gb)
    # v1: the parent's limit is the tighter one; the child's "no limit" is v1's 2^63 - 4096
    proc, root = _cgroup(tmp_path / "v1", "9:cpu:/\n4:memory:/a/b\n", {
        "memory/a/b/memory.limit_in_bytes": str(2**63 - 4096), "memory/a/b/memory.usage_in_bytes": str(gb),
        "memory/a/memory.limit_in_bytes": str(gb + gb // 4), "memory/a/memory.usage_in_bytes": str(gb),
        "memory/a/memory.stat": "total_inactive_file 0\n"})
    assert host_memory.available_bytes(proc, root) == min(system, gb // 4)
    # usage above the limit: nothing left, not a negative figure; no cgroup file: the system's figure
    proc, root = _cgroup(tmp_path / "over", "0::/\n", {"memory.max": str(gb), "memory.current": str(2 * gb)})
    assert host_memory.available_bytes(proc, root) == 0
    assert host_memory.available_bytes(str(tmp_path / "none"), root) == pytest.approx(system, rel=0.2)
