"""``deltafin run`` and ``deltafin chat``: generate text with the routed experts streamed from the drives."""

from __future__ import annotations

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
    p.add_argument("--verify-reads", action="store_true", help="check every expert read against its checksum")
    p.add_argument("--stats-json", metavar="PATH", help="write the run's statistics as JSON")
    p.add_argument("--record-routes", metavar="PATH",
                   help="write the routing trace (JSONL: per decoded token, per MoE layer, the expert ids) for "
                        "'deltafin place --policy coactivation|replicas --trace PATH'")
    p.add_argument("--quiet", action="store_true", help="print only the generated text")
    add_compute_args(p)


def add_compute_args(p) -> None:
    """The compute path, shared by every command that runs a model: fused kernels unless --exact."""
    p.add_argument("--exact", action="store_true",
                   help="the float32 reference path (plain torch matmuls), token-identical to transformers")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "f32"],
                   help="activations on the fast path: auto = bf16 on CUDA, f32 on the CPU (measured faster there)")


def add_sampling_args(p) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=128)
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def open_engine(args):
    from deltafin.runtime.engine import Engine, EngineOptions
    from deltafin.store.manifest import parse_drive_map

    opts = EngineOptions(args.device, args.cache_gb, args.threads, args.verify_reads,
                         parse_drive_map(args.drive_map), args.emulate_drives, args.max_len,
                         record_routes=getattr(args, "record_routes", None), exact=args.exact, dtype=args.dtype)
    eng = Engine(args.model, opts)
    if not args.quiet:
        print(f"[deltafin] {eng.packed.model_id} ({eng.packed.family}) on {eng.device}; trunk "
              f"{eng.packed.doc['trunk']['bytes'] / 1e9:.2f} GB resident; expert cache {eng.cache_bytes / 1e9:.2f} GB"
              f"{' (default: half of free memory after the trunk)' if args.cache_gb is None else ''}; "
              f"{args.threads} reader threads x {len(eng.packed.drives)} drive(s), "
              f"{'direct' if eng.source.direct else 'buffered'} I/O; math: {eng.math_name}", file=sys.stderr)
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
        return eng.codec.chat([{"role": "user", "content": args.prompt}])
    return eng.codec.encode(args.prompt)


def _run(args) -> int:
    eng = open_engine(args)
    try:
        prompt = _prompt_ids(eng, args)
        for tok, delta in eng.generate(prompt, args.max_tokens, sampling_params(args), stop_strings=tuple(args.stop)):
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
    """Multi-turn: the model state is kept between turns; each turn feeds only its new tokens."""
    eng = open_engine(args)
    if eng.codec is None:
        raise UsageError(f"{eng.packed.path} has no tokenizer files, so chat is not possible")
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    state, pending = eng.new_state(), None
    try:
        while True:
            try:
                line = input("you> ") if sys.stdin.isatty() else sys.stdin.readline()
            except EOFError:
                break
            if not line or line.strip() in ("/exit", "/quit"):
                break
            new = _turn_tokens(eng, messages, line.rstrip("\n"), pending)
            if new is None:  # the template cannot extend the history: replay the conversation
                state = eng.new_state()
                new = eng.codec.chat(messages)
            sys.stdout.write("assistant> ")
            for _, delta in eng.generate(new, args.max_tokens, sampling_params(args), state=state,
                                         stop_strings=tuple(args.stop)):
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            st = eng.last_stats
            # A stop token ends the reply but was not fed to the model yet; it starts the next turn.
            pending = st.tokens[-1] if st.tokens and st.stop_reason == "stop token" else None
            messages.append({"role": "assistant", "content": st.text})
            _report(eng, args)
    finally:
        eng.close()
    return 0


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
