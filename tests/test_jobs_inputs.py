"""Hostile job inputs: any id, file name, text or number a user can put in gives an error record or is refused
up front (naming the line and the field), never a crash on every re-run; special files never hang a job."""

from __future__ import annotations

import json
import os
import socket

import pytest

from deltafin.cli import main
from deltafin.errors import UsageError
from deltafin.jobs.classify import gather_inputs
from deltafin.runtime.sampling import SamplingParams
from tests.tiny import pack_tiny
from tests.waiting import bounded

ENGINE_ARGS = ["--cache-gb", "0.05", "--max-len", "256", "--threads", "2", "--quiet", "--no-progress"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return pack_tiny(tmp_path_factory.mktemp("jobs_inputs"), "deepseek_v3", tokenizer=True)


def _bounded(fn, seconds: float = 120.0):
    return bounded(fn, seconds, "an input must never hang the job")


def _batch(model_dir, tmp_path, line: str, *extra) -> int:
    (tmp_path / "in.jsonl").write_text(line + "\n")
    return main(["batch", model_dir, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "-n", "3",
                 *ENGINE_ARGS, *extra])


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("line, words", [
    ('{"id": "\\ud800", "prompt": "hi"}', ["line 1", "'id'", "lone surrogate", "U+D800"]),
    ('{"id": "a", "prompt": "hi \\ud800"}', ["line 1", "'prompt'", "lone surrogate"]),
    ('{"id": "a", "messages": [{"role": "user", "content": "\\ud83d"}]}', ["'messages'", "U+D83D"]),
    ('{"id": "a", "prompt": "hi", "stop": ["\\udc80"]}', ["'stop'", "lone surrogate"]),
    ('{"id": "a", "prompt": "hi", "seed": 1180591620717411303424, "temperature": 0.5}', ["'seed'", "18446744073709551615"]),
    ('{"id": "a", "prompt": "hi", "max_tokens": ' + "9" * 5000 + "}", ["line 1", "invalid JSON", "digits"]),
    ('{"id": "a", "prompt": "hi", "stop": ' + DEEP + "}", ["line 1", "invalid JSON", "nested too deeply"]),
    ('{"id": "a", "prompt": "hi", "temperature": NaN}', ["'temperature'", "nan"]),
], ids=["surrogate-id", "surrogate-prompt", "surrogate-messages", "surrogate-stop", "seed-2^70", "5000-digits",
        "deep-nesting", "nan-temperature"])
def test_hostile_batch_records_are_refused_up_front(model_dir, tmp_path, capsys, line, words):
    assert _batch(model_dir, tmp_path, line) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("flags, words", [
    (["--temperature", "nan"], ["temperature", "finite"]),
    (["--temperature", "inf"], ["temperature", "finite"]),
    (["--temperature", "0.5", "--seed", str(2**70)], ["seed", "64 bits"]),
])
def test_hostile_sampling_flags_are_refused(model_dir, tmp_path, capsys, flags, words):
    assert _batch(model_dir, tmp_path, '{"id": "a", "prompt": "hi"}', *flags) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words) and "Traceback" not in err


def test_sampling_params_refuse_what_the_generator_cannot_take():
    for bad in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"seed": 2**64}, {"seed": -(2**63) - 1}):
        with pytest.raises(UsageError):
            SamplingParams(**{"temperature": 0.5, **bad})
    SamplingParams(0.5, seed=2**64 - 1)  # the largest 64-bit seed is fine


def test_a_huge_max_tokens_is_bounded_by_the_context(model_dir, tmp_path):
    assert _batch(model_dir, tmp_path, '{"id": "a", "prompt": "hi", "max_tokens": 1000000000000000000000}',
                  "--greedy", "--max-len", "12") == 0
    rec = json.loads((tmp_path / "out.jsonl").read_text())
    assert rec["id"] == "a" and rec["prompt_tokens"] + rec["completion_tokens"] <= 13


