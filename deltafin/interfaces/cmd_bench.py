"""``deltafin bench ...``."""

from __future__ import annotations


def run(args) -> int:
    if args.bench == "pack":
        from deltafin.bench.pack import run as bench_pack

        bench_pack(args.dir, args.gb, args.json)
        return 0
    if args.bench in ("decode", "prefill") and getattr(args, "synthetic", "k3") == "k3-slice":
        from deltafin.bench.k3_slice import from_cli

        from_cli(args, args.bench)
        return 0
    if args.bench == "decode":
        from deltafin.bench.decode import run as bench_decode

        bench_decode(args)
        return 0
    if args.bench == "prefill":
        from deltafin.bench.prefill import run as bench_prefill

        bench_prefill(args)
        return 0
    if args.bench == "classify":
        from deltafin.bench.classify import run as bench_classify

        bench_classify(args)
        return 0
    raise AssertionError(args.bench)
