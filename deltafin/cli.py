"""The ``deltafin`` command. Subcommands import their code lazily: ``--help`` never imports torch."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> (module under deltafin.interfaces, help line)
COMMANDS = {
    "demo": ("cmd_demo", "build a small random MoE model, pack it over two drives, verify and inspect it"),
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
}


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
    p.add_argument("--repair", action="store_true", help="re-check existing expert files and rewrite bad ones")
    p.add_argument("--json", metavar="PATH", help="write the plan or summary as JSON")
    p.add_argument("--no-progress", action="store_true")


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="packed model folder (inspect also takes a checkpoint folder: a projection)")
    p.add_argument("--drive-map", action="append", metavar="LABEL=PATH",
                   help="drive LABEL is now mounted at PATH (drives move between machines)")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")


def _synthetic_bench(sub, name: str, help_: str, layers: int, experts: int) -> argparse.ArgumentParser:
    """A benchmark over a synthetic model with Kimi K3's expert size, read through the engine's source."""
    b = sub.add_parser(name, help=help_)
    b.add_argument("--layers", type=int, default=layers, help="MoE layers of the synthetic model")
    b.add_argument("--experts", type=int, default=experts, help="experts per layer (files: layers x experts)")
    b.add_argument("--k", type=int, default=16, help="experts routed per token per layer")
    b.add_argument("--threads", type=int, default=8, help="reads in flight")
    b.add_argument("--io-only", action="store_true", help="skip the expert math: measure reads alone")
    b.add_argument("--device", default="cpu")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--dir", default=None, help="scratch folder on the drive to measure")
    b.add_argument("--json", metavar="PATH")
    from deltafin.interfaces.cmd_run import add_compute_args

    add_compute_args(b)
    return b


def _add_bench(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    b = sub.add_parser("pack", help="pack throughput beside the disk's raw write rate")
    b.add_argument("--dir", default=None, help="scratch folder on the disk to measure (default: a temp dir)")
    b.add_argument("--gb", type=float, default=4.0, help="GB of expert bytes to pack (default 4)")
    b.add_argument("--json", metavar="PATH")
    b = _synthetic_bench(sub, "decode", "expert streaming at Kimi K3's expert size beside the raw read rate", 4, 64)
    b.add_argument("--synthetic", default="k3", choices=["k3"], help="synthetic model shape (K3 expert sizes)")
    b.add_argument("--tokens", type=int, default=6)
    b = _synthetic_bench(sub, "prefill", "time to first token beside the read floor (cold cache, K3 expert size)",
                         4, 96)
    b.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    from deltafin.interfaces.cmd_drives import add_bench_drives_args

    add_bench_drives_args(sub)
    b = _synthetic_bench(sub, "classify", "inputs per hour beside the read floor (K3 expert size, cold cache)", 2, 64)
    b.add_argument("--inputs", type=int, default=16, help="inputs to classify")
    b.add_argument("--tokens", type=int, default=128, help="tokens per input")
    b.add_argument("--batch", type=int, default=8, help="inputs prefilled together (one pass each)")
    b = sub.add_parser("kernels", help="weight matmuls at Kimi K3's shapes: GB/s of weight bytes beside memory bandwidth")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    b.add_argument("--seconds", type=float, default=2.0, help="time per case")
    b.add_argument("--json", metavar="PATH")
    b = sub.add_parser("warm", help="warm decode of a mid-size MoE (all experts in memory) beside the memory roofline")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    b.add_argument("--tokens", type=int, default=16, help="decoded tokens timed")
    b.add_argument("--json", metavar="PATH")
    from deltafin.interfaces.cmd_run import add_compute_args

    add_compute_args(b)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="deltafin", description="Run MoE models far larger than memory by "
                                 "streaming routed experts from SSDs.")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == "pack":
            _add_pack(p)
        elif name in ("verify", "inspect"):
            _add_model(p)
            if name == "verify":
                p.add_argument("--threads", type=int, default=4)
        elif name == "demo":
            p.add_argument("--dir", help="work folder (default: a new temp dir)")
            p.add_argument("--keep", action="store_true", help="keep the work folder")
        elif name == "bench":
            _add_bench(p)
        elif name in ("run", "chat"):
            from deltafin.interfaces.cmd_run import add_engine_args, add_sampling_args

            add_engine_args(p)
            add_sampling_args(p)
            if name == "run":
                p.add_argument("-p", "--prompt", help="prompt text")
                p.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
                p.add_argument("--chat-template", action="store_true", help="wrap the prompt as one user turn")
            else:
                p.add_argument("--system", help="system message")
        elif name in ("serve", "batch", "classify"):
            from deltafin.interfaces import cmd_jobs, cmd_serve

            {"serve": cmd_serve.add_serve_args, "batch": cmd_jobs.add_batch_args,
             "classify": cmd_jobs.add_classify_args}[name](p)
        elif name in ("place", "simulate"):
            from deltafin.interfaces import cmd_drives

            (cmd_drives.add_place_args if name == "place" else cmd_drives.add_simulate_args)(p)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    module = importlib.import_module(f"deltafin.interfaces.{getattr(args, 'module', None) or COMMANDS[args.command][0]}")
    from deltafin.errors import DeltafinError

    try:
        return int(module.run(args) or 0)
    except DeltafinError as e:
        print(f"deltafin {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"deltafin {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`, which closed early
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