def _hostile_folder(root) -> None:
    root.mkdir()
    (root / "good.txt").write_text("a plain input")
    with open(os.path.join(os.fsencode(root), b"bad\xff.txt"), "wb") as f:  # a name that is not UTF-8
        f.write(b"bytes for a name")
    os.mkfifo(root / "fifo")  # opening it to read would wait for a writer forever
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "sock"))
    sock.close()
    os.symlink("loop", root / "loop")  # a symlink loop
    os.symlink("missing", root / "dangling")
    os.symlink("/dev/zero", root / "zero")  # a device behind a link: a read that never ends
    os.symlink(".", root / "again")  # a folder loop
    (root / "big.txt").touch()
    os.truncate(root / "big.txt", (64 << 20) + 1)  # sparse: no disk cost


def test_classify_folder_with_special_files_and_odd_names(model_dir, tmp_path, capsys):
    folder = tmp_path / "in"
    _hostile_folder(folder)
    args = ["classify", model_dir, str(folder), "--labels", "yes,no", "-o", str(tmp_path / "out.jsonl"),
            *[a for a in ENGINE_ARGS if a != "--quiet"]]
    assert _bounded(lambda: main(args)) == 0
    err = capsys.readouterr().err
    assert "skipped 3 special file(s)" in err and "fifo: skipped, a FIFO" in err and "a socket" in err
    assert "zero: skipped, a character device" in err
    recs = {r["id"]: r for r in map(json.loads, open(tmp_path / "out.jsonl"))}
    assert set(recs) == {"good.txt", "bad\\xff.txt", "loop", "dangling", "big.txt"}
    assert "label" in recs["good.txt"] and "label" in recs["bad\\xff.txt"]
    assert "symlink loop" in recs["loop"]["error"] and "No such file" in recs["dangling"]["error"]
    assert "more than the context could hold" in recs["big.txt"]["error"]
    assert _bounded(lambda: main(args)) == 0  # resumes: every id is found again, nothing is added
    assert len(open(tmp_path / "out.jsonl").readlines()) == 5


def test_classify_csv_with_a_name_that_is_not_utf8_resumes(model_dir, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    with open(os.path.join(os.fsencode(folder), b"caf\xe9.txt"), "wb") as f:
        f.write(b"latin-1 name")
    args = ["classify", model_dir, str(folder), "--labels", "yes,no", "-o", str(tmp_path / "out.csv"), *ENGINE_ARGS]
    assert main(args) == 0 and main(args) == 0
    rows = (tmp_path / "out.csv").read_text().splitlines()
    assert len(rows) == 2 and rows[1].startswith("caf\\xe9.txt,")


def test_special_file_given_as_input_and_bad_labels_are_refused(model_dir, tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UsageError, match="not a regular file .a FIFO."):
        _bounded(lambda: gather_inputs(str(tmp_path / "fifo")), 30)
    out = str(tmp_path / "o.jsonl")
    (tmp_path / "t.txt").write_text("x")
    assert main(["classify", model_dir, str(tmp_path / "t.txt"), "--labels", "yes,n\udcffo", "-o", out,
                 *ENGINE_ARGS]) == 2
    assert "--labels" in capsys.readouterr().err
    assert main(["classify", model_dir, str(tmp_path / "t.txt"), "--labels", "yes,no", "--template", "\udcff{input}",
                 "-o", out, *ENGINE_ARGS]) == 2
    assert "--template" in capsys.readouterr().err


def test_classify_jsonl_with_a_lone_surrogate_is_refused(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text('{"id": "a", "text": "x\\udfff"}\n')
    with pytest.raises(UsageError, match="line 1: field 'text' holds a lone surrogate"):
        gather_inputs(str(p))


def test_ids_that_collide_in_csv_and_a_fifo_output_are_refused(tmp_path):
    from deltafin.jobs.classify import Item, _check_written_ids
    from deltafin.jobs.results import ResultLog

    out = ResultLog(str(tmp_path / "o.csv"), "csv", ["id", "label"])
    with pytest.raises(UsageError, match="same once written"):  # ClassifyRun.run checks this before any work
        _check_written_ids([Item("a\nb", "a\nb", "x"), Item("a b", "a b", "y")], out)
    out.close()
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UsageError, match="is a FIFO"):
        _bounded(lambda: ResultLog(str(tmp_path / "fifo")), 30)
