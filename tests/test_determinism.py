"""Same input, same output: every family's tiny model gives bit-identical logits (the prompt's and each decode
step's) run to run, whatever the expert cache, the reader threads, the order in which reads land (emulated drives
with jitter), the drive layout, and, with ``batch_invariant``, the other sequences batched with it. Logits are
compared bit for bit, not tokens: a random tiny model's margins would hide rounding."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from deltafin.k3_tiny import write_tiny_k3
from deltafin.store.drives import parse_drives
from deltafin.store.pack import pack
from deltafin.tiny import TINY
from tests import tiny_families as tf

FAMILIES = sorted(TINY) + sorted(tf.NEW_TINY) + ["kimi_k3"]
STEPS = 6
JITTER = "d0:0.4GBps,lat=300us,jitter=1.5,slow=0.2x6;d1:0.2GBps,lat=50us,jitter=1.0"
P, Q, R = tf.prompt(9), tf.prompt(13, seed=2), tf.prompt(5, seed=3)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """family -> (lossless pack, default pack), built once per family as a test asks for it."""
    made: dict[str, tuple[str, str]] = {}

    def get(family: str) -> tuple[str, str]:
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            tf.build_any(family, root / "src")
            out = []
            for name, opts in (("lossless", tf.LOSSLESS), ("default", tf.DEFAULT)):
                pack(str(root / "src"), str(root / name), parse_drives([f"{root}/{name}0=2", f"{root}/{name}1=1"]),
                     opts)
                out.append(str(root / name))
            made[family] = tuple(out)
        return made[family]

    return get


def logits(model: str, exact: bool, together: bool = False, warm: bool = False, **kw) -> torch.Tensor:
    """P's prompt logits then STEPS decode steps (greedy from P's own logits), P alone or between Q and R;
    ``warm``: after the kernels' throwaway passes (``runtime/warmup.py``, the CUDA default) run here too."""
    eng = tf.engine(model, exact=exact, **kw)
    try:
        if warm:
            from deltafin.runtime import warmup

            warmup.warm(eng)
            assert (eng.source.stats.reads, eng.source.stats.bytes_read) == (0, 0), "the warmup's reads were counted"
        seqs = [Q, P, R] if together else [P]
        me = 1 if together else 0
        states = [eng.new_state() for _ in seqs]
        with torch.inference_mode():
            first = eng.step([(torch.tensor(s, device=eng.device), st) for s, st in zip(seqs, states, strict=True)],
                             all_logits=True)
        out = [first[me].float().cpu()]
        last = [int(f[-1].argmax()) for f in first]
        for _ in range(STEPS):
            got = eng.forward_batch([([t], st) for t, st in zip(last, states, strict=True)])
            last = [int(g.argmax()) for g in got]
            out.append(got[me][None].float().cpu())
        return torch.cat(out)
    finally:
        eng.close()


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_bit_identical_across_cache_read_order_and_batch(packed, family, exact):
    lossless, default = packed(family)
    model = lossless if exact else default
    ref = logits(model, exact, batch_invariant=True)
    variants = {
        "every expert cached": dict(cache_gb=1.0),
        "reads landing out of order (jittered emulated drives)": dict(emulate_drives=JITTER),
        "batched with two other sequences (batch-invariant)": dict(together=True),
    }
    for what, kw in variants.items():
        got = logits(model, exact, batch_invariant=True, **kw)
        assert bitwise(got, ref), f"{family} ({'exact' if exact else 'fast'}): {what} changed the logits"
    # without batch invariance the same holds but for the batch: here run to run, reads out of order
    plain = logits(model, exact)
    assert bitwise(logits(model, exact, emulate_drives=JITTER), plain), f"{family}: read order, invariance off"


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3"])
def test_logits_bit_identical_across_threads_partial_cache_and_layout(packed, family, tmp_path):
    _, model = packed(family)
    ref = logits(model, False)
    for kw in (dict(threads=1), dict(threads=8), dict(cache_gb=0.0003)):
        assert bitwise(logits(model, False, **kw), ref), kw
    # other layouts of the same source: one drive; three drives by count; every expert striped over three by
    # bandwidth; and extra copies of the hot experts (replicas, from a routing trace of this prompt)
    src = Path(model).parent / "src"
    trace = tmp_path / "routes.jsonl"
    logits(model, False, record_routes=str(trace))
    three = [f"{tmp_path}/{{}}0=2", f"{tmp_path}/{{}}1=1", f"{tmp_path}/{{}}2=0.5"]
    layouts = {"one": ([f"{tmp_path}/one0=1"], {}), "roundrobin": (three, {}), "stripe-bandwidth": (three, {}),
               "replicas": (three, dict(trace=str(trace), spare_gb=0.001))}
    for name, (drives, extra) in layouts.items():
        opts = replace(tf.DEFAULT, placement="bandwidth" if name == "one" else name, **extra)
        pack(str(src), str(tmp_path / name), parse_drives([d.format(name) for d in drives]), opts)
        assert bitwise(logits(str(tmp_path / name), False), ref), f"{family}: the {name} layout changed the logits"


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3", "qwen3_next", "deepseek_v4"])
def test_kernel_warmup_leaves_the_logits_and_the_counters_as_they_were(packed, family):
    """The throwaway passes at open (on by default on CUDA) write nothing a later run reads: with no cache, and
    with a cache that keeps the experts they read."""
    _, model = packed(family)
    for kw in (dict(), dict(cache_gb=1.0)):
        assert bitwise(logits(model, False, warm=True, **kw), logits(model, False, **kw)), kw


