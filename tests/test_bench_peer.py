"""``deltafin bench peer``: argument checks, the path without llama.cpp, finding llama.cpp's tools, reading
llama-bench's JSON (a stand-in script), the checkpoint's released expert names, the pressure and cap probes."""

from __future__ import annotations

import json
import os
import stat

import pytest

from deltafin import cli
from deltafin.bench import peer, peer_run, peer_tools


def _main(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(["bench", "peer", *argv])
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize("argv,needle", [
    (["--pairs", "-1"], "--pairs -1"), (["--pairs", "0", "--no-capped"], "leaves nothing to run"), (["--tokens", "0"], "--tokens 0"), (["--prompt", "-1"], "--prompt -1"),
    (["--threads", "0"], "--threads 0"), (["--max-pressure", "0"], "--max-pressure 0"),
    (["--cap-gb", "-2"], "--cap-gb -2.0"), (["--llama-cpp", "/nonexistent/llama"], "/nonexistent/llama: not a folder"),
])
def test_bad_arguments_are_one_line(capsys, argv, needle):
    rc, err = _main(capsys, *argv)
    assert rc == 2 and needle in err and len(err.splitlines()) == 1, err


def test_checkpoint_is_checked_first(capsys, tmp_path):
    rc, err = _main(capsys, "--checkpoint", str(tmp_path))
    assert rc == 2 and "no config.json" in err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    rc, err = _main(capsys, "--checkpoint", str(tmp_path))
    assert rc == 2 and "model_type 'llama'" in err and len(err.splitlines()) == 1


def test_without_llama_cpp_says_how_to_get_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    rc, err = _main(capsys, "--small", "--dir", str(tmp_path / "work"))
    assert rc == 2 and "llama.cpp not found" in err and "llama-bench" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "work").exists()  # nothing built before the check


