"""``deltafin bench ...``."""

from __future__ import annotations


def run(args) -> int:
    if args.bench == "pack":
        from deltafin.bench.pack import run as bench_pack

        bench_pack(args.dir, args.gb, args.json)
        return 0
    raise AssertionError(args.bench)
