"""``deltafin serve MODEL``: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn)."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys

from deltafin.errors import UsageError


def add_serve_args(p) -> None:
    from deltafin.interfaces.cmd_run import add_engine_args, add_thinking_args

    add_engine_args(p, stats=False)  # a server has no end-of-run statistics: /metrics has them
    add_thinking_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("DELTAFIN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every /v1 route and /metrics "
                        "(default: $DELTAFIN_API_KEY)")
    p.add_argument("--api-key-file", metavar="PATH",
                   help="read the API key from the first line of PATH (keeps it out of the process list)")
    p.add_argument("--served-model-name", help="model name clients send (default: the packed model's id)")
    p.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask for")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body (bytes)")
    p.add_argument("--max-schema-bytes", type=int, default=64 << 10,
                   help="largest response_format schema, or all tools' parameters together, as JSON (bytes)")
    p.add_argument("--grammar-timeout", type=float, default=20.0,
                   help="seconds one request's grammar may take to compile (past it: a 400, and the compile stops)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive (then 408; default 30)")
    p.add_argument("--idle-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open (default 5); request headers are due "
                        "within twice this (at least 10 s)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together at most")
    p.add_argument("--max-queue", type=int, default=64, help="sequences waiting at most (then 429)")
    p.add_argument("--prompt-cache-gb", type=float, default=2.0,
                   help="host memory for the states of earlier requests, so a prompt that starts like one of "
                        "them prefills only the rest (default 2 GB; 0 turns the prompt cache off)")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_key(args) -> str | None:
    if not args.api_key_file:
        return args.api_key
    try:
        with open(args.api_key_file, encoding="utf-8") as f:
            key = f.readline().strip()
    except OSError as e:
        raise UsageError(f"--api-key-file {args.api_key_file}: cannot read it ({e.strerror}); "
                         f"give a readable file holding the key") from None
    if not key:
        raise UsageError(f"--api-key-file {args.api_key_file}: the first line is empty; write the key there")
    return key


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, taken before the model loads so a busy port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port "
                         f"(or stop what is using it)") from None
    sock.set_inheritable(True)
    return sock


def prompt_cache(args):
    if not args.prompt_cache_gb:
        return None
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        # a restored state would live on rank 0 only, while every rank runs the same passes on its own states
        print("[deltafin] prompt cache off under torchrun: each rank keeps its own sequence states", file=sys.stderr)
        return None
    from deltafin.runtime.prompt_cache import PromptCache

    return PromptCache(int(args.prompt_cache_gb * 1e9))


def thinking_defaults(eng, args):
    from deltafin.interfaces.cmd_run import chat_kwargs
    from deltafin.serve.thinking import ThinkingOptions

    if eng.codec is None or (args.think is None and args.effort is None):
        return ThinkingOptions()
    kw = chat_kwargs(eng, args)
    return ThinkingOptions(kw["thinking"], kw["effort"])


def run(args) -> int:
    if args.max_batch < 1 or args.max_queue < 1:
        raise UsageError(f"--max-batch and --max-queue must be >= 1, got {args.max_batch} and {args.max_queue}")
    if not (args.body_timeout > 0 and args.idle_timeout > 0):
        raise UsageError(f"--body-timeout and --idle-timeout must be > 0 s, got {args.body_timeout} and "
                         f"{args.idle_timeout}")
    if args.prompt_cache_gb < 0:
        raise UsageError(f"--prompt-cache-gb must be >= 0, got {args.prompt_cache_gb}")
    key = api_key(args)
    sock = bind(args.host, args.port)  # first: a busy port fails before the slow imports and the model load
    try:
        return _serve(args, key, sock)
    finally:
        sock.close()


def _serve(args, key: str | None, sock: socket.socket) -> int:
    try:
        import uvicorn

        from deltafin.serve.app import create_app
    except ImportError as e:
        raise UsageError(f"serving needs FastAPI and uvicorn ({e}); install them with: pip install 'deltafin[serve]'") from None
    from deltafin.interfaces.cmd_run import open_engine
    from deltafin.serve.protocol import Limits
    from deltafin.serve.worker import Worker

    limits = Limits(args.max_tokens_limit, args.max_request_bytes, body_timeout_s=args.body_timeout,
                    max_schema_bytes=args.max_schema_bytes, grammar_timeout_s=args.grammar_timeout)
    cache = prompt_cache(args)
    if not _loopback(args.host) and not key:
        print(f"[deltafin] warning: listening on {args.host} without --api-key; anyone who can reach this "
              f"port can use the model", file=sys.stderr)
    if not getattr(args, "log_level", None):  # one line per request, unless --log-level says otherwise
        logging.getLogger("deltafin.serve.access").setLevel(logging.INFO)
    eng = open_engine(args)
    worker = Worker(eng, args.max_batch, args.max_queue, prompt_cache=cache).start()
    name = args.served_model_name or eng.packed.model_id
    try:
        app = create_app(worker, name, key, limits, thinking_defaults(eng, args))
        print(f"[deltafin] serving {name!r} on http://{args.host}:{args.port}/v1"
              f"{' (API key required)' if key else ''}; prompt cache "
              f"{f'{args.prompt_cache_gb:g} GB' if cache is not None else 'off'}", file=sys.stderr)
        from deltafin.serve.gate import uvicorn_config

        uvicorn.Server(uvicorn_config(app, args.host, args.port, args.idle_timeout,
                                      max(2 * args.idle_timeout, 10.0))).run(sockets=[sock])
    finally:
        worker.stop()
        eng.close()
    return 0
