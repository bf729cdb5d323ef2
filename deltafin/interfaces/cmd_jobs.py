"""``deltafin batch`` and ``deltafin classify``: resumable jobs over many inputs, with shared expert reads."""

from __future__ import annotations

import os
import sys

from deltafin.errors import UsageError


def add_batch_args(p) -> None:
    from deltafin.interfaces.cmd_run import add_engine_args, add_sampling_args

    add_engine_args(p, routes=False)  # sequences decode together: no per-token routes to record
    p.add_argument("input", help="JSONL: {\"id\", \"prompt\"} or {\"id\", \"messages\"} with optional max_tokens, "
                                 "temperature, top_p, seed, stop")
    p.add_argument("output", help="JSONL results, appended; a re-run skips ids already there")
    add_sampling_args(p)
    p.add_argument("--batch-size", type=int, default=8, help="prompts prefilled and decoded together")
    p.add_argument("--no-progress", action="store_true")


def add_classify_args(p) -> None:
    from deltafin.interfaces.cmd_run import add_engine_args

    add_engine_args(p, routes=False)  # one forward pass per input: nothing is decoded
    p.add_argument("inputs", help="a file (one input), a folder (each file one input) or JSONL {\"id\", \"text\"}")
    p.add_argument("--labels", required=True, help="comma-separated labels, e.g. yes,no")
    p.add_argument("--template", default="{input}", help="prompt text with {input} where the input goes")
    p.add_argument("--chat-template", action="store_true",
                   help="wrap the templated text as one user turn with the checkpoint's chat template")
    p.add_argument("--label-prefix", default="",
                   help="text put before every label when it is tokenized (e.g. ' ' for word tokenizers)")
    p.add_argument("-o", "--out", required=True, help="results file, appended and resumable ('-': stdout)")
    p.add_argument("--format", choices=["jsonl", "csv"], help="default: from --out's extension, else jsonl")
    p.add_argument("--batch-size", type=int, default=8, help="inputs prefilled together (shared expert reads)")
    p.add_argument("--no-progress", action="store_true")


def run(args) -> int:
    return _batch(args) if args.command == "batch" else _classify(args)


def _bar(args, total: int, unit: str):
    if args.no_progress or args.quiet or total == 0:
        return None
    from deltafin.progress import bar

    return bar(total, args.command, unit)


def _write_stats(args, doc: dict) -> None:
    if args.stats_json:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(args.stats_json, doc)


def _batch(args) -> int:
    from deltafin.interfaces.cmd_run import open_engine, sampling_params
    from deltafin.jobs.batch import BatchRun, Defaults, load_batch
    from deltafin.jobs.files import check_output, open_regular
    from deltafin.jobs.results import ResultLog
    from deltafin.store.locks import output_lock

    os.close(open_regular(args.input, "input file"))
    check_output(args.output, [args.input])
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    from deltafin.interfaces.prompt import stop_strings

    items = load_batch(args.input, Defaults(args.max_tokens, sampling_params(args), stop_strings(args)))
    lock = output_lock(args.output, "batch")  # one writer per output: held until the process ends
    out = ResultLog(args.output, "jsonl")
    try:
        todo = sum(not out.has(it.rec.key) for it in items)
        if not args.quiet:
            print(f"[deltafin] {len(items)} records, {len(items) - todo} already in {args.output}"
                  + (f"; cut a partial last line ({out.repaired_bytes} bytes)" if out.repaired_bytes else ""),
                  file=sys.stderr)
        eng = open_engine(args)
        bar = _bar(args, todo, "rec")
        try:
            summary = BatchRun(eng, out, args.batch_size, bar).run(items)
        finally:
            if bar is not None:
                bar.close()
            eng.close()
    finally:
        out.close()
        if lock is not None:
            lock.release()
    if not args.quiet:
        print(summary.line(), file=sys.stderr)
    _write_stats(args, summary.to_json())
    return 0


def _classify(args) -> int:
    from deltafin.interfaces.cmd_run import open_engine
    from deltafin.jobs.classify import (
        Classifier,
        ClassifyRun,
        check_template,
        check_text,
        csv_columns,
        gather_inputs,
        parse_labels,
    )
    from deltafin.jobs.results import ResultLog

    labels = parse_labels(args.labels)
    check_template(args.template)  # before the model loads
    check_text(args.label_prefix, "--label-prefix")
    from deltafin.jobs.files import check_output
    from deltafin.store.locks import output_lock

    check_output(args.out, [args.inputs])
    skipped: list[str] = []
    items = gather_inputs(args.inputs, skipped)
    if skipped and not args.quiet:
        print(f"[deltafin] skipped {len(skipped)} special file(s) in {args.inputs}: " + "; ".join(skipped),
              file=sys.stderr)
    fmt = args.format or ("csv" if args.out.endswith(".csv") else "jsonl")
    lock = output_lock(args.out, "classify")  # one writer per output: held until the process ends
    eng = open_engine(args)
    try:
        clf = Classifier(eng, labels, args.template, args.chat_template, args.label_prefix)
        out = ResultLog(args.out, fmt, csv_columns(labels) if fmt == "csv" else None)
        try:
            bar = _bar(args, sum(not out.has(it.key) for it in items), "input")
            summary = ClassifyRun(clf, out, args.batch_size, bar).run(items)
            if bar is not None:
                bar.close()
        finally:
            out.close()
    finally:
        eng.close()
        if lock is not None:
            lock.release()
    if not args.quiet:
        print(summary.line(), file=sys.stderr)
    _write_stats(args, summary.to_json())
    return 0
