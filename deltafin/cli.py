"""The ``deltafin`` command. Subcommands import their code lazily: ``--help`` never imports torch."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# subcommand -> (module under deltafin.interfaces, help line)
COMMANDS = {
    "demo": ("cmd_demo", "build a small random MoE model, pack it over two drives, verify and inspect it"),
    "pull": ("cmd_pull", "download a Hugging Face repo and pack each shard as it lands (--delete-source: "
                         "peak disk is the pack plus a few shards)"),
    "pack": ("cmd_store", "pack a Hugging Face checkpoint into a model dir + one file per expert over drives"),
    "verify": ("cmd_store", "re-read every expert file and check its checksum"),
    "inspect": ("cmd_store", "show what a packed model holds, where, and what streams per token"),
    "run": ("cmd_run", "generate text from a prompt, streaming routed experts from the drives"),
    "chat": ("cmd_run", "multi-turn chat with the checkpoint's chat template; state kept between turns"),
    "bench": ("cmd_bench", "benchmarks, each figure beside the limit it is measured against"),
    "serve": ("cmd_serve", "OpenAI-compatible HTTP server (needs the 'serve' extra: FastAPI, uvicorn)"),
    "batch": ("cmd_jobs", "resumable batch generation over a JSONL file of prompts, decoded together"),
    "classify": ("cmd_jobs", "probability of each label as the next tokens, for many inputs; resumable"),
    "place": ("cmd_drives", "change where expert files live (placement policy), moving only what must move"),
    "simulate": ("cmd_drives", "what-ifs for Kimi K3 over drive sets: tok/s, time to first token, scaling plots"),
    "list": ("cmd_models", "list packed models: size, drives, where their files are"),
    "rm": ("cmd_models", "remove a packed model: its expert folders on every drive and its model folder"),
    "tiny": ("cmd_models", "write a tiny random checkpoint of a family (to try pack, run and serve on)"),
}
# commands whose first positional is a model: -m/--model MODEL goes there too (llama.cpp's and mlx-lm's habit)
MODEL_FIRST = ("run", "chat", "serve", "batch", "classify", "verify", "inspect", "rm", "place")


def _add_pack(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="Hugging Face checkpoint folder (config.json + safetensors)")
    p.add_argument("out", nargs="?", help="output model folder (not needed with --plan)")
    p.add_argument("--drive", action="append", default=[], metavar="[LABEL:]PATH[=GBPS]",
                   help="expert drive root, repeatable; GB/s is measured with a short direct-read probe if omitted")
    p.add_argument("--experts", default="auto", choices=["auto", "mxfp4", "bf16", "f32"],
                   help="expert format: auto keeps released MXFP4/INT4 bytes and turns float experts into MXFP4")
    p.add_argument("--trunk", default="int8", choices=["int8", "bf16"],
                   help="resident trunk: int8 weights (per-row scales) or kept as released (bf16/f32)")
    p.add_argument("--placement", default="bandwidth",
                   help="bandwidth (default), coactivation, replicas, roundrobin, stripe-bandwidth or stripe-equal; "
                        "see 'deltafin place --help'")
    p.add_argument("--trace", metavar="ROUTES.jsonl", help="routing trace for --placement coactivation|replicas")
    p.add_argument("--spare-gb", type=float, default=None, help="replicas: GB per drive for extra copies")
    p.add_argument("--model-id", help="folder name of this model on the drives (default: OUT's name)")
    p.add_argument("--plan", action="store_true", help="print what the pack would write; read no weights")
    p.add_argument("--create", action="store_true",
                   help="create --drive folders that do not exist (by default a missing folder is an error: an "
                        "unmounted drive's path would fill the disk that holds it)")
    p.add_argument("--repair", action="store_true", help="re-check existing expert files and rewrite bad ones")
    p.add_argument("--overwrite", action="store_true",
                   help="OUT holds a model packed from another checkpoint: remove its files (from every drive) first")
    p.add_argument("--json", metavar="PATH", help="write the plan or summary as JSON")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="pack NaN/inf weights as they are (by default they are refused as damage, naming the tensor)")
    p.add_argument("--allow-unused", action="store_true",
                   help="pack trunk tensors the model code never reads (by default refused: a wrong model_type)")
    p.add_argument("--no-progress", action="store_true")


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="packed model folder (inspect also takes a checkpoint folder: a projection)")
    p.add_argument("--drive-map", action="append", metavar="LABEL=PATH",
                   help="drive LABEL is now mounted at PATH (drives move between machines)")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")


def _synthetic_bench(sub, name: str, help_: str, layers: int, experts: int) -> argparse.ArgumentParser:
    """A benchmark over a synthetic model with a family's expert size (Kimi K3's by default), read through the
    engine's source."""
    from deltafin.bench.shapes import SHAPES

    b = sub.add_parser(name, help=help_)
    b.add_argument("--shape", default="k3", metavar="NAME",
                   help=f"the family's routed-expert size and top-k: {', '.join(SHAPES)} (default k3)")
    b.add_argument("--hidden", type=int, help="override the shape's expert input width")
    b.add_argument("--inter", type=int, help="override the shape's expert intermediate width")
    b.add_argument("--layers", type=int, default=layers, help="MoE layers of the synthetic model")
    b.add_argument("--experts", type=int, default=None,
                   help=f"expert files per layer (files: layers x experts; default the shape's count, at most "
                        f"{experts})")
    b.add_argument("--k", type=int, default=None, help="experts routed per token per layer (default the shape's)")
    b.set_defaults(files_cap=experts)
    b.add_argument("--threads", type=int, default=8, help="reads in flight")
    b.add_argument("--io-only", action="store_true", help="skip the expert math: measure reads alone")
    b.add_argument("--device", default="cpu")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--dir", default=None, help="scratch folder on the drive to measure")
    if name == "decode":  # --synthetic k3-slice: the slice's trunk split between the GPU and the CPU
        from deltafin.interfaces.cmd_run import add_offload_args

        add_offload_args(b)
    b.add_argument("--json", metavar="PATH")
    from deltafin.interfaces.cmd_run import add_compute_args

    add_compute_args(b)
    return b


