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
                   help="auto (MLX on Apple Silicon where installed, else CUDA, then Apple MPS, then CPU), cpu, cuda, "
                        "mps or mlx (pip install -e '.[mlx]'); the choice is printed at start")
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
    p.add_argument("--verify-reads", action=argparse.BooleanOptionalAction, default=True,
                   help="check every expert read against its checksum (default; a bad copy is read from a "
                        "replica); --no-verify-reads skips it")
    p.add_argument("--read-deadline", type=float, default=None, metavar="SECONDS",
                   help="least time a read may take before it is retried once, then read from a replica or "
                        "reported (default 5; longer for reads queued behind many others: 10x their time at "
                        "the drive's rate)")
    if stats:
        p.add_argument("--stats-json", metavar="PATH", help="write the run's statistics as JSON")
    if routes:
        p.add_argument("--record-routes", metavar="PATH",
                       help="write the routing trace (JSONL: per decoded token, per MoE layer, the expert ids) for "
                            "'deltafin place --policy coactivation|replicas --trace PATH'")
    p.add_argument("--quiet", action="store_true", help="print only the generated text")
    p.add_argument("--dist-timeout", type=float, default=120.0, metavar="S",
                   help="under torchrun: a collective, or rank 0's silence, longer than S seconds stops the job "
                        "naming the rank (default 120)")
    p.add_argument("--dist-routing", default="check", choices=["check", "broadcast"],
                   help="under torchrun: every rank routes by the same trunk math, checked at each layer (check), or "
                        "takes rank 0's routing (broadcast: one more collective per layer, for mixed hardware)")
    add_compute_args(p)


def add_compute_args(p) -> None:
    """The compute path, shared by every command that runs a model: fused kernels unless --exact."""
    p.add_argument("--exact", action="store_true",
                   help="the float32 reference path (plain torch matmuls), token-identical to transformers")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "f32"],
                   help="activations on the fast path: auto = bf16 on CUDA, f32 on the CPU (measured faster there)")


def add_sampling_args(p) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--temperature", "--temp", type=float, default=0.7, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling: keep the smallest set of tokens "
                                                             "whose probability reaches this")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this x the top token's probability")
    p.add_argument("--repetition-penalty", "--repeat-penalty", type=float, default=1.0,
                   help="divide positive logits (multiply negative ones) of tokens already seen (1: none)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted once from seen tokens' logits")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted from seen tokens' logits once per time they were generated")
    p.add_argument("--stop", action="append", default=[],
                   help="stop string, repeatable; backslash escapes are read (\\n\\n: a blank line)")
    add_thinking_args(p)


def add_thinking_args(p) -> None:
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="turn the model's thinking on or off in chat prompts (Kimi K3; templates with "
                        "enable_thinking, such as Qwen3's); default: the template's own (Kimi K3: on)")
    p.add_argument("--effort", choices=("low", "medium", "high", "max"), default=None,
                   help="how much to think: Kimi K3's thinking_effort, or reasoning_effort where the template "
                        "has it (gpt-oss); default: the model's own")


def chat_kwargs(eng, args) -> dict:
    """codec.chat keyword arguments from --think/--no-think and --effort (checked against the template)."""
    think, effort = getattr(args, "think", None), getattr(args, "effort", None)
    if think is not None or effort is not None:
        eng.codec.check_thinking(think, effort)
    return {"thinking": think, "effort": effort}


