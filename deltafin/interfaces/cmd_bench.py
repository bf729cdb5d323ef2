"""``deltafin bench ...``."""

from __future__ import annotations


def run(args) -> int:
    if args.bench in ("decode", "prefill", "classify"):
        from deltafin.bench import shapes

        shapes.apply(args, args.files_cap)
        if getattr(args, "synthetic", "k3") == "k3-slice" and args.shape != "k3":
            from deltafin.errors import UsageError

            raise UsageError(f"--synthetic k3-slice runs Kimi K3's real widths; --shape {args.shape} is for the "
                             f"streamed files (--synthetic k3)")
    if args.bench in ("kernels", "decode") and getattr(args, "device", None) == "mlx":
        from deltafin.mlx import bench as mlx_bench  # the MLX engine's own (deltafin/mlx/bench.py)

        getattr(mlx_bench, args.bench)(args)
        return 0
    if args.bench == "pack":
        from deltafin.bench.pack import check_bf16_args

        check_bf16_args(args.bf16, args.k3_slice, args.checkpoint)
    if args.bench == "pack" and args.k3_slice:
        from deltafin.bench.k3_slice import run as bench_slice

        bench_slice(args.dir, args.slice_layers, args.slice_experts, json_path=args.json, prompt=args.slice_prompt)
        return 0
    if args.bench == "pack" and args.bf16:
        from deltafin.bench.pack import run_bf16

        run_bf16(args.dir, args.checkpoint, args.json)
        return 0
    if args.bench == "pack":
        from deltafin.bench.pack import run as bench_pack

        bench_pack(args.dir, args.gb, args.json)
        return 0
    if args.bench in ("decode", "prefill") and getattr(args, "synthetic", "k3") == "k3-slice":
        from deltafin.bench.k3_slice_gpu import from_cli

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
    if args.bench == "distributed":
        from deltafin.bench.distributed import run as bench_distributed
        from deltafin.errors import UsageError

        if args.layers < 1 or args.experts < args.k or args.tokens < 1 or args.warmup < 0:
            raise UsageError("bench distributed: need --layers >= 1, --experts >= --k, --tokens >= 1, --warmup >= 0")
        rec = bench_distributed(args)
        if args.json:
            from deltafin.store.manifest import write_json_atomic

            write_json_atomic(args.json, rec)
        return 0
    if args.bench == "grammar":
        from deltafin.bench.grammar import run as bench_grammar

        bench_grammar(args)
        return 0
    if args.bench in ("kernels", "warm", "ingest", "peer"):
        import importlib

        importlib.import_module(f"deltafin.bench.{args.bench}").run(args)
        return 0
    raise AssertionError(args.bench)