def _add_bench(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    b = sub.add_parser("pack", help="pack throughput beside the disk's raw write rate")
    b.add_argument("--dir", default=None, help="scratch folder on the disk to measure (default: a temp dir)")
    b.add_argument("--gb", type=float, default=4.0, help="GB of expert bytes to pack (default 4)")
    b.add_argument("--k3-slice", action="store_true",
                   help="instead: pack and run a Kimi K3 slice at the real widths (vocab 163840, hidden 7168); "
                        "reports pack's peak memory beside the largest tensor (writes ~10 GB of source)")
    b.add_argument("--slice-layers", type=int, default=3, help="--k3-slice: layers (layer 0 dense, then MoE)")
    b.add_argument("--slice-experts", type=int, default=32, help="--k3-slice: experts per MoE layer (real size)")
    b.add_argument("--slice-prompt", type=int, default=512, help="--k3-slice: prompt tokens of the run (default 512)")
    b.add_argument("--bf16", action="store_true",
                   help="instead: convert a random bf16 Qwen3-MoE (1.4 GB) to MXFP4 experts and an int8 trunk")
    b.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="--bf16: where the random checkpoint is built and kept (default: inside --dir, removed)")
    b.add_argument("--json", metavar="PATH")
    b = _synthetic_bench(sub, "decode", "expert streaming at Kimi K3's expert size beside the raw read rate", 4, 64)
    b.add_argument("--synthetic", default="k3", choices=["k3", "k3-slice"],
                   help="k3: K3 expert files streamed; k3-slice: a K3 slice at the real widths in GPU memory")
    b.add_argument("--tokens", type=int, default=6)
    b.add_argument("--context", type=int, nargs="+", metavar="N", default=[],
                   help="k3-slice: also decode N tokens deep (e.g. 32768 131072 200000), beside the default context")
    b.add_argument("--verify-reads", action=argparse.BooleanOptionalAction, default=True,
                   help="check every read against its checksum, as 'run' does by default (its cost is reported)")
    b = _synthetic_bench(sub, "prefill", "time to first token beside the read floor (cold cache, K3 expert size)",
                         4, 96)
    b.add_argument("--prompt", "--tokens", type=int, default=512, help="prompt tokens")
    b.add_argument("--synthetic", default="k3", choices=["k3", "k3-slice"],
                   help="k3: K3 expert files streamed; k3-slice: a K3 slice at the real widths in GPU memory")
    from deltafin.interfaces.cmd_drives import add_bench_drives_args

    add_bench_drives_args(sub)
    b = _synthetic_bench(sub, "classify", "inputs per hour beside the read floor (K3 expert size, cold cache)", 2, 64)
    b.add_argument("--inputs", type=int, default=16, help="inputs to classify")
    b.add_argument("--tokens", type=int, default=128, help="tokens per input")
    b.add_argument("--batch", type=int, default=8, help="inputs prefilled together (one pass each)")
    b = sub.add_parser("distributed", help="expert-parallel decode over local processes (gloo; NCCL with --device "
                                           "cuda) beside the slower rank's read bound, with the collective time")
    b.add_argument("--worlds", default="2", help="rank counts to run, comma-separated (e.g. 1,2: N ranks vs one)")
    b.add_argument("--spec", default="report4", help="emulated drives, split between the ranks in order")
    b.add_argument("--scale", type=float, default=0.016,
                   help="rate scale of the emulated drives (default 0.016: report4's 25 GB/s becomes 0.4 GB/s; "
                        "the bytes come from memory at that rate)")
    b.add_argument("--layers", type=int, default=4, help="MoE layers of the synthetic K3-expert-size model")
    b.add_argument("--experts", type=int, default=32, help="experts per layer")
    b.add_argument("--k", type=int, default=16, help="experts routed per token per layer")
    b.add_argument("--tokens", type=int, default=4, help="decoded tokens measured")
    b.add_argument("--warmup", type=int, default=1, help="tokens decoded before measuring")
    b.add_argument("--threads", type=int, default=4, help="reader threads per drive")
    b.add_argument("--io-only", action="store_true", help="skip the expert math: the reads and the collectives")
    b.add_argument("--resident", action="store_true",
                   help="cache every owned expert first (one pass), then decode from memory: N ranks vs one "
                        "without drives in the way (the GPU comparison)")
    b.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    b.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--dir", default=None, help="scratch folder")
    b.add_argument("--json", metavar="PATH")
    from deltafin.bench.ingest_cli import add_args as add_ingest_args

    add_ingest_args(sub)
    from deltafin.bench.peer import add_args as add_peer_args

    add_peer_args(sub)
    b = sub.add_parser("grammar", help="constrained decoding's token mask per token beside the lm_head's cost")
    b.add_argument("--vocab", type=int, default=65_536, help="tokenizer vocabulary to train (default 65,536)")
    b.add_argument("--tokens", type=int, default=200, help="tokens to choose under each grammar")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", metavar="PATH")
    b = sub.add_parser("kernels", help="weight matmuls at Kimi K3's shapes: GB/s of weight bytes beside memory bandwidth")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mlx"])
    b.add_argument("--seconds", type=float, default=2.0, help="time per case")
    b.add_argument("--isa", choices=["native", "avx2", "avx2-novnni", "portable"], default=None,
                   help="CPU: the kernels built for less than this CPU has (what x86 machines without AVX-512 run); "
                        "default DELTAFIN_CPU_ISA, else native")
    b.add_argument("--json", metavar="PATH")
    b = sub.add_parser("warm", help="warm decode of a mid-size MoE (all experts in memory) beside the memory roofline")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    b.add_argument("--tokens", type=int, default=16, help="decoded tokens timed")
    b.add_argument("--json", metavar="PATH")
    from deltafin.interfaces.cmd_run import add_compute_args

    add_compute_args(b)


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default where it has a meaningful one (not None, off or empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        h = action.help or ""
        d = action.default
        if (not action.option_strings or d is None or isinstance(d, bool) or d == argparse.SUPPRESS or d == []
                or "default" in h.lower() or h == argparse.SUPPRESS):
            return action.help
        return f"{h} (default: %(default)s)" if h else "(default: %(default)s)"


LOG_LEVELS = ("debug", "info", "warning", "error")


def _add_logging(p: argparse.ArgumentParser, top: bool) -> None:
    """-v and --log-level on the top parser and on every subcommand, so they work before or after it."""
    keep = {} if top else {"default": argparse.SUPPRESS}  # a subcommand's absent flag keeps the top's value
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details (--log-level info)", **keep)
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, metavar="LEVEL",
                   help=f"one of {', '.join(LOG_LEVELS)} (default: warning; info with -v)", **keep)