def test_kernel_warmup_runs_outside_inference_mode(packed, monkeypatch):
    """What the passes create and keep (on CUDA the expert slab, made at the first read) must stay writable by a
    caller that runs the model outside inference mode (tests, the Python API's model): no grad, no inference mode.
    Under inference mode the H200's direct model.forward callers failed writing the slab."""
    from deltafin.runtime import batch, warmup

    modes, real = [], batch.forward_batch

    def spy(*a, **k):
        modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return real(*a, **k)

    monkeypatch.setattr(batch, "forward_batch", spy)
    _, model = packed("qwen3_moe")
    eng = tf.engine(model, exact=False)
    try:
        warmup.warm(eng)
    finally:
        eng.close()
    assert modes and all(m == (False, False) for m in modes)


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3", "qwen3_next", "deepseek_v4"])
def test_fast_path_logits_bit_identical_at_any_compute_thread_count(packed, family):
    """The CPU kernels split a matrix's rows over the threads, never its sums; DeepSeek-V4's float32 mHC mix runs
    on one thread (``kernels.serial``), where MKL would split its sums by the thread count."""
    _, model = packed(family)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ref = logits(model, False)
        torch.set_num_threads(1)
        assert bitwise(logits(model, False), ref)
    finally:
        torch.set_num_threads(n)


def test_batched_prefill_of_prompts_of_other_lengths_is_each_prompt_alone(packed):
    """Engine.prefill (batch jobs, classify groups) with batch_invariant: each prompt's last logits equal those of
    the prompt prefilled alone, though the batch's longest prompt would otherwise set the chunks."""
    _, model = packed("qwen3_next")
    eng = tf.engine(model, exact=False, batch_invariant=True, max_len=64, prefill_gb=0.0002)
    try:
        alone = [eng.prefill([p], [eng.new_state()])[0][0] for p in (P, Q + Q + Q, R)]
        together, _ = eng.prefill([P, Q + Q + Q, R], [eng.new_state() for _ in range(3)])
    finally:
        eng.close()
    for a, b in zip(alone, together, strict=True):
        assert bitwise(a, b)


def test_without_batch_invariance_a_batch_can_change_a_sequence():
    """What the option guards against: the CPU's few-token kernels and its int16 GEMM round activations
    differently, so a token's result depended on how many tokens shared the call."""
    from deltafin import kernels
    from deltafin.kernels import cpu
    from deltafin.quant import mxfp4

    if not cpu.available() or not cpu.gemm_enabled():
        pytest.skip("this build has no int16 GEMM")
    torch.manual_seed(0)
    p, s = (torch.as_tensor(t) for t in mxfp4.quantize_ref(torch.randn(64, 256).numpy()))
    x = torch.randn(24, 256)
    one = cpu.mxfp4_linear(x[:1], p, s)
    assert not torch.equal(cpu.mxfp4_linear(x, p, s)[:1], one)
    with kernels.batch_invariant():
        assert torch.equal(cpu.mxfp4_linear(x, p, s)[:1], one)
        assert torch.equal(cpu.mxfp4_linear(x[:1], p, s), one)


