"""``deltafin run`` and ``deltafin chat``: generate text with the routed experts streamed from the drives."""

from __future__ import annotations

import argparse
import json
import sys

from deltafin.errors import UsageError


def add_engine_args(p, stats: bool = True, routes: bool = True) -> None:
    """The flags of every command that loads a model; ``stats``/``routes``: only where they do something."""
    p.add_argument("model", help="packed model folder, or the id of a model 'deltafin list' shows")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA, then Apple MPS, then CPU), cpu, cuda or mps; the choice is printed at start")
    p.add_argument("--cache-gb", type=float, default=None,
                   help="memory for cached experts (default: half of free memory after the trunk, printed at start; "
                        "GPU memory on CUDA)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="compute threads (torch.set_num_threads; default: torch's choice, printed at start)")
    p.add_argument("--io-threads", type=int, default=4,
                   help="reader threads per drive, i.e. reads in flight per drive (what --threads set in earlier versions)")
    p.add_argument("-c", "--ctx-size", "--max-model-len", "--max-len", dest="max_len", type=int, default=None, metavar="N",
                   help="context limit in tokens (default: the model's max_position_embeddings, lowered to what "
                        "free memory holds; printed at start)")
    p.add_argument("--chat-template-file", metavar="FILE",
                   help="Jinja chat template to use instead of the checkpoint's (as in tokenizer_config.json)")
    p.add_argument("--drive-map", action="append", metavar="LABEL=PATH", help="drive LABEL is now mounted at PATH")
    p.add_argument("--emulate-drives", metavar="SPEC", help="serve reads through an emulated drive set")
    p.add_argument("--verify-reads", action="store_true", help="check every expert read against its checksum")
    if stats:
        p.add_argument("--stats-json", metavar="PATH", help="write the run's statistics as JSON")
    if routes:
        p.add_argument("--record-routes", metavar="PATH",
                       help="write the routing trace (JSONL: per decoded token, per MoE layer, the expert ids) for "
                            "'deltafin place --policy coactivation|replicas --trace PATH'")
    p.add_argument("--quiet", action="store_true", help="print only the generated text")


def add_sampling_args(p) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--temperature", "--temp", type=float, default=0.7, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling: keep the smallest set of tokens "
                                                             "whose probability reaches this")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[],
                   help="stop string, repeatable; backslash escapes are read (\\n\\n: a blank line)")


def add_prompt_args(p, command: str) -> None:
    p.add_argument("--system-prompt", "--system", dest="system", metavar="TEXT",
                   help="system message (applied through the chat template)")
    if command != "run":
        return
    p.add_argument("-p", "--prompt", help="prompt text; '-' reads it from stdin (piped stdin is read anyway)")
    p.add_argument("-f", "--file", metavar="FILE", help="read the prompt from FILE ('-': stdin)")
    p.add_argument("--prompt-ids", help="prompt as comma-separated token ids (no template)")
    p.add_argument("--raw", action="store_true",
                   help="feed the prompt as plain text; by default it is one user turn of the chat template")
    p.add_argument("--chat-template", action="store_true", help=argparse.SUPPRESS)  # the default now


def open_engine(args):
    from deltafin.interfaces.paths import resolve_packed
    from deltafin.runtime.engine import Engine, EngineOptions
    from deltafin.store.manifest import parse_drive_map

    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"-t/--threads {args.threads}: compute threads must be >= 1")
        import torch

        torch.set_num_threads(args.threads)
    opts = EngineOptions(
        device=args.device,
        cache_gb=args.cache_gb,
        threads=args.io_threads,
        verify_reads=args.verify_reads,
        drive_map=parse_drive_map(args.drive_map),
        emulate_drives=args.emulate_drives,
        max_len=args.max_len,
        record_routes=getattr(args, "record_routes", None),
        progress=not args.quiet,
    )
    template = _read_template(args.chat_template_file) if args.chat_template_file else None
    eng = Engine(resolve_packed(args.model), opts)
    if template is not None:
        if eng.codec is None:
            eng.close()
            raise UsageError(f"--chat-template-file: {eng.packed.path} has no tokenizer files to use it with")
        try:
            eng.codec.use_template(template, f"--chat-template-file {args.chat_template_file}")
        except UsageError:
            eng.close()
            raise
    if not args.quiet:
        print(start_line(eng, args), file=sys.stderr)
    return eng


