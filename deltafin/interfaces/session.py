"""What every command that runs a model shares: opening the engine from the flags, the sampler, the thinking
options, a reply's printer and the end-of-run report. ``cmd_run`` and ``repl`` both import it (downward)."""

from __future__ import annotations

import json
import logging
import sys

from deltafin.errors import UsageError


def verbose(args) -> bool:
    return bool(getattr(args, "verbose", False)) or getattr(args, "log_level", None) in ("info", "debug")


def chat_kwargs(eng, args) -> dict:
    """codec.chat keyword arguments from --think/--no-think and --effort (checked against the template)."""
    think, effort = getattr(args, "think", None), getattr(args, "effort", None)
    if think is not None or effort is not None:
        eng.codec.check_thinking(think, effort)
    return {"thinking": think, "effort": effort}


def sampling_params(args):
    from deltafin.runtime.sampling import SamplingParams

    temp = 0.0 if args.greedy else args.temperature
    return SamplingParams(temp, args.top_p, args.top_k, args.seed, args.min_p, args.presence_penalty,
                          args.frequency_penalty, args.repetition_penalty)


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


def open_engine(args):
    """The engine the flags describe, with the start line printed (unless --quiet)."""
    from deltafin.interfaces.checks import check_engine_numbers
    from deltafin.interfaces.paths import resolve_packed
    from deltafin.runtime.engine import Engine, EngineOptions
    from deltafin.store.manifest import parse_drive_map

    check_engine_numbers(args.cache_gb, args.io_threads, args.max_len, args.threads)
    if getattr(args, "verify_on", "auto") == "gpu" and args.device == "cpu":  # before the trunk loads
        raise UsageError("--verify-on gpu: reads are checked on the GPU only with --device cuda; use --verify-on "
                         "auto or host")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    opts = EngineOptions(
        adapt_threads=args.threads is None,  # -t N: exactly N threads
        device=args.device,
        cache_gb=args.cache_gb,
        threads=args.io_threads,
        verify_reads=args.verify_reads,
        verify_on=getattr(args, "verify_on", "auto"),
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
        batch_invariant=getattr(args, "batch_invariant", False),
        gpu_layers=args.gpu_layers,
        gpu_memory_gb=args.gpu_memory_gb,
        warmup=getattr(args, "warmup", True),
        guess_next=getattr(args, "guess_next", True),
    )
    template = read_template(args.chat_template_file) if args.chat_template_file else None
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


def read_template(path: str) -> str:
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
            f"{fmt.size(eng.packed.doc['trunk']['bytes'])} resident; expert cache up to {fmt.size(eng.cache_bytes)}"
            f"{cache}; context {eng.opts.max_len:,} tokens ({eng.context_reason}); {torch.get_num_threads()} compute "
            f"threads{_adapting(eng)}, {args.io_threads} reader threads x {len(eng.packed.drives)} drive(s), "
            f"{_io_kind(eng.source)}"
            + (f", read buffers {fmt.size(eng.source.reserved[1])}" if eng.source.reserved[1] else "")
            + _checks_where(eng) + f"; math: {eng.math_name}"
            + (f"; {eng.offload.describe()}" if eng.offload is not None else "")
            + (f"; kernels warmed in {fmt.duration(eng.warm_s)}" if getattr(eng, "warm_s", None) else ""))


def _io_kind(src) -> str:
    """How expert files come in: direct or buffered reads, and drives in memory mapped (``io.mapped``)."""
    mapped = getattr(src, "mapped", [])
    kind = "direct" if src.direct else "buffered"
    if mapped and len(mapped) == len(src.readers):
        return "files mapped (drives in memory)"
    return f"{kind} I/O" + (f", {len(mapped)} drive(s) in memory mapped" if mapped else "")


def _checks_where(eng) -> str:
    where = getattr(eng.source, "checks_where", "host")
    return {"gpu": ", reads checked on the GPU", "host": ", reads checked on the host",
            "gpu+host": ", reads checked on the GPU (its layers) and on the host (the CPU's)"}.get(where, ", reads unchecked")


def _adapting(eng) -> str:
    p = getattr(eng, "threads", None)
    return "" if p is None else f" (decode steps on {' or '.join(map(str, p.options))}, whichever measures fastest)"


def report(eng, args, one_line: bool = False) -> None:
    """The run's statistics on stderr (one line with ``one_line``), and --stats-json."""
    st = eng.last_stats
    if not args.quiet:
        print(st.line() if one_line else st.summary(verbose(args)), file=sys.stderr)
        if eng.cluster is not None and not one_line:
            for r in eng.cluster_stats():
                print(f"[deltafin] rank {r['rank']}: {r['bytes_read'] / 1e9:.3f} GB of experts read, "
                      f"{r['io_wait_s']:.2f} s waiting on reads, {r['collective_s']:.2f} s in {r['collectives']} "
                      f"all-reduces (cumulative)", file=sys.stderr)
        if eng.routes is not None and not one_line:
            print(f"[deltafin] routes of {eng.routes.tokens} decoded tokens in {eng.routes.path}", file=sys.stderr)
    if getattr(args, "stats_json", None):
        from deltafin.store.manifest import write_json_atomic

        try:
            write_json_atomic(args.stats_json, st.to_json())
        except OSError as e:  # checked before the run; the folder went away since: keep the figures on stderr
            logging.getLogger(__name__).error("--stats-json %s: cannot write it (%s); the statistics follow as JSON",
                                              args.stats_json, e.strerror)
            print(json.dumps(st.to_json()), file=sys.stderr)


def turn_tokens(eng, messages: list[dict], user: str, pending: int | None, opts: dict) -> list[int] | None:
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
