"""Batch jobs and classification: resumable output, per-record errors, bad inputs, label scoring."""

from __future__ import annotations

import json
import math

import pytest
import torch

from deltafin.cli import main
from deltafin.errors import UsageError
from deltafin.jobs.batch import Defaults, load_batch
from deltafin.jobs.classify import Classifier, ClassifyRun, gather_inputs, parse_labels
from deltafin.jobs.results import ResultLog
from deltafin.runtime.engine import Engine, EngineOptions
from tests.tiny import pack_tiny

ENGINE_ARGS = ["--cache-gb", "0.05", "--max-len", "256", "--io-threads", "2", "--quiet"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs")
    return pack_tiny(root, "deepseek_v3", tokenizer=True)


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = Engine(model_dir, EngineOptions(exact=True, cache_gb=0.05, max_len=256, threads=2))
    yield eng
    eng.close()


def write_jsonl(path, recs) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))
    return str(path)


def read_out(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


RECORDS = [
    {"id": "a", "prompt": "Revenue for the quarter"},
    {"id": 2, "messages": [{"role": "user", "content": "Draft a note."}], "max_tokens": 5},
    {"id": "c", "prompt": "Costs", "temperature": 0.9, "seed": 7},
    {"id": "d", "prompt": "x" * 300},  # longer than the 256-token context: an error entry, the job goes on
    {"id": "e", "prompt": "Margins", "top_p": 0.5, "temperature": 0.7, "seed": 1, "stop": ["zz", "q"]},
    {"id": "f", "prompt": "Cash flow was"},
]


def batch(model_dir, inp, out, *extra) -> int:
    return main(["batch", model_dir, str(inp), str(out), "--greedy", "-n", "8", "--batch-size", "3",
                 "--no-progress", *ENGINE_ARGS, *extra])


def test_batch_resumes_after_a_crash_and_equals_an_uninterrupted_run(model_dir, tmp_path, monkeypatch):
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    assert batch(model_dir, inp, tmp_path / "whole.jsonl") == 0
    whole = {r["id"]: r for r in read_out(tmp_path / "whole.jsonl")}
    assert set(whole) == {r["id"] for r in RECORDS}
    assert "context limit" in whole["d"]["error"] and whole[2]["completion_tokens"] <= 5
    assert all("text" in r for k, r in whole.items() if k != "d")

    real, calls = ResultLog.append, []

    def dying(self, rec):
        if len(calls) == 3:
            raise RuntimeError("killed")
        calls.append(rec["id"])
        real(self, rec)

    monkeypatch.setattr(ResultLog, "append", dying)
    with pytest.raises(RuntimeError, match="killed"):
        batch(model_dir, inp, tmp_path / "out.jsonl")
    assert [r["id"] for r in read_out(tmp_path / "out.jsonl")] == calls
    monkeypatch.setattr(ResultLog, "append", real)
    assert batch(model_dir, inp, tmp_path / "out.jsonl", "--batch-size", "2") == 0  # resumes, other grouping
    again = read_out(tmp_path / "out.jsonl")
    assert sorted(map(str, (r["id"] for r in again))) == sorted(str(r["id"]) for r in RECORDS)  # once each
    assert {r["id"]: r for r in again} == whole
    assert batch(model_dir, inp, tmp_path / "out.jsonl") == 0  # all done: nothing written
    assert read_out(tmp_path / "out.jsonl") == again


def test_partial_trailing_line_is_cut_and_nothing_else_lost(model_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2] + RECORDS[5:])
    done = '{"id": "a", "text": "kept as written", "finish_reason": "stop"}\n'
    (tmp_path / "out.jsonl").write_text(done + '{"id": 2, "text": "half a li')
    assert batch(model_dir, inp, tmp_path / "out.jsonl") == 0
    data = (tmp_path / "out.jsonl").read_text()
    assert data.startswith(done)
    ids = [r["id"] for r in read_out(tmp_path / "out.jsonl")]
    assert sorted(map(str, ids)) == ["2", "a", "f"]


