"""A newcomer's plausible mistakes: each gets one line naming the value and the fix, before any model loads;
habits of other runners (-m, -ngl, --n-predict); the command list; run --help grouped; deltafin tiny; the
Python API (load, generate, stream, chat, classify) against the engine it wraps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import deltafin
from deltafin import cli
from deltafin.errors import UsageError
from tests.tiny import pack_tiny

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return pack_tiny(tmp_path_factory.mktemp("newcomer"), "qwen3_moe", tokenizer=True)


def _one_line(capsys, argv, *needles) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.mark.parametrize("extra, needles", [
    (["--stats-json", "/missing/dir/s.json"], ["--stats-json /missing/dir/s.json", "mkdir -p /missing/dir"]),
    (["--cache-gb", "-1"], ["--cache-gb -1", "0 or more"]),
    (["--io-threads", "0"], ["--io-threads 0", "1 or more"]),
    (["-n", "0"], ["-n/--max-tokens 0", "1 or more"]),
    (["-n", "-5"], ["-n/--max-tokens -5"]),
    (["-c", "100000"], ["-c/--ctx-size 100,000", "256 positions", "-c 256"]),
    (["--raw", "--system-prompt", "x"], ["--system-prompt needs the chat template", "drop --raw"]),
])
def test_run_mistakes_are_one_line_before_the_model_loads(model, capsys, monkeypatch, extra, needles):
    from deltafin.runtime import engine

    monkeypatch.setattr(engine.Engine, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    _one_line(capsys, ["run", model, "-p", "hi", *extra], *needles)


def test_prompt_ids_outside_the_vocabulary(model, capsys, monkeypatch):
    from deltafin.runtime import engine

    monkeypatch.setattr(engine.Engine, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    _one_line(capsys, ["run", model, "--prompt-ids", "1,2,99999"], "token id 99999", "0..319")


def test_missing_prompt_and_unpacked_checkpoint_and_port(model, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", open("/dev/null"))  # noqa: SIM115
    _one_line(capsys, ["run", model], "give a prompt: -p TEXT")
    ckpt = Path(model).parent / "src"
    _one_line(capsys, ["run", str(ckpt), "-p", "hi"], "not a packed model", f"deltafin pack {ckpt} OUT")
    _one_line(capsys, ["serve", model, "--port", "99999"], "--port 99999", "1-65535")
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    err = _one_line(capsys, ["inspect", "models/typo"], "models/typo", "check the name")
    assert "hf download" not in err


def test_interrupted_pack_says_rerun_resumes(tmp_path, capsys, monkeypatch):
    from deltafin.interfaces import cmd_store

    def stop(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cmd_store, "run", stop)
    assert cli.main(["pack", str(tmp_path), str(tmp_path / "o")]) == 130
    assert "re-run the same command to resume" in capsys.readouterr().err


def test_habits_of_other_runners(model, capsys):
    argv, notes = cli.habits(["run", "-m", model, "-ngl", "99", "--n-predict", "3", "-p", "hi"])
    assert argv[:2] == ["run", model] and not notes  # -ngl is --gpu-layers itself (partial GPU offload)
    args = cli.build_parser().parse_args(argv)
    assert (args.model, args.device, args.gpu_layers, args.max_tokens) == (model, "auto", 99, 3)
    argv, _ = cli.habits(["batch", "--model=m", "in.jsonl", "out.jsonl"])
    assert cli.build_parser().parse_args(argv).model == "m"
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for c in ("pull", "run", "chat", "serve", "tiny", "first steps"):
        assert c in out


def test_run_help_is_grouped():
    r = subprocess.run([sys.executable, "-m", "deltafin", "run", "--help"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    heads = [h for h in ("prompt:", "sampling:", "model and memory:", "drives:", "output:") if h in r.stdout]
    assert heads == ["prompt:", "sampling:", "model and memory:", "drives:", "output:"]
    assert r.stdout.index("-p PROMPT") < r.stdout.index("--cache-gb")


def test_version_from_the_clones_parent_folder(tmp_path):
    """The clone's folder named 'deltafin' in the working directory shadows nothing: an editable install's
    finder (as setuptools writes it) still serves the package."""
    (tmp_path / "deltafin").symlink_to(REPO)
    code = (
        "import sys, importlib.util, runpy\n"
        "from importlib.machinery import PathFinder\n"
        f"PKG = {str(REPO / 'deltafin')!r}\n"
        "class F:\n"
        "    @classmethod\n"
        "    def find_spec(cls, name, path=None, target=None):\n"
        "        if name == 'deltafin':\n"
        "            return importlib.util.spec_from_file_location(name, PKG + '/__init__.py')\n"
        "        if name.startswith('deltafin.') and name.count('.') == 1:\n"
        "            return PathFinder.find_spec(name, path=[PKG])\n"
        "sys.meta_path.insert(0, F)\n"
        "sys.argv = ['deltafin', '--version']\n"
        "runpy.run_module('deltafin', run_name='__main__', alter_sys=True)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.startswith("deltafin "), r.stderr[-500:]


def test_tiny_command_writes_a_packable_checkpoint(tmp_path, capsys):
    assert cli.main(["tiny", "k3", str(tmp_path / "k3")]) == 0
    assert (tmp_path / "k3" / "config.json").exists() and "deltafin pack" in capsys.readouterr().out
    _one_line(capsys, ["tiny", "nosuch", str(tmp_path / "x")], "no such family", "qwen3_moe")
    assert cli.main(["pack", str(tmp_path / "k3"), str(tmp_path / "k3m"), "--no-progress"]) == 0


def test_python_api(model):
    from deltafin.runtime.engine import Engine, EngineOptions
    from deltafin.runtime.sampling import SamplingParams

    with deltafin.load(model, cache_gb=0.01, max_len=256) as m:
        assert not m.engine.opts.exact  # the fast path, as the CLI
        out = m.generate("hello there", max_tokens=6, temperature=0)
        assert out.stats.prompt_tokens > 2 and len(out.tokens) >= 1 and out.finish_reason
        pieces = list(m.stream("hello there", max_tokens=6, temperature=0))
        assert "".join(pieces) == out.text == m.last.text
        assert m.chat([{"role": "user", "content": "hello there"}], max_tokens=6, temperature=0).tokens == out.tokens
        ref_ids = m.engine.codec.chat([{"role": "user", "content": "hello there"}])
        got = m.classify(["a", "b"], ["x", "y"])
        assert [sorted(r["probs"]) for r in got] == [["x", "y"]] * 2
        assert abs(sum(got[0]["probs"].values()) - 1) < 1e-6
        with pytest.raises(UsageError, match="max_tokens=0"):
            m.generate("hi", max_tokens=0)
        with pytest.raises(UsageError, match="token id 99999"):
            m.generate([1, 99999])
    eng = Engine(model, EngineOptions(cache_gb=0.01, max_len=256, exact=False))
    try:
        want = [t for t, _ in eng.generate(ref_ids, 6, SamplingParams())]
    finally:
        eng.close()
    assert out.tokens[: len(want)] == want
    with pytest.raises(UsageError, match="cache_gb= -1"):
        deltafin.load(model, cache_gb=-1)


def test_chat_prints_one_stats_line_per_turn(model, capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/stats\nagain\n"))
    assert cli.main(["chat", model, "-n", "4", "--greedy", "--cache-gb", "0.01"]) == 0
    cap = capsys.readouterr()
    turns = [line for line in cap.err.splitlines() if line.endswith("/stats for more]")]
    assert len(turns) == 2 and all(line.startswith("[") and "tok/s" in line for line in turns)
    assert "waiting on I/O" not in cap.err  # the full block only on /stats
    assert "waiting on I/O" in cap.out and "context:" in cap.out
    assert "math on" not in cap.out  # kernel names only with -v


def test_stats_name_kernels_only_with_verbose():
    from deltafin.runtime.stats import RunStats

    st = RunStats(tokens=[1, 2], kernels=["cpu:mxfp4_gemm_silu"], cache_bytes=10**10, cache_hit_rate=0.88)
    assert "cpu:mxfp4_gemm_silu" not in st.summary() and "cpu:mxfp4_gemm_silu" in st.summary(verbose=True)
    assert "88% of expert lookups found in memory (expert cache limit 10.0 GB)" in st.summary()