def _read_template(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--chat-template-file {path}: cannot read it ({e})") from None
    if "{%" not in text and "{{" not in text:
        raise UsageError(f"--chat-template-file {path}: not a Jinja chat template (no {{% %}} or {{{{ }}}})")
    return text


def start_line(eng, args) -> str:
    import torch

    from deltafin import fmt

    dev = f"{eng.device} (auto)" if args.device == "auto" else str(eng.device)
    cache = "" if args.cache_gb is not None else " (half of free memory after the trunk)"
    return (f"[deltafin] {eng.packed.model_id} ({eng.packed.family}) on {dev}; trunk "
            f"{fmt.size(eng.packed.doc['trunk']['bytes'])} resident; expert cache {fmt.size(eng.cache_bytes)}{cache}; "
            f"context {eng.opts.max_len:,} tokens ({eng.context_reason}); {torch.get_num_threads()} compute threads, "
            f"{args.io_threads} reader threads x {len(eng.packed.drives)} drive(s), "
            f"{'direct' if eng.source.direct else 'buffered'} I/O")


def sampling_params(args):
    from deltafin.runtime.sampling import SamplingParams

    temp = 0.0 if args.greedy else args.temperature
    return SamplingParams(temp, args.top_p, args.top_k, args.seed)


def run(args) -> int:
    return _run(args) if args.command == "run" else _chat(args)


def _prompt_ids(eng, args) -> list[int]:
    from deltafin.interfaces.prompt import prompt_text

    if args.prompt_ids:
        try:
            return [int(t) for t in args.prompt_ids.split(",")]
        except ValueError:
            raise UsageError(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers") from None
    text = prompt_text(args)
    if text is None:
        raise UsageError("give a prompt: -p TEXT, -f FILE, or pipe it into stdin (or --prompt-ids 1,2,3)")
    if eng.codec is None:
        raise UsageError(f"{eng.packed.path} has no tokenizer files; give the prompt as --prompt-ids")
    if args.raw or not eng.codec.has_chat_template:
        if args.system:
            raise UsageError("--system-prompt needs the chat template; drop --raw (or the system prompt)")
        if args.chat_template:
            raise UsageError("--chat-template: this model's checkpoint has no chat template; drop the flag")
        return eng.codec.prompt_ids(text)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    return eng.codec.chat(messages + [{"role": "user", "content": text}])


def _run(args) -> int:
    from deltafin.interfaces.prompt import stop_strings

    eng = open_engine(args)
    try:
        prompt = _prompt_ids(eng, args)
        for tok, delta in eng.generate(prompt, args.max_tokens, sampling_params(args), stop_strings=stop_strings(args)):
            sys.stdout.write(delta if eng.codec else f"{tok} ")
            sys.stdout.flush()
        sys.stdout.write("\n")
        _report(eng, args)
    finally:
        eng.close()
    return 0


def _report(eng, args) -> None:
    st = eng.last_stats
    if not args.quiet:
        print(st.summary(), file=sys.stderr)
        if eng.routes is not None:
            print(f"[deltafin] routes of {eng.routes.tokens} decoded tokens in {eng.routes.path}", file=sys.stderr)
    if args.stats_json:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(args.stats_json, st.to_json())


def _chat(args) -> int:
    from deltafin.interfaces.repl import run_chat

    eng = open_engine(args)
    try:
        return run_chat(eng, args)
    finally:
        eng.close()


def _turn_tokens(eng, messages: list[dict], user: str, pending: int | None) -> list[int] | None:
    """Tokens that extend the conversation already in the model state by one user turn.

    The template renders the history (without a generation prompt) and the history plus the new turn
    (with one); the new tokens are the difference. None when the second does not extend the first.
    """
    before = eng.codec.chat(messages, add_generation_prompt=False) if messages else []
    messages.append({"role": "user", "content": user})
    after = eng.codec.chat(messages)
    if after[: len(before)] != before:
        return None
    head: list[int] = []
    if pending is not None and pending in before[-4:]:  # the stop token and what the template puts after it
        j = len(before) - 1 - before[::-1].index(pending)
        head = before[j:]
    return head + after[len(before):]


def dump(stats) -> str:
    return json.dumps(stats.to_json())