def _subparsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    return [c for a in p._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices.values()]


def _finish(p: argparse.ArgumentParser, top: bool = False) -> None:
    """Every parser in the tree: defaults in help, and the logging flags anywhere on the line."""
    p.formatter_class = HelpFormatter
    if not top:
        _add_logging(p, top=False)
    for child in _subparsers(p):
        _finish(child)


def build_parser() -> argparse.ArgumentParser:
    from deltafin import __version__

    ap = argparse.ArgumentParser(prog="deltafin", description="Run MoE models far larger than memory by "
                                 "streaming routed experts from SSDs.")
    ap.add_argument("--version", action="version", version=f"deltafin {__version__}")
    _add_logging(ap, top=True)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == "pack":
            _add_pack(p)
        elif name in ("verify", "inspect"):
            _add_model(p)
            if name == "verify":
                p.add_argument("--io-threads", "--threads", dest="io_threads", type=int, default=4,
                               help="reader threads (reads in flight)")
        elif name == "demo":
            p.add_argument("--dir", help="work folder (default: a new temp dir)")
            p.add_argument("--keep", action="store_true", help="keep the work folder")
        elif name == "bench":
            _add_bench(p)
        elif name in ("run", "chat"):
            from deltafin.interfaces import cmd_run

            cmd_run.add_prompt_args(p, name)
            cmd_run.add_sampling_args(p)
            cmd_run.add_engine_args(p)
        elif name in ("serve", "batch", "classify"):
            from deltafin.interfaces import cmd_jobs, cmd_serve

            {"serve": cmd_serve.add_serve_args, "batch": cmd_jobs.add_batch_args,
             "classify": cmd_jobs.add_classify_args}[name](p)
        elif name in ("place", "simulate"):
            from deltafin.interfaces import cmd_drives

            (cmd_drives.add_place_args if name == "place" else cmd_drives.add_simulate_args)(p)
        elif name in ("list", "rm", "tiny"):
            from deltafin.interfaces import cmd_models

            {"list": cmd_models.add_list_args, "rm": cmd_models.add_rm_args, "tiny": cmd_models.add_tiny_args}[name](p)
        elif name == "pull":
            from deltafin.interfaces.cmd_pull import add_pull_args

            add_pull_args(p)
        if name in ("run", "chat"):
            cmd_run.order_groups(p)
    _finish(ap, top=True)
    return ap