@pytest.mark.parametrize("lines, words", [
    (['{"id": "a", "prompt": "x"}', '{"id": "b", "prompt": '], ["line 2", "invalid JSON"]),
    (['{"id": "a", "prompt": "x", "temprature": 0.5}'], ["line 1", "unknown field 'temprature'"]),
    (['{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}'], ["line 2", "duplicate id 'a'", "line 1"]),
    (['{"id": "a"}'], ["line 1", "exactly one of"]),
    (['{"prompt": "x"}'], ["line 1", '"id"']),
    (['{"id": "a", "prompt": "x", "max_tokens": 0}'], ["line 1", "max_tokens"]),
    (['{"id": "a", "prompt": "x", "stop": [1]}'], ["line 1", "stop"]),
    (['["a", "b"]'], ["line 1", "JSON object"]),
])
def test_bad_batch_inputs_name_the_line_and_field(tmp_path, lines, words):
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    with pytest.raises(UsageError) as e:
        load_batch(inp, Defaults())
    for w in words:
        assert w in str(e.value)
    assert str(tmp_path / "in.jsonl") in str(e.value)


def test_bad_input_via_cli_writes_nothing_and_keeps_old_output(model_dir, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", ['{"id": "a", "prompt": "x"}', "{oops"])
    (tmp_path / "out.jsonl").write_text('{"id": "z", "text": "old"}\n')
    assert batch(model_dir, inp, tmp_path / "out.jsonl") == 2
    assert "line 2: invalid JSON" in capsys.readouterr().err
    assert (tmp_path / "out.jsonl").read_text() == '{"id": "z", "text": "old"}\n'
    assert batch(model_dir, tmp_path / "missing.jsonl", tmp_path / "out.jsonl") == 2
    assert "missing.jsonl: cannot read" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ classify

LABELS = ["y", "no", "maybe"]  # one, two and five tokens under the byte tokenizer
TEXTS = ["The figures reconcile.", "Revenue is overstated by 4%.", "See attached.", "Cash is fine", "Q3?"]


def manual_logp(eng: Engine, prompt: list[int], label: list[int]) -> float:
    """log p(label | prompt) token by token with engine.forward: the definition classify must match."""
    st = eng.new_state()
    logits, total = eng.forward(prompt, st), 0.0
    for i, t in enumerate(label):
        total += float(torch.log_softmax(logits.float(), -1)[t])
        if i + 1 < len(label):
            logits = eng.forward([t], st)
    return total


def classify(engine, items, out, batch_size, fmt="jsonl", **kw):
    clf = Classifier(engine, LABELS, "Is this fine? {input}\nAnswer: ", **kw)
    log = ResultLog(str(out), fmt, None if fmt == "jsonl" else __import__(
        "deltafin.jobs.classify", fromlist=["csv_columns"]).csv_columns(LABELS))
    try:
        ClassifyRun(clf, log, batch_size).run(items)
    finally:
        log.close()
    return clf


def test_classify_probabilities_are_the_product_over_label_tokens(engine, tmp_path):
    items = gather_inputs(write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS)]))
    clf = classify(engine, items, tmp_path / "out.jsonl", batch_size=3)
    out = read_out(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == list(range(len(TEXTS)))
    assert [len(ids) for ids in clf.label_ids] == [1, 2, 5]
    for rec, text in zip(out, TEXTS, strict=True):
        assert math.isclose(sum(rec["probs"].values()), 1.0, abs_tol=1e-9)
        assert rec["label"] == max(rec["probs"], key=rec["probs"].get)
        prompt = clf.prompt(text)
        for lab, ids in zip(LABELS, clf.label_ids, strict=True):
            want = manual_logp(engine, prompt, ids)
            assert math.log(rec["raw_probs"][lab]) == pytest.approx(want, abs=2e-4), (text, lab)


def test_batched_classify_equals_one_at_a_time(engine, tmp_path):
    items = gather_inputs(write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS)]))
    classify(engine, items, tmp_path / "batched.jsonl", batch_size=5)
    classify(engine, items, tmp_path / "alone.jsonl", batch_size=1)
    for a, b in zip(read_out(tmp_path / "batched.jsonl"), read_out(tmp_path / "alone.jsonl"), strict=True):
        assert a["id"] == b["id"] and a["label"] == b["label"]
        for lab in LABELS:
            assert a["raw_probs"][lab] == pytest.approx(b["raw_probs"][lab], rel=1e-4)


