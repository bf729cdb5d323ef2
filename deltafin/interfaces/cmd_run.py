"""``deltafin run`` and ``deltafin chat``: generate text with the routed experts streamed from the drives.

The flags are grouped as ``run --help`` shows them (prompt, sampling, model and memory, drives, output);
everything that can be checked without the model is checked before it loads."""

from __future__ import annotations

import argparse
import json
import sys

from deltafin.errors import UsageError

# shared with serve, batch and classify, which import them from here
from deltafin.interfaces.session import (  # noqa: F401
    Printer,
    chat_kwargs,
    open_engine,
    read_template,
    report,
    sampling_params,
    start_line,
    turn_tokens,
)


def _group(p, title: str):
    """The parser's argument group ``title`` (made once), so each flag lands under its heading in --help."""
    for g in p._action_groups:
        if g.title == title:
            return g
    return p.add_argument_group(title)


def add_engine_args(p, stats: bool = True, routes: bool = True) -> None:
    """The flags of every command that loads a model; ``stats``/``routes``: only where they do something."""
    p.add_argument("model", help="packed model folder, or the id of a model 'deltafin list' shows (also -m MODEL)")
    m = _group(p, "model and memory")
    m.add_argument("--device", default="auto",
                   help="auto (MLX on Apple Silicon where installed, else CUDA, then Apple MPS, then CPU), cpu, cuda, "
                        "mps or mlx (pip install -e '.[mlx]'); the choice is printed at start")
    m.add_argument("--cache-gb", type=float, default=None,
                   help="memory for cached experts (default: half of free memory after the trunk, printed at start; "
                        "GPU memory on CUDA)")
    add_offload_args(m)
    m.add_argument("-t", "--threads", type=int, default=None,
                   help="compute threads, exactly (default: torch's choice, printed at start; CPU decode steps then "
                        "run on fewer where that measures faster)")
    m.add_argument("-c", "--ctx-size", "--max-model-len", "--max-len", dest="max_len", type=int, default=None,
                   metavar="N", help="context limit in tokens (default: the model's max_position_embeddings, lowered "
                                     "to what free memory holds; printed at start)")
    m.add_argument("--chat-template-file", metavar="FILE",
                   help="Jinja chat template to use instead of the checkpoint's (as in tokenizer_config.json)")
    add_compute_args(m)
    d = _group(p, "drives")
    d.add_argument("--io-threads", type=int, default=4,
                   help="reader threads per drive, i.e. reads in flight per drive (what --threads set in earlier "
                        "versions)")
    d.add_argument("--drive-map", action="append", metavar="LABEL=PATH", help="drive LABEL is now mounted at PATH")
    d.add_argument("--emulate-drives", metavar="SPEC", help="serve reads through an emulated drive set")
    d.add_argument("--verify-reads", action=argparse.BooleanOptionalAction, default=True,
                   help="check every expert read against its checksum (default; a bad copy is read from a "
                        "replica); --no-verify-reads skips it")
    d.add_argument("--verify-on", choices=["auto", "host", "gpu"], default="auto",
                   help="where reads are checked: gpu (in GPU memory, two launches a layer, no host core hashing), "
                        "host (the reader threads), auto (default: gpu on CUDA where the kernel runs, else host)")
    d.add_argument("--guess-next", action=argparse.BooleanOptionalAction, default=True,
                   help="while a decode layer runs, read the experts the next layer's router picks on its stream, "
                        "so the next layer's reads are under way when it routes (default, while experts are being "
                        "read; the stats give how many were right); --no-guess-next reads only what a layer asks")
    d.add_argument("--read-deadline", type=float, default=None, metavar="SECONDS",
                   help="least time a read may take before it is retried once, then read from a replica or "
                        "reported (default 5; longer for reads queued behind many others: 10x their time at "
                        "the drive's rate)")
    d.add_argument("--dist-timeout", type=float, default=120.0, metavar="S",
                   help="under torchrun: a collective, or rank 0's silence, longer than S seconds stops the job "
                        "naming the rank (default 120)")
    d.add_argument("--dist-routing", default="check", choices=["check", "broadcast"],
                   help="under torchrun: every rank routes by the same trunk math, checked at each layer (check), or "
                        "takes rank 0's routing (broadcast: one more collective per layer, for mixed hardware)")
    o = _group(p, "output")
    if stats:
        o.add_argument("--stats-json", metavar="PATH", help="write the run's statistics as JSON")
    if routes:
        o.add_argument("--record-routes", metavar="PATH",
                       help="write the routing trace (JSONL: per decoded token, per MoE layer, the expert ids) for "
                            "'deltafin place --policy coactivation|replicas --trace PATH'")
    o.add_argument("--quiet", action="store_true", help="print only the generated text")


def add_offload_args(p) -> None:
    """Partial GPU offload (docs/RUNNING.md): how much of the trunk goes to the CUDA GPU."""
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="gpu_layers", type=int, default=None, metavar="N",
                   help="CUDA: run the last N layers and the head on the GPU, the rest on the CPU (default: the whole "
                        "trunk if it fits, else as many layers as fit; the expert cache gets half of what is left; "
                        "the split is printed at start)")
    p.add_argument("--gpu-memory-gb", type=float, default=None, metavar="GB",
                   help="CUDA: the most GPU memory the engine uses for trunk layers, expert cache and working memory "
                        "(default: what is free)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: load every kernel at start with a throwaway pass (a few experts read), so the first "
                        "prompt does not wait for it (default; --no-warmup skips it)")