class Printer:
    """Writes a reply as it streams: the answer to stdout, the model's reasoning to stderr (not with --quiet),
    markup and special tokens never."""

    def __init__(self, eng, prompt: list[int], chat: bool, quiet: bool, out=None):
        from deltafin.runtime.reasoning import Parts, splitter_for

        self.split = splitter_for(eng.codec, prompt, chat)
        self.quiet, self.parts, self.thinking = quiet, Parts(), False
        self.out = out or sys.stdout

    def write(self, delta: str, last: bool = False) -> None:
        parts = self.split.feed(delta)
        if last:
            parts += self.split.flush()
        self.parts += parts
        if parts.reasoning and not self.quiet:
            if not self.thinking:
                sys.stderr.write("[thinking] ")
            self.thinking = True
            sys.stderr.write(parts.reasoning)
            sys.stderr.flush()
        if parts.content:
            if self.thinking:
                sys.stderr.write("\n")
                self.thinking = False
            self.out.write(parts.content)
            self.out.flush()


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
        read_deadline_s=args.read_deadline,
        dist_timeout_s=args.dist_timeout,
        dist_routing=args.dist_routing,
        progress=not args.quiet,
        exact=args.exact,
        dtype=args.dtype,
    )
    template = _read_template(args.chat_template_file) if args.chat_template_file else None
    eng = Engine(resolve_packed(args.model), opts)
    if not args.quiet and eng.cluster is not None:
        print(f"[deltafin] rank 0 of {eng.cluster.world}: computes the experts it owns; every layer's partial "
              f"outputs are summed over the ranks", file=sys.stderr)
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

    dev = f"{eng.device_label} (auto)" if args.device == "auto" else eng.device_label
    cache = "" if args.cache_gb is not None else " (half of free memory after the trunk)"
    return (f"[deltafin] {eng.packed.model_id} ({eng.packed.family}) on {dev}; trunk "
            f"{fmt.size(eng.packed.doc['trunk']['bytes'])} resident; expert cache {fmt.size(eng.cache_bytes)}{cache}; "
            f"context {eng.opts.max_len:,} tokens ({eng.context_reason}); {torch.get_num_threads()} compute threads, "
            f"{args.io_threads} reader threads x {len(eng.packed.drives)} drive(s), "
            f"{'direct' if eng.source.direct else 'buffered'} I/O"
            + (f", read buffers {fmt.size(eng.source.reserved[1])}" if eng.source.reserved[1] else "")
            + f"; math: {eng.math_name}")


def sampling_params(args):
    from deltafin.runtime.sampling import SamplingParams

    temp = 0.0 if args.greedy else args.temperature
    return SamplingParams(temp, args.top_p, args.top_k, args.seed, args.min_p, args.presence_penalty,
                          args.frequency_penalty, args.repetition_penalty)


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
    return eng.codec.chat(messages + [{"role": "user", "content": text}], **chat_kwargs(eng, args))


def _run(args) -> int:
    from deltafin.interfaces.prompt import stop_strings

    eng = open_engine(args)
    try:
        prompt = _prompt_ids(eng, args)
        chat = eng.codec is not None and not args.prompt_ids and not args.raw and eng.codec.has_chat_template
        out = Printer(eng, prompt, chat, args.quiet)
        for tok, delta in eng.generate(prompt, args.max_tokens, sampling_params(args), stop_strings=stop_strings(args)):
            out.write(delta if eng.codec else f"{tok} ")
        out.write("", last=True)
        sys.stdout.write("\n")
        _report(eng, args)
    finally:
        eng.close()
    return 0


def _report(eng, args) -> None:
    st = eng.last_stats
    if not args.quiet:
        print(st.summary(), file=sys.stderr)
        if eng.cluster is not None:
            for r in eng.cluster_stats():
                print(f"[deltafin] rank {r['rank']}: {r['bytes_read'] / 1e9:.3f} GB of experts read, "
                      f"{r['io_wait_s']:.2f} s waiting on reads, {r['collective_s']:.2f} s in {r['collectives']} "
                      f"all-reduces (cumulative)", file=sys.stderr)
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


def _turn_tokens(eng, messages: list[dict], user: str, pending: int | None, opts: dict) -> list[int] | None:
    """Tokens that extend the conversation already in the model state by one user turn.

    The template renders the history (without a generation prompt) and the history plus the new turn
    (with one); the new tokens are the difference. None when the second does not extend the first.
    """
    before = eng.codec.chat(messages, add_generation_prompt=False, **opts) if messages else []
    messages.append({"role": "user", "content": user})
    after = eng.codec.chat(messages, **opts)
    if after[: len(before)] != before:
        return None
    head: list[int] = []
    if pending is not None and pending in before[-4:]:  # the stop token and what the template puts after it
        j = len(before) - 1 - before[::-1].index(pending)
        head = before[j:]
    return head + after[len(before):]


def dump(stats) -> str:
    return json.dumps(stats.to_json())