# what re-running an interrupted command does
RESUMABLE = {
    "pack": "re-run the same command to resume: finished expert files are kept",
    "pull": "re-run the same command to resume: packed shards are not downloaded again",
    "place": "re-run the same command to finish the move (it is journaled)",
    "batch": "re-run the same command to resume: ids already in the output are skipped",
    "classify": "re-run the same command to resume: ids already in the output are skipped",
}

# commands that run under torchrun: rank 0 runs them, the other ranks follow its steps (interfaces/cmd_dist.py)
CLUSTER_COMMANDS = ("run", "chat", "serve", "batch", "classify")


def _log_level(args: argparse.Namespace) -> int:
    if getattr(args, "log_level", None):
        return getattr(logging, args.log_level.upper())
    return logging.INFO if getattr(args, "verbose", False) else logging.WARNING


def habits(argv: list[str]) -> tuple[list[str], list[str]]:
    """Flags other runners' users type, rewritten to Deltafin's: ``-m MODEL`` becomes the model positional,
    (``-ngl N`` / ``--n-gpu-layers N`` are spellings of ``--gpu-layers N``). Returns the new argv and the notes to
    print."""
    cmd = next((i for i, a in enumerate(argv) if a in COMMANDS), None)
    if cmd is None:
        return argv, []
    head, rest, notes, model = argv[: cmd + 1], [], [], None
    it = iter(argv[cmd + 1 :])
    for a in it:
        flag, eq, val = a.partition("=")
        if flag in ("-m", "--model") and argv[cmd] in MODEL_FIRST:
            model = val if eq else next(it, None)
            if model is None:
                notes.append(f"error: {flag} needs a model: {flag} MODEL")
        else:
            rest.append(a)
    if model is not None:
        rest.insert(0, model)
    return head + rest, notes