def test_classify_folder_csv_errors_per_record_and_resume(model_dir, tmp_path, capsys):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("Totals match the ledger.")
    (d / "b.txt").write_bytes(b"\xff\xfe not text")
    (d / "c.txt").write_text("long " * 80)  # 400 tokens: longer than the context
    (d / "d.txt").write_text("Fine.")
    out = tmp_path / "out.csv"
    args = ["classify", model_dir, str(d), "--labels", "y, no ,maybe", "--template", "{input} ok?", "-o", str(out),
            "--no-progress", "--batch-size", "2", *ENGINE_ARGS]
    assert main(args) == 0
    rows = out.read_text().splitlines()
    assert rows[0] == "id,label,p_y,p_no,p_maybe,raw_y,raw_no,raw_maybe,error"
    by_id = {r.split(",")[0]: r for r in rows[1:]}
    assert sorted(by_id) == ["a.txt", "b.txt", "c.txt", "d.txt"]
    assert "not valid UTF-8" in by_id["b.txt"] and "b.txt" in by_id["b.txt"]
    assert "context limit" in by_id["c.txt"]
    p = [float(x) for x in by_id["a.txt"].split(",")[2:5]]
    assert sum(p) == pytest.approx(1.0, abs=1e-5)
    with open(out, "a") as f:
        f.write("e.txt,y,0.")  # a crash mid-line
    (d / "e.txt").write_text("New input.")
    assert main(args) == 0
    rows2 = out.read_text().splitlines()
    assert rows2[: len(rows)] == rows and len(rows2) == len(rows) + 1 and rows2[-1].startswith("e.txt,")


def test_classify_bad_inputs(model_dir, engine, tmp_path, capsys):
    with pytest.raises(UsageError, match="comma-separated"):
        parse_labels(" , ")
    with pytest.raises(UsageError, match="repeated"):
        parse_labels("yes,yes")
    with pytest.raises(UsageError, match="empty"):
        Classifier(engine, [])
    with pytest.raises(UsageError, match="placeholder"):
        Classifier(engine, ["y"], template="no slot")
    with pytest.raises(UsageError, match="nope.txt: no such"):
        gather_inputs(str(tmp_path / "nope.txt"))
    bad = write_jsonl(tmp_path / "in.jsonl", ['{"id": 1, "text": "a"}', '{"id": 2, "txt": "b"}'])
    with pytest.raises(UsageError, match=r"line 2: unknown field 'txt'"):
        gather_inputs(bad)
    bad = write_jsonl(tmp_path / "in2.jsonl", ['{"id": 1, "text": "a"}', '{"id": 2, "text": "b"'])
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 9, "label": "y"}\n')
    assert main(["classify", model_dir, bad, "--labels", "y,n", "-o", str(out), *ENGINE_ARGS]) == 2
    assert "in2.jsonl line 2: invalid JSON" in capsys.readouterr().err
    assert out.read_text() == '{"id": 9, "label": "y"}\n'
    assert main(["classify", model_dir, bad, "--labels", ",", "-o", str(out), *ENGINE_ARGS]) == 2
    assert "--labels" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ plain parts

def test_stop_text_holds_back_a_possible_stop_string():
    from deltafin.runtime.batched import StopText

    st, shown = StopText(("END", "\n\n")), []
    for text in ["a", "ab", "abE", "abEN", "abENx", "abENx\n", "abENx\n\n tail"]:
        out, hit = st.update(text)
        shown.append(out)
        if hit:
            break
    assert shown == ["a", "b", "", "", "ENx", "", ""] and st.text == "abENx"
    assert "".join(shown) + st.flush() == "abENx"


def test_result_log_refuses_a_foreign_file_and_other_columns(tmp_path):
    p = tmp_path / "out.jsonl"
    p.write_text('{"id": 1}\nnot json\n{"id": 2}\n')
    with pytest.raises(UsageError, match="line 2: not a result record"):
        ResultLog(str(p))
    assert p.read_text() == '{"id": 1}\nnot json\n{"id": 2}\n'  # left as it was
    c = tmp_path / "out.csv"
    log = ResultLog(str(c), "csv", ["id", "label", "error"])
    log.append({"id": "x,\"y\"\nz", "label": "yes"})
    log.close()
    again = ResultLog(str(c), "csv", ["id", "label", "error"])
    assert again.has('x,"y"\nz') and not again.has("x")
    with pytest.raises(UsageError, match="columns"):
        ResultLog(str(c), "csv", ["id", "label", "p_maybe", "error"])