def test_batch_invariant_is_refused_on_mlx(packed):
    from deltafin.errors import UsageError

    _, model = packed("qwen3_moe")
    with pytest.raises(UsageError, match="--batch-invariant is built for the CPU and CUDA"):
        tf.engine(model, device="mlx", batch_invariant=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_k3_logits_bit_identical_cold_warm_partial_cache_and_graphs(tmp_path):
    """A Kimi K3 with KDA heads of the real width (128: more threads per program than channels, where the conv
    history's in-place shift once raced) on the bf16 fast path: cold twice, with a partial and a full cache, and
    CUDA graphs on and off, the prompt's and 16 decode steps' logits bit for bit."""
    write_tiny_k3(tmp_path / "src", kda_head_dim=128, kda_heads=2, hidden_size=256)
    pack(str(tmp_path / "src"), str(tmp_path / "m"), parse_drives([f"{tmp_path}/d0=2", f"{tmp_path}/d1=1"]),
         tf.DEFAULT)
    model = str(tmp_path / "m")

    def run(**kw) -> torch.Tensor:
        eng = tf.engine(model, exact=False, device="cuda", max_len=256, **kw)
        try:
            st = eng.new_state()
            with torch.inference_mode():
                out = [eng.step([(torch.tensor(P + Q, device="cuda"), st)], all_logits=True)[0].float().cpu()]
                for t in range(16):
                    out.append(eng.forward([1 + 7 * t], st).float().cpu()[None])
            return torch.cat(out)
        finally:
            eng.close()

    ref = run(cuda_graphs=False)
    for kw in (dict(cuda_graphs=False), dict(), dict(), dict(cache_gb=0.0005), dict(cache_gb=1.0), dict(warmup=False),
               dict(warmup=False, cache_gb=1.0)):
        assert bitwise(run(**kw), ref), kw


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_real_width_k3_slice_logits_cold_twice_warm_partial_cache_and_graphs(tmp_path):
    """The Kimi K3 slice at the real widths (``bench decode --synthetic k3-slice``'s writer; 4 layers: a dense one,
    2 KDA and 1 MLA with 32 experts of the real size, top-16), the default pack: a 64-token prompt's logits and 16
    greedy decode steps', bit for bit, cold twice, warm (the same engine again, every expert cached), at a partial
    cache, with CUDA graphs off, and without the kernels' warmup. Random real-width weights leave logit margins
    tiny: any change in rounding shows."""
    import shutil

    from deltafin.bench.k3_slice import write_k3_slice

    cfg = write_k3_slice(str(tmp_path / "src"), layers=4, experts=32, top_k=16)
    pack(str(tmp_path / "src"), str(tmp_path / "m"), parse_drives([f"{tmp_path}/d0=2", f"{tmp_path}/d1=1"]),
         tf.DEFAULT)
    shutil.rmtree(tmp_path / "src")
    vocab = cfg["text_config"]["vocab_size"]
    ids = [1 + (i * 7919) % (vocab - 1) for i in range(64)]

    def run(eng) -> torch.Tensor:
        st = eng.new_state()
        with torch.inference_mode():
            out = [eng.step([(torch.tensor(ids, device="cuda"), st)], all_logits=True)[0].float().cpu()]
            tok = int(out[0][-1].argmax())
            for _ in range(16):
                lg = eng.forward([tok], st)
                out.append(lg.float().cpu()[None])
                tok = int(lg.argmax())
        return torch.cat(out)

    def runs(n: int = 1, **kw) -> list[torch.Tensor]:
        eng = tf.engine(str(tmp_path / "m"), exact=False, device="cuda", max_len=4096, **kw)
        try:
            return [run(eng) for _ in range(n)]
        finally:
            eng.close()

    ref, = runs()
    again, = runs()
    assert bitwise(again, ref), "cold twice"
    cold, warm = runs(2, cache_gb=4.0)
    assert bitwise(cold, ref) and bitwise(warm, ref), "every expert cached (cold, then warm)"
    for what, kw in {"a partial cache": dict(cache_gb=0.5), "CUDA graphs off": dict(cuda_graphs=False),
                     "no kernel warmup": dict(warmup=False)}.items():
        assert bitwise(runs(**kw)[0], ref), what


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "glm4_moe", "qwen3_next", "kimi_k3"])
def test_cuda_batch_invariant_logits_alone_equal_batched(packed, family):
    """--batch-invariant on CUDA (bf16 fast path): P's prompt and decode logits alone equal those of P between Q
    and R, bit for bit (one tile shape at every token count, no split-K, no decode GEMV, graphs off)."""
    _, model = packed(family)
    ref = logits(model, False, device="cuda", batch_invariant=True)
    assert bitwise(logits(model, False, together=True, device="cuda", batch_invariant=True), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "qwen3_next", "kimi_k3"])
def test_cuda_logits_bit_identical_across_read_order_threads_layout_and_batch(packed, family, exact, tmp_path):
    """On CUDA, both paths: reads landing out of order (jittered emulated drives), 1 or 8 reader threads a drive,
    the same source packed onto one drive or striped over three, and (batch-invariant) P between two other sequences leave P's prompt
    and decode logits bit for bit as they were."""
    lossless, default = packed(family)
    model = lossless if exact else default
    ref = logits(model, exact, device="cuda")
    src = Path(model).parent / "src"
    opts = tf.LOSSLESS if exact else tf.DEFAULT
    pack(str(src), str(tmp_path / "one"), parse_drives([f"{tmp_path}/one0=1"]), opts)
    pack(str(src), str(tmp_path / "striped"), parse_drives([f"{tmp_path}/s{j}={r}" for j, r in enumerate((2, 1, 0.5))]),
         replace(opts, placement="stripe-bandwidth"))
    variants = {
        "reads landing out of order": (model, dict(emulate_drives=JITTER)),
        "1 reader thread a drive": (model, dict(threads=1)),
        "8 reader threads a drive": (model, dict(threads=8)),
        "every expert cached": (model, dict(cache_gb=1.0)),
        "no kernel warmup at open": (model, dict(warmup=False)),
        "one drive": (str(tmp_path / "one"), {}),
        "striped over three drives": (str(tmp_path / "striped"), {}),
    }
    for what, (m, kw) in variants.items():
        assert bitwise(logits(m, exact, device="cuda", **kw), ref), f"{family}: {what} changed the logits"
    alone = logits(model, exact, device="cuda", batch_invariant=True)
    assert bitwise(logits(model, exact, together=True, device="cuda", batch_invariant=True), alone), \
        f"{family}: batched with two others changed the logits (batch-invariant)"