def add_compute_args(p) -> None:
    """The compute path, shared by every command that runs a model: fused kernels unless --exact."""
    p.add_argument("--exact", action="store_true",
                   help="the float32 reference path (plain torch matmuls), token-identical to transformers")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "f32"],
                   help="activations on the fast path: auto = bf16 on CUDA, f32 on the CPU (measured faster there)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="each sequence's logits bit-identical whatever is batched with it (server, batch, classify); "
                        "CPU and CUDA; its cost: docs/DETERMINISM.md")


def add_sampling_args(p) -> None:
    s = _group(p, "sampling")
    s.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=int, default=128,
                   help="tokens to generate at most")
    s.add_argument("--greedy", action="store_true", help="always take the most likely token")
    s.add_argument("--temperature", "--temp", type=float, default=0.7, help="sampling temperature")
    s.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling: keep the smallest set of tokens "
                                                             "whose probability reaches this")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    s.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this x the top token's probability")
    s.add_argument("--repetition-penalty", "--repeat-penalty", type=float, default=1.0,
                   help="divide positive logits (multiply negative ones) of tokens already seen (1: none)")
    s.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted once from seen tokens' logits")
    s.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted from seen tokens' logits once per time they were generated")
    s.add_argument("--stop", action="append", default=[],
                   help="stop string, repeatable; backslash escapes are read (\\n\\n: a blank line)")
    add_thinking_args(s)


def add_thinking_args(p) -> None:
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="turn the model's thinking on or off in chat prompts (Kimi K3; templates with "
                        "enable_thinking, such as Qwen3's); default: the template's own (Kimi K3: on)")
    p.add_argument("--effort", choices=("low", "medium", "high", "max"), default=None,
                   help="how much to think: Kimi K3's thinking_effort, or reasoning_effort where the template "
                        "has it (gpt-oss); default: the model's own")


def add_prompt_args(p, command: str) -> None:
    g = _group(p, "prompt")
    g.add_argument("--system-prompt", "--system", dest="system", metavar="TEXT",
                   help="system message (applied through the chat template)")
    if command != "run":
        return
    g.add_argument("-p", "--prompt", help="prompt text; '-' reads it from stdin (piped stdin is read anyway)")
    g.add_argument("-f", "--file", metavar="FILE", help="read the prompt from FILE ('-': stdin)")
    g.add_argument("--prompt-ids", help="prompt as comma-separated token ids (no template)")
    g.add_argument("--raw", action="store_true",
                   help="feed the prompt as plain text; by default it is one user turn of the chat template")
    g.add_argument("--chat-template", action="store_true", help=argparse.SUPPRESS)  # the default now


def order_groups(p) -> None:
    """``run --help``: the prompt first, then sampling, model and memory, drives, output."""
    order = ["positional arguments", "prompt", "sampling", "model and memory", "drives", "output", "options"]
    p._action_groups.sort(key=lambda g: order.index(g.title) if g.title in order else len(order))


def run(args) -> int:
    return _run(args) if args.command == "run" else _chat(args)


def _before_load(args) -> tuple[str | None, list[int] | None]:
    """The prompt (text or ids), read and checked before the model loads: a missing prompt or a
    contradiction costs nothing."""
    from deltafin.interfaces.checks import check_context, check_prompt_ids
    from deltafin.interfaces.paths import resolve_packed
    from deltafin.interfaces.prompt import prompt_text

    path = resolve_packed(args.model)
    check_context(path, args.max_len)
    if args.raw and args.system:
        raise UsageError("--system-prompt needs the chat template; drop --raw (or the system prompt)")
    if args.prompt_ids:
        if args.prompt is not None or args.file is not None:
            raise UsageError("give the prompt once: --prompt-ids or -p/-f, not both")
        return None, check_prompt_ids(path, args.prompt_ids)
    text = prompt_text(args)
    if text is None:
        raise UsageError("give a prompt: -p TEXT, -f FILE, or pipe it into stdin (or --prompt-ids 1,2,3)")
    return text, None


def _prompt_ids(eng, args, text: str | None, ids: list[int] | None) -> list[int]:
    if ids is not None:
        return ids
    if eng.codec is None:
        raise UsageError(f"{eng.packed.path} has no tokenizer files; give the prompt as --prompt-ids")
    if args.raw or not eng.codec.has_chat_template:
        if args.system:
            raise UsageError("--system-prompt: this model's checkpoint has no chat template; drop the system prompt")
        if args.chat_template and not args.raw:
            raise UsageError("--chat-template: this model's checkpoint has no chat template; drop the flag")
        return eng.codec.prompt_ids(text)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    return eng.codec.chat(messages + [{"role": "user", "content": text}], **chat_kwargs(eng, args))


def _run(args) -> int:
    from deltafin.interfaces.prompt import stop_strings

    text, ids = _before_load(args)
    eng = open_engine(args)
    try:
        prompt = _prompt_ids(eng, args, text, ids)
        chat = eng.codec is not None and ids is None and not args.raw and eng.codec.has_chat_template
        out = Printer(eng, prompt, chat, args.quiet)
        for tok, delta in eng.generate(prompt, args.max_tokens, sampling_params(args), stop_strings=stop_strings(args)):
            out.write(delta if eng.codec else f"{tok} ")
        out.write("", last=True)
        sys.stdout.write("\n")
        report(eng, args)
    finally:
        eng.close()
    return 0


def _chat(args) -> int:
    from deltafin.interfaces.checks import check_context
    from deltafin.interfaces.paths import resolve_packed
    from deltafin.interfaces.repl import run_chat

    check_context(resolve_packed(args.model), args.max_len)
    eng = open_engine(args)
    try:
        return run_chat(eng, args)
    finally:
        eng.close()


def dump(stats) -> str:
    return json.dumps(stats.to_json())
