"""Command-line habits from other local runners: flag aliases, prompt sources, escapes, defaults in help,
device auto, context default, BOS, Hugging Face repo ids from the local cache, the packed-model catalog."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from deltafin import cli
from deltafin.errors import UsageError
from deltafin.interfaces.prompt import prompt_text, unescape


def test_version_and_python_m():
    r = subprocess.run([sys.executable, "-m", "deltafin", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("deltafin ")
    r = subprocess.run([sys.executable, "-m", "deltafin", "run", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0
    out = " ".join(r.stdout.split())
    for needle in ("(default: 128)", "(default: auto)", "-c N, --ctx-size N", "--max-model-len", "--io-threads",
                   "-t THREADS, --threads THREADS", "-f FILE", "--system-prompt", "--raw", "(default: 0.95)"):
        assert needle in out, needle
    assert "default: None" not in out and "default: False" not in out


@pytest.mark.parametrize("argv", [["-v", "list"], ["list", "-v"], ["list", "--log-level", "INFO"],
                                  ["--log-level", "info", "list"]])
def test_verbose_and_log_level_anywhere(argv):
    args = cli.build_parser().parse_args(argv)
    assert cli._log_level(args) == 20


def test_log_level_default_and_override():
    ap = cli.build_parser()
    assert cli._log_level(ap.parse_args(["list"])) == 30
    assert cli._log_level(ap.parse_args(["-v", "list", "--log-level", "error"])) == 40


def test_aliases_map_to_one_option():
    ap = cli.build_parser()
    for flag in ("-c", "--ctx-size", "--max-model-len", "--max-len"):
        assert ap.parse_args(["run", "m", flag, "512"]).max_len == 512
    a = ap.parse_args(["run", "m", "-t", "3", "--io-threads", "6"])
    assert (a.threads, a.io_threads, a.device, a.max_len) == (3, 6, "auto", None)
    assert ap.parse_args(["chat", "m", "--system", "terse"]).system == "terse"
    assert ap.parse_args(["verify", "m", "--threads", "2"]).io_threads == 2


def test_unescape():
    assert unescape(r"\n\n") == "\n\n"
    assert unescape(r"a\tb\\n") == "a\tb\\n"
    assert unescape(r"\x41\u00e9 ünï") == "Aé ünï"
    assert unescape("plain") == "plain"


class _Stdin(io.StringIO):
    def __init__(self, text: str, tty: bool):
        super().__init__(text)
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def _args(**kw):
    return SimpleNamespace(**({"prompt": None, "file": None, "prompt_ids": None} | kw))


def test_prompt_sources(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("from a file\n")
    assert prompt_text(_args(prompt="x"), _Stdin("ignored", False)) == "x"
    assert prompt_text(_args(prompt="-"), _Stdin("from stdin", True)) == "from stdin"
    assert prompt_text(_args(), _Stdin("piped", False)) == "piped"
    assert prompt_text(_args(), _Stdin("", False)) is None
    assert prompt_text(_args(), _Stdin("typed", True)) is None  # a terminal is not read unless asked
    assert prompt_text(_args(file=str(f)), _Stdin("", True)) == "from a file\n"
    with pytest.raises(UsageError, match="not both"):
        prompt_text(_args(prompt="x", file=str(f)))
    with pytest.raises(UsageError, match="nope.txt: cannot read"):
        prompt_text(_args(file=str(tmp_path / "nope.txt")))


def test_device_auto_picks_the_best_available():
    import torch

    from deltafin.runtime.engine import resolve_device

    want = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto").type == want
    with pytest.raises(UsageError, match="choose auto, cpu, cuda, mps or mlx"):
        resolve_device("tpu")


def test_context_default_from_the_model_bounded_by_memory():
    from deltafin.runtime.prefill_plan import default_context

    tc = {"max_position_embeddings": 131072, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 2, "hidden_size": 512}
    per_tok = 2 * 2 * 64 * 4 * 4  # K and V, 2 heads of 64, 4 layers, float32
    n, why = default_context(tc, 10**12)
    assert n == 131072 and "max_position_embeddings" in why
    n, why = default_context(tc, per_tok * 5000)
    assert n == 4096 and "the model allows 131,072" in why


def test_bos_where_the_tokenizer_config_asks(tmp_path):
    from deltafin.runtime.tokenizer import load_codec
    from deltafin.tiny import save_byte_tokenizer

    save_byte_tokenizer(tmp_path, 320)
    codec = load_codec(str(tmp_path), {})
    plain = codec.prompt_ids("hi")
    assert plain == codec.encode("hi") and codec.bos_id is None
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg | {"add_bos_token": True,
                                                                      "bos_token": "<|im_start|>"}))
    codec = load_codec(str(tmp_path), {})
    assert codec.bos_id == 257 and codec.prompt_ids("hi") == [257] + plain
    assert codec.prompt_ids("<|im_start|>hi") == [257] + plain  # never twice


def _fake_hf_cache(root: Path, repo: str) -> Path:
    d = root / f"models--{repo.replace('/', '--')}"
    snap = d / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (d / "refs").mkdir()
    (d / "refs" / "main").write_text("a" * 40)
    (snap / "config.json").write_text("{}")
    return snap


def test_hf_repo_id_from_the_local_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    from deltafin.interfaces.paths import resolve_checkpoint, resolve_packed

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = _fake_hf_cache(tmp_path / "hub", "acme/tiny-moe")
    assert Path(resolve_checkpoint("acme/tiny-moe")) == snap
    with pytest.raises(UsageError, match="acme/other: no such folder, and not a Hugging Face repo in the local"):
        resolve_checkpoint("acme/other")
    with pytest.raises(UsageError, match="is a Hugging Face checkpoint, not a packed model; pack it first"):
        resolve_packed("acme/tiny-moe")
    with pytest.raises(UsageError, match="deltafin list"):
        resolve_packed("no-such-model")


def test_stop_strings_are_unescaped():
    from deltafin.interfaces.prompt import stop_strings

    assert stop_strings(SimpleNamespace(stop=[r"\n\n", "END"])) == ("\n\n", "END")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    from deltafin.tiny import build_tiny, save_byte_tokenizer

    root = tmp_path_factory.mktemp("conv")
    build_tiny("qwen3_moe", root / "src", vocab_size=320)
    save_byte_tokenizer(root / "src", 320)
    assert cli.main(["pack", str(root / "src"), str(root / "tiny-qwen"), "--drive", f"a:{root / 'da'}=2",
                     "--drive", f"b:{root / 'db'}=1", "--create", "--no-progress"]) == 0
    return root


def _stats(argv, tmp_path) -> dict:
    out = tmp_path / "s.json"
    assert cli.main([*argv, "--stats-json", str(out), "--quiet", "-n", "2", "--greedy", "--cache-gb", "0"]) == 0
    return json.loads(out.read_text())


def test_run_by_id_with_the_chat_template_by_default(packed, tmp_path, capsys):
    templated = _stats(["run", "tiny-qwen", "-p", "hi"], tmp_path)  # the id 'deltafin pack' recorded
    raw = _stats(["run", str(packed / "tiny-qwen"), "-p", "hi", "--raw"], tmp_path)
    system = _stats(["run", "tiny-qwen", "-p", "hi", "--system-prompt", "be brief"], tmp_path)
    assert raw["prompt_tokens"] == 2
    assert templated["prompt_tokens"] > 2 and system["prompt_tokens"] > templated["prompt_tokens"] + 8
    capsys.readouterr()
    assert cli.main(["run", "tiny-qwen", "-p", "hi", "--raw", "--system-prompt", "x", "-n", "1"]) == 2
    assert "--system-prompt needs the chat template" in capsys.readouterr().err


def test_start_line_names_device_context_and_threads(packed, capsys):
    assert cli.main(["run", "tiny-qwen", "--prompt-ids", "5,6", "-n", "1", "-t", "1", "--cache-gb", "0"]) == 0
    err = capsys.readouterr().err
    assert "on cpu (auto)" in err or "(auto)" in err
    assert "context 256 tokens (the model's max_position_embeddings)" in err
    assert "1 compute threads, 4 reader threads x 2 drive(s)" in err
    assert "I/O, read buffers " in err  # mapped when the model opened (StreamingExperts.reserve_buffers)


def test_list_and_rm(packed, tmp_path, capsys, monkeypatch):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "tiny-qwen" in out and "2 drive(s)  ok" in out
    assert cli.main(["list", str(packed)]) == 0  # found by looking in a folder too, listed once
    assert capsys.readouterr().out.count("tiny-qwen ") == 1
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert cli.main(["rm", "tiny-qwen"]) == 2
    assert "pass --yes" in capsys.readouterr().err
    # A copy to remove, so the module's model stays for the other tests.

    from deltafin.tiny import build_tiny

    build_tiny("olmoe", tmp_path / "src")
    assert cli.main(["pack", str(tmp_path / "src"), str(tmp_path / "gone"), "--drive", f"{tmp_path / 'x'}=1",
                     "--drive", f"{tmp_path / 'y'}=1", "--create", "--no-progress"]) == 0
    assert (tmp_path / "x" / "gone").is_dir() and (tmp_path / "y" / "gone").is_dir()
    assert cli.main(["rm", "gone", "--yes"]) == 0
    assert not (tmp_path / "x" / "gone").exists() and not (tmp_path / "y" / "gone").exists()
    assert not (tmp_path / "gone").exists() and (tmp_path / "x").is_dir()
    capsys.readouterr()
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "gone" not in out and "tiny-qwen" in out


def test_chat_template_file(packed, tmp_path, capsys):
    t = tmp_path / "t.jinja"
    t.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")
    s = _stats(["run", "tiny-qwen", "-p", "hi", "--chat-template-file", str(t)], tmp_path)
    assert s["prompt_tokens"] == len("[user]hi[assistant]")  # the byte tokenizer: one token per byte
    bad = tmp_path / "plain.txt"
    bad.write_text("hello")
    capsys.readouterr()
    assert cli.main(["run", "tiny-qwen", "-p", "hi", "--chat-template-file", str(bad)]) == 2
    assert "not a Jinja chat template" in capsys.readouterr().err


def test_flags_only_where_they_do_something():
    subs = {p.prog.split()[-1]: p for p in cli._subparsers(cli.build_parser())}

    def flags(name):
        return {s for a in subs[name]._actions for s in a.option_strings}

    assert "--record-routes" in flags("run") and "--record-routes" in flags("chat")
    assert "--record-routes" not in flags("batch") and "--record-routes" not in flags("classify")
    assert "--stats-json" not in flags("serve") and "--stats-json" in flags("batch")
    assert "--raw" in flags("run") and "--raw" not in flags("chat") and "-p" not in flags("chat")
    for name in subs:
        assert {"-v", "--log-level"} <= flags(name), name
