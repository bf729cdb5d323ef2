"""``deltafin serve MODEL``: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn)."""

from __future__ import annotations

import ipaddress
import os
import sys

from deltafin.errors import UsageError


def add_serve_args(p) -> None:
    from deltafin.interfaces.cmd_run import add_engine_args

    add_engine_args(p, stats=False)  # a server has no end-of-run statistics: /metrics has them
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("DELTAFIN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every /v1 route and /metrics "
                        "(default: $DELTAFIN_API_KEY)")
    p.add_argument("--served-model-name", help="model name clients send (default: the packed model's id)")
    p.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask for")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body (bytes)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together at most")
    p.add_argument("--max-queue", type=int, default=64, help="sequences waiting at most (then 429)")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args) -> int:
    try:
        import uvicorn

        from deltafin.serve.app import create_app
    except ImportError as e:
        raise UsageError(f"serving needs FastAPI and uvicorn ({e}); install them with: pip install 'deltafin[serve]'") from None
    from deltafin.interfaces.cmd_run import open_engine
    from deltafin.serve.protocol import Limits
    from deltafin.serve.worker import Worker

    if args.max_batch < 1 or args.max_queue < 1:
        raise UsageError(f"--max-batch and --max-queue must be >= 1, got {args.max_batch} and {args.max_queue}")
    limits = Limits(args.max_tokens_limit, args.max_request_bytes)
    if not _loopback(args.host) and not args.api_key:
        print(f"[deltafin] warning: listening on {args.host} without --api-key; anyone who can reach this "
              f"port can use the model", file=sys.stderr)
    eng = open_engine(args)
    worker = Worker(eng, args.max_batch, args.max_queue).start()
    name = args.served_model_name or eng.packed.model_id
    try:
        app = create_app(worker, name, args.api_key, limits)
        print(f"[deltafin] serving {name!r} on http://{args.host}:{args.port}/v1"
              f"{' (API key required)' if args.api_key else ''}", file=sys.stderr)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        worker.stop()
        eng.close()
    return 0
