"""``deltafin run`` and ``deltafin chat``: generate text with the routed experts streamed from the drives."""

from __future__ import annotations

import argparse
import json
import sys

from deltafin.errors import UsageError


def add_engine_args(p) -> None:
    p.add_argument("model", help="packed model folder")
    p.add_argument("--device", default="cpu", help="cpu, cuda or mps")
    p.add_argument("--cache-gb", type=float, default=None,
                   help="memory for cached experts (default: half of free memory after the trunk, printed at start; "
                        "GPU memory on CUDA)")
    p.add_argument("--threads", type=int, default=4, help="reader threads per drive (reads in flight per drive)")
    p.add_argument("--max-len", type=int, default=4096, help="context limit in tokens")
    p.add_argument("--drive-map", action="append", metavar="LABEL=PATH", help="drive LABEL is now mounted at PATH")
    p.add_argument("--emulate-drives", metavar="SPEC", help="serve reads through an emulated drive set")
    p.add_argument("--verify-reads", action=argparse.BooleanOptionalAction, default=True,
                   help="check every expert read against its checksum (default; a bad copy is read from a "
                        "replica); --no-verify-reads skips it")
    p.add_argument("--read-deadline", type=float, default=None, metavar="SECONDS",
                   help="least time a read may take before it is retried once, then read from a replica or "
                        "reported (default 5; longer for reads queued behind many others: 10x their time at "
                        "the drive's rate)")
    p.add_argument("--stats-json", metavar="PATH", help="write the run's statistics as JSON")
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


def add_sampling_args(p) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=128)
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
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

    def __init__(self, eng, prompt: list[int], chat: bool, quiet: bool):
        from deltafin.runtime.reasoning import Parts, splitter_for

        self.split = splitter_for(eng.codec, prompt, chat)
        self.quiet, self.parts, self.thinking = quiet, Parts(), False

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
            sys.stdout.write(parts.content)
            sys.stdout.flush()


def open_engine(args):
    from deltafin.runtime.engine import Engine, EngineOptions
    from deltafin.store.manifest import parse_drive_map

    opts = EngineOptions(args.device, args.cache_gb, args.threads, args.verify_reads,
                         parse_drive_map(args.drive_map), args.emulate_drives, args.max_len,
                         record_routes=getattr(args, "record_routes", None), read_deadline_s=args.read_deadline,
                         dist_timeout_s=args.dist_timeout, dist_routing=args.dist_routing)
    eng = Engine(args.model, opts)
    if not args.quiet and eng.cluster is not None:
        print(f"[deltafin] rank 0 of {eng.cluster.world}: computes the experts it owns; every layer's partial "
              f"outputs are summed over the ranks", file=sys.stderr)
    if not args.quiet:
        print(f"[deltafin] {eng.packed.model_id} ({eng.packed.family}) on {eng.device}; trunk "
              f"{eng.packed.doc['trunk']['bytes'] / 1e9:.2f} GB resident; expert cache {eng.cache_bytes / 1e9:.2f} GB"
              f"{' (default: half of free memory after the trunk)' if args.cache_gb is None else ''}; "
              f"{args.threads} reader threads x {len(eng.packed.drives)} drive(s), "
              f"{'direct' if eng.source.direct else 'buffered'} I/O", file=sys.stderr)
    return eng


def sampling_params(args):
    from deltafin.runtime.sampling import SamplingParams

    temp = 0.0 if args.greedy else args.temperature
    return SamplingParams(temp, args.top_p, args.top_k, args.seed)


def run(args) -> int:
    return _run(args) if args.command == "run" else _chat(args)


def _prompt_ids(eng, args) -> list[int]:
    if args.prompt_ids:
        try:
            return [int(t) for t in args.prompt_ids.split(",")]
        except ValueError:
            raise UsageError(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers") from None
    if args.prompt is None:
        raise UsageError("give a prompt with -p TEXT (or --prompt-ids 1,2,3)")
    if eng.codec is None:
        raise UsageError(f"{eng.packed.path} has no tokenizer files; give the prompt as --prompt-ids")
    if args.chat_template:
        return eng.codec.chat([{"role": "user", "content": args.prompt}], **chat_kwargs(eng, args))
    return eng.codec.encode(args.prompt)


def _run(args) -> int:
    eng = open_engine(args)
    try:
        prompt = _prompt_ids(eng, args)
        out = Printer(eng, prompt, bool(args.chat_template), args.quiet)
        for tok, delta in eng.generate(prompt, args.max_tokens, sampling_params(args), stop_strings=tuple(args.stop)):
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
    """Multi-turn: the model state is kept between turns; each turn feeds only its new tokens."""
    eng = open_engine(args)
    if eng.codec is None:
        raise UsageError(f"{eng.packed.path} has no tokenizer files, so chat is not possible")
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    state, pending = eng.new_state(), None
    opts = chat_kwargs(eng, args)
    try:
        while True:
            try:
                line = input("you> ") if sys.stdin.isatty() else sys.stdin.readline()
            except EOFError:
                break
            if not line or line.strip() in ("/exit", "/quit"):
                break
            new = _turn_tokens(eng, messages, line.rstrip("\n"), pending, opts)
            if new is None:  # the template cannot extend the history: replay the conversation
                state = eng.new_state()
                new = eng.codec.chat(messages, **opts)
            sys.stdout.write("assistant> ")
            out = Printer(eng, new, True, args.quiet)
            for _, delta in eng.generate(new, args.max_tokens, sampling_params(args), state=state,
                                         stop_strings=tuple(args.stop)):
                out.write(delta)
            out.write("", last=True)
            sys.stdout.write("\n")
            st = eng.last_stats
            # A stop token ends the reply but was not fed to the model yet; it starts the next turn.
            pending = st.tokens[-1] if st.tokens and st.stop_reason == "stop token" else None
            messages.append({"role": "assistant", "content": out.parts.content,
                             "reasoning_content": out.parts.reasoning})
            _report(eng, args)
    finally:
        eng.close()
    return 0


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
