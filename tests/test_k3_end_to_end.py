"""Kimi K3 end to end on the tiny K3-shaped checkpoint: pack, run, chat, inspect; and the real layout's
memory projection from the shipped config and index."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest

from deltafin.cli import main
from deltafin.k3_tiny import TINY_TOKENIZER_VOCAB, write_tiny_k3, write_tiny_k3_tokenizer

SPECS = Path(__file__).resolve().parents[2] / "shared" / "specs" / "kimi-k3"


@pytest.fixture(scope="module")
def k3(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("k3e2e")
    write_tiny_k3(root / "src", vocab_size=TINY_TOKENIZER_VOCAB)
    write_tiny_k3_tokenizer(root / "src")
    assert main(["pack", str(root / "src"), str(root / "model"), "--drive", f"{root}/d0=2",
                 "--drive", f"{root}/d1=1", "--create", "--no-progress"]) == 0
    return root


def test_run_streams_text_and_writes_stats(k3, capsys):
    stats = k3 / "stats.json"
    assert main(["run", str(k3 / "model"), "-p", "Hello", "--chat-template", "-n", "6", "--greedy",
                 "--cache-gb", "0", "--stats-json", str(stats)]) == 0
    st = json.loads(stats.read_text())
    assert len(st["tokens"]) >= 1 and st["bytes_read"] > 0 and st["prefill_read_amplification"] == 1.0
    err = capsys.readouterr().err
    assert "time to first token" in err and "waiting on I/O" in err


def test_chat_keeps_state_between_turns(k3, monkeypatch, capsys):
    from deltafin.runtime import engine as eng_mod

    fed: list[int] = []
    orig = eng_mod.Engine.prefill

    def spy(self, prompts, states):
        fed.append(len(prompts[0]))
        return orig(self, prompts, states)

    monkeypatch.setattr(eng_mod.Engine, "prefill", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("first question\nsecond one\n"))
    assert main(["chat", str(k3 / "model"), "-n", "4", "--greedy", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant>") == 2
    assert len(fed) == 2 and 0 < fed[1] < fed[0] + 20  # the second turn feeds only its new tokens


def test_inspect_k3_projection(k3, capsys):
    assert main(["inspect", str(k3 / "model"), "--json", str(k3 / "inspect.json")]) == 0
    s = json.loads((k3 / "inspect.json").read_text())
    assert s["recurrent_layers"] == 9 and s["recurrent_state_bytes"] > 0
    assert s["trunk_bytes_int8"] < s["trunk_bytes_bf16"]
    assert s["streamed_bytes_per_token"] == s["expert_file_bytes"] * 2 * 12


@pytest.mark.skipif(not SPECS.exists(), reason="../shared/specs/kimi-k3 (the real config and index) is absent")
def test_real_k3_projection_from_config_and_index(tmp_path):
    for f in SPECS.iterdir():
        shutil.copy(f, tmp_path / f.name)
    out = tmp_path / "s.json"
    assert main(["inspect", str(tmp_path), "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["expert_files"] == 82_432 and s["expert_payload_bytes"] == 17_547_264
    assert s["trunk_bytes_bf16"] == 113_509_540_864
    assert s["streamed_bytes_per_token"] == 16 * 92 * s["expert_file_bytes"]
    # 69 KDA layers x 96 heads x 128 x 128 fp32 (414 MiB) plus the short-conv history
    assert 69 * 96 * 128 * 128 * 4 < s["recurrent_state_bytes"] < 0.5e9
    assert s["cache_bytes_per_1k_tokens_bf16"] == 24 * 576 * 1000 * 2
