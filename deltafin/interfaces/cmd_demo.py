"""``deltafin demo``: everything end to end on a small random model, with nothing to download."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

# A small DeepSeek-V3-shaped model: MLA, sigmoid group-limited router, shared expert, a dense first layer.
DEMO_MODEL = "deepseek_v3"
DEMO_SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=32,
                  num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=64,
                  kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_shared_experts=1)


def _step(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def _generate(model_dir: str) -> None:
    from deltafin.runtime.engine import Engine, EngineOptions
    from deltafin.runtime.sampling import SamplingParams

    eng = Engine(model_dir, EngineOptions(cache_gb=0.0, threads=4, exact=False))
    try:
        prompt = eng.codec.chat([{"role": "user", "content": "Why stream experts from SSDs?"}])
        print("assistant (random weights, so the text is noise; the pipeline is real): ", end="", flush=True)
        for _, delta in eng.generate(prompt, 24, SamplingParams()):
            print(repr(delta)[1:-1], end="", flush=True)
        print()
        print(eng.last_stats.summary())
    finally:
        eng.close()


def run(args) -> int:
    from deltafin.store.drives import parse_drives
    from deltafin.store.inspect import format_summary, model_summary
    from deltafin.store.model_dir import PackedModel
    from deltafin.store.pack import PackOptions, pack
    from deltafin.store.verify import verify
    from deltafin.tiny import build_tiny, save_byte_tokenizer

    work = os.path.abspath(args.dir) if args.dir else tempfile.mkdtemp(prefix="deltafin-demo-")
    os.makedirs(work, exist_ok=True)
    src, out = os.path.join(work, "hf-checkpoint"), os.path.join(work, "model")
    drives = [os.path.join(work, "drive-a"), os.path.join(work, "drive-b")]
    try:
        _step(f"building a random {DEMO_MODEL} checkpoint with transformers in {src}")
        build_tiny(DEMO_MODEL, src, seed=0, **DEMO_SHAPE)
        save_byte_tokenizer(src, DEMO_SHAPE["vocab_size"])
        _step("packing it: int8 trunk, MXFP4 experts, one file per expert over two folders acting as drives")
        # Rates are given (2:1) so the demo stays quick; omit '=GBPS' to measure each drive with a probe.
        s = pack(src, out, parse_drives([f"a:{drives[0]}=2.0", f"b:{drives[1]}=1.0"]), PackOptions(progress=False))
        print(f"packed {s.expert_files} expert files ({s.expert_bytes / 1e6:.1f} MB) + {s.trunk_bytes / 1e6:.1f} MB "
              f"trunk in {s.seconds:.1f} s; peak RSS {s.peak_rss_bytes / 2**20:.0f} MiB")
        _step("verifying every expert file against its checksum (direct reads)")
        model = PackedModel.open(out)
        t0 = time.perf_counter()
        rep = verify(model)
        print(f"{rep.files} files, {rep.bytes / 1e6:.1f} MB: {'all good' if rep.ok else rep.bad} "
              f"({time.perf_counter() - t0:.2f} s)")
        _step("inspecting the packed model")
        print(format_summary(model_summary(model)))
        _step("generating with the routed experts streamed from the two drives (cold cache, greedy)")
        _generate(out)
        print(f"\ndemo folder: {work}" + ("" if args.keep or args.dir else " (removed; pass --keep to keep it)"))
        return 0 if rep.ok else 1
    finally:
        if not (args.keep or args.dir):
            shutil.rmtree(work, ignore_errors=True)