def check_args(args: argparse.Namespace) -> None:
    """Numbers and output paths any command may take, checked before its module runs (and loads a model)."""
    from deltafin.interfaces import checks

    if getattr(args, "max_tokens", None) is not None:
        checks.check_max_tokens(args.max_tokens)
    if hasattr(args, "io_threads") or hasattr(args, "cache_gb"):
        cache = getattr(args, "cache_gb", None)  # simulate's --cache-gb is a list of sizes, checked there
        checks.check_engine_numbers(cache if isinstance(cache, (int, float)) else None, getattr(args, "io_threads", None),
                                    getattr(args, "max_len", None),
                                    getattr(args, "threads", None) if args.command in CLUSTER_COMMANDS else None)
    if hasattr(args, "gpu_layers"):
        from deltafin.errors import UsageError
        from deltafin.runtime.offload_plan import check_offload_args

        check_offload_args(args.gpu_layers, args.gpu_memory_gb, getattr(args, "device", "auto"))
        if args.command == "bench" and getattr(args, "synthetic", "k3-slice") != "k3-slice" and (
                args.gpu_layers is not None or args.gpu_memory_gb is not None):
            raise UsageError("--gpu-layers/--gpu-memory-gb split a trunk between GPU and CPU; the streamed bench "
                             "(--synthetic k3) has no trunk: add --synthetic k3-slice --device cuda")
    for flag in ("stats_json", "json", "record_routes"):
        v = getattr(args, flag, None)
        if isinstance(v, str):
            checks.check_output_path(v, "--" + flag.replace("_", "-"))
    if args.command == "serve":
        checks.check_port(args.port)


def main(argv: list[str] | None = None) -> int:
    argv, notes = habits(list(sys.argv[1:] if argv is None else argv))
    for n in notes:
        print(f"deltafin: {n}", file=sys.stderr)
    if any(n.startswith("error:") for n in notes):
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        print("\nfirst steps: 'deltafin demo' (a small random model end to end); 'deltafin COMMAND --help' for a "
              "command's flags")
        return 0
    logging.basicConfig(level=_log_level(args), format="%(levelname)s %(message)s")
    world, rank = int(os.environ.get("WORLD_SIZE", "1") or 1), int(os.environ.get("RANK", "0") or 0)
    name = getattr(args, "module", None) or COMMANDS[args.command][0]
    if world > 1 and args.command in CLUSTER_COMMANDS and rank != 0:
        name = "cmd_dist"
    module = importlib.import_module(f"deltafin.interfaces.{name}")
    from deltafin.errors import DeltafinError

    where = f"deltafin {args.command}" + (f" (rank {rank} of {world})" if world > 1 else "")
    try:
        check_args(args)
        return int(module.run(args) or 0)
    except DeltafinError as e:
        print(f"{where}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        again = RESUMABLE.get(args.command)
        print(f"deltafin {args.command}: interrupted" + (f"; {again}" if again else ""), file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`, which closed early
        sys.stderr.close()
        return 0
    finally:
        if world > 1 and args.command in CLUSTER_COMMANDS:
            from deltafin.runtime.cluster import shutdown

            shutdown()


if __name__ == "__main__":
    sys.exit(main())