def _exe(path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_finds_tools_in_a_build_tree(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    src = tmp_path / "llama.cpp"
    (src / "build" / "bin").mkdir(parents=True)
    for name in ("llama-bench", "llama-quantize"):
        _exe(src / "build" / "bin" / name, "exit 0\n")
    with pytest.raises(peer_tools.LlamaCppMissing, match="--converter"):
        peer_tools.find_llama_cpp(str(src), None)
    # a GGUF kept with --reuse needs no converter
    assert peer_tools.find_llama_cpp(str(src), None, need_converter=False).converter == ""
    (src / "convert_hf_to_gguf.py").write_text("")
    for where in (str(src), str(src / "build" / "bin")):
        t = peer_tools.find_llama_cpp(where, None)
        assert t.bench.endswith("build/bin/llama-bench") and t.converter == str(src / "convert_hf_to_gguf.py")
    with pytest.raises(peer_tools.UsageError, match="--converter /no/such.py"):
        peer_tools.find_llama_cpp(str(src), "/no/such.py")


def test_reuse_needs_the_converter_only_where_something_is_left_to_convert(tmp_path):
    from types import SimpleNamespace

    from deltafin.bench import peer

    args = SimpleNamespace(reuse=True)
    assert not peer._reusable(args, str(tmp_path))
    gguf, packed = peer._made(str(tmp_path))
    open(gguf, "wb").close()
    os.makedirs(packed)
    assert not peer._reusable(args, str(tmp_path))  # a GGUF alone: the pack is still to be made
    open(os.path.join(packed, "deltafin.json"), "w").close()
    assert peer._reusable(args, str(tmp_path)) and not peer._reusable(SimpleNamespace(reuse=False), str(tmp_path))


def test_reads_llama_bench_json(tmp_path):
    """A stand-in llama-bench answering like the real one (-o json): pp and tg rows, depth and threads kept."""
    fake = tmp_path / "llama-bench"
    _exe(fake, """p=0; n=0; d=0; t=0
while [ $# -gt 0 ]; do case $1 in -p) p=$2;; -n) n=$2;; -d) d=$2;; -t) t=$2;; esac; shift; done
row() { echo "{\\"n_prompt\\": $1, \\"n_gen\\": $2, \\"n_depth\\": $d, \\"avg_ts\\": $3, \\"build_number\\": 7,
 \\"build_commit\\": \\"abc\\", \\"model_size\\": 99}"; }
echo "["
if [ $p -gt 0 ]; then row $p 0 $((100 * t)); echo ","; fi
row 0 $n $((10 * t + d))
echo "]"
""")
    r = peer_run.llama_side(str(fake), "m.gguf", threads=2, tokens=8, prompt=512)
    assert r["prefill"] == 200 and r["decode_depth0"] == 20 and r["decode_after_prompt"] == 532
    assert r["decode_1thread"] == 10 and r["version"] == "7 (abc)" and r["model_bytes"] == 99


def test_released_expert_names():
    names = peer_tools._per_expert({"model.layers.3.mlp.experts.gate_up_proj": (2, 8, 4),
                                    "model.layers.3.mlp.experts.down_proj": (2, 4, 4), "model.norm.weight": (4,)})
    assert names == {f"model.layers.3.mlp.experts.{e}.{w}_proj.weight": s for e in range(2)
                     for w, s in (("gate", (4, 4)), ("up", (4, 4)), ("down", (4, 4)))} | {"model.norm.weight": (4,)}


def test_pressure_and_cap_probes_answer():
    total = peer.cpu_pressure_total()
    assert total is None or total >= 0
    wrap, how, child = peer.memory_cap(1 << 30)
    assert how and (wrap is None or wrap[0] in ("systemd-run", "sh"))
    if child is not None:
        os.rmdir(child)
    assert peer.summary([3.0, 1.0, 2.0]) == "2.0 (1.0-3.0)" and peer.summary([]) == "-"


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_memory_cap_writes_the_limit_in_a_child_of_this_process_cgroup(tmp_path, monkeypatch, kind):
    """The cgroup layouts a machine without systemd-run has: v1's memory controller (limit and memory + swap) or
    v2's memory.max, a child folder of the process's own group, and the command's shell joining it."""
    monkeypatch.setattr(peer.shutil, "which", lambda name: None)
    proc = tmp_path / "cgroup"
    if kind == "v1":
        proc.write_text("4:memory:/jobs/a\n1:cpu:/\n0::/\n")
        base = tmp_path / "memory" / "jobs" / "a"
        base.mkdir(parents=True)
        (base / "memory.limit_in_bytes").write_text("max")
    else:
        proc.write_text("0::/user/b\n")
        base = tmp_path / "user" / "b"
        base.mkdir(parents=True)
        (base / "memory.max").write_text("max")
    wrap, how, child = peer.memory_cap(123456789, proc=str(proc), root=str(tmp_path))
    assert child == str(base / f"deltafin-peer-{os.getpid()}") and how == f"cgroup {kind} {child}"
    limit = "memory.limit_in_bytes" if kind == "v1" else "memory.max"
    assert (base / os.path.basename(child) / limit).read_text() == "123456789"
    assert wrap[:2] == ["sh", "-c"] and f"{child}/cgroup.procs" in wrap[2]
    wrap, how, child = peer.memory_cap(1, proc=str(tmp_path / "none"), root=str(tmp_path))
    assert wrap is None and child is None and "no cgroup v1 memory controller" in how


def test_drop_cached_takes_files_and_folders(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(os.urandom(4096))
    (tmp_path / "y").write_bytes(b"1")
    peer.drop_cached([str(tmp_path / "a"), str(tmp_path / "y")])  # no error on either


def test_bench_pack_bf16_arguments_are_checked_first(capsys, tmp_path):
    """bench pack --bf16 writes its random checkpoint at --checkpoint: a folder holding anything else is refused
    before anything is written (a real model there is never overwritten), as is a second benchmark at once."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 2048}))
    cases = [(["--bf16", "--k3-slice"], "give one of them"), (["--checkpoint", str(tmp_path / "new")], "add --bf16"),
             (["--bf16", "--checkpoint", str(real)], "holds something other")]
    for argv, needle in cases:
        rc = cli.main(["bench", "pack", *argv])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and needle in err and len(err.splitlines()) == 1, err
    assert sorted(os.listdir(real)) == ["config.json"] and not (tmp_path / "new").exists()
    kept = dict(peer_tools.SHAPES["pack"])
    kept["num_local_experts"] = kept.pop("num_experts")  # as transformers 5 saves it
    assert peer_tools.same_shape(kept, "pack") and not peer_tools.same_shape(kept, "issue")


def test_bench_pack_of_k3_size_experts_runs(tmp_path, capsys):
    """`bench pack --gb`: its synthetic K3 source passes pack's checks (every declared layer present) and the
    figure is printed beside the raw write rate of the same run."""
    from deltafin.bench.pack import run

    rec = run(str(tmp_path), 0.1)  # 2 experts a layer, 2 layers
    assert rec["expert_files"] == 4 and rec["pack_GBps"] > 0 and rec["raw_write_GBps"] > 0
    assert "vs raw write" in capsys.readouterr().out


def test_deltafin_side_runs_its_one_thread_figure_on_exactly_one_thread(tmp_path, monkeypatch):
    """The engine adapts a decode step's thread count (runtime/threads.py) and resets it after each step, so the
    1-thread figure must turn that off: otherwise it is measured on up to --threads threads."""
    import torch

    from tests.tiny import pack_tiny

    model = pack_tiny(tmp_path, "qwen3_moe")
    seen, real = [], peer_run._decode

    def spy(engine, state, first, tokens):
        out = real(engine, state, first, tokens)
        seen.append((torch.get_num_threads(), engine.threads is None))
        return out

    monkeypatch.setattr(peer_run, "_decode", spy)
    monkeypatch.setattr("deltafin.bench.kernels.bandwidth", lambda device: 10.0)
    n = torch.get_num_threads()
    try:
        r = peer_run._worker({"model": model, "threads": 2, "tokens": 3, "prompt": 4, "cache_gb": None})
    finally:
        torch.set_num_threads(n)
    assert seen[-1] == (1, True) and all(t == 2 for t, _ in seen[:-1])
    assert r["decode_1thread"] > 0 and r["repeatable"]


def test_the_capped_side_reports_its_read_bound_from_the_bytes_its_timed_steps_read(tmp_path):
    """With a cache far smaller than the experts every timed step reads some, and the bound is those bytes at the
    raw rate of the same files measured in the same run; beside it, the same bytes read one file at a time."""
    from tests.tiny import pack_tiny

    model = pack_tiny(tmp_path, "qwen3_moe")
    r = peer_run._worker({"model": model, "threads": 1, "tokens": 4, "prompt": 4, "cache_gb": 1e-6})
    assert r["bytes_read_per_token"] > 0 and r["raw_GBps"] > 0
    assert r["read_bound_tok_s"] == pytest.approx(r["raw_GBps"] * 1e9 / r["bytes_read_per_token"])
    assert r["one_read_bound_tok_s"] == pytest.approx(r["one_read_GBps"] * 1e9 / r["bytes_read_per_token"])
    assert r["one_read_GBps"] > 0 and r["misses_per_token"] > 0
    assert r["decode_capped"] > 0 and 0 <= r["hit_rate"] < 1


def test_the_timed_pack_starts_from_an_empty_folder(tmp_path, monkeypatch):
    """A pack already in the work folder is removed first: a resumed pack writes nothing and would time ~0 s."""
    from types import SimpleNamespace

    from deltafin.tiny import build_tiny

    ck = str(tmp_path / "ck")
    build_tiny("qwen3_moe", ck)

    def convert(tools, checkpoint, bf16, gguf, threads):  # llama.cpp's side stands in: files only
        for f in (bf16, gguf):
            open(f, "wb").close()
        return 0.0, 0.0

    monkeypatch.setattr(peer_tools, "convert", convert)
    args = SimpleNamespace(checkpoint=ck, small=False, reuse=False, threads=1)
    work = str(tmp_path / "work")
    os.makedirs(work)
    out = peer._prepare(args, work, None)
    marker = os.path.join(out["packed"], "left-by-an-earlier-run")
    open(marker, "w").close()
    again = peer._prepare(args, work, None)
    assert not os.path.exists(marker) and os.path.isfile(os.path.join(again["packed"], "deltafin.json"))
