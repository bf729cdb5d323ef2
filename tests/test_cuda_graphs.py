"""The CUDA-graph decode runner of Kimi K3 (runtime/cuda_graphs.py) and what it needs of the model: state
updated in place, MLA decode at a position held in a device tensor, the static-buffer stages run eagerly
on the CPU against the plain path, and (marked gpu) the recorded graphs against the eager bf16 path."""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before the Triton kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deltafin.k3_tiny import tiny_config, write_tiny_k3  # noqa: E402
from deltafin.models import registry  # noqa: E402
from deltafin.models.base import ResidentExperts  # noqa: E402
from deltafin.models.kda import KDAState  # noqa: E402
from deltafin.runtime.batch import forward_batch  # noqa: E402
from deltafin.runtime.cuda_graphs import DecodeGraphs, why_not  # noqa: E402
from tests.test_kimi_k3 import checkpoint_records  # noqa: E402

PROMPT = [5, 17, 200, 33, 9, 120, 64, 2]


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(dtype=torch.float32, device="cpu", **overrides):
    config = tiny_config(**overrides)
    trunk, experts = checkpoint_records(config)
    model = registry.build("kimi_k3", config["text_config"], trunk, device, dtype)
    return model, ResidentExperts(experts, device)


def _plain(model, experts, tok: int, st) -> torch.Tensor:
    return forward_batch(model, [(torch.tensor([tok], device=model.device), st)], experts)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _greedy_pair(model, experts, steps: int, max_len: int = 32):
    """Prefill PROMPT, then decode greedily on the plain path and through the runner from copies of the
    same state; returns (plain logits, runner logits) per step."""
    st = model.new_state(max_len)
    with torch.inference_mode():
        (logits,) = forward_batch(model, [(torch.tensor(PROMPT), st)], experts)
        a, b = st, copy.deepcopy(st)
        runner = DecodeGraphs(model, experts, capture=False)
        ta = tb = int(logits[-1].argmax())
        out_a, out_b = [], []
        for _ in range(steps):
            la, lb = _plain(model, experts, ta, a), runner.step(torch.tensor([tb]), b)
            out_a.append(la)
            out_b.append(lb)
            ta, tb = int(la[-1].argmax()), int(lb[-1].argmax())
    return out_a, out_b, a, b, runner


def test_kda_state_is_updated_in_place():
    model, experts = _model()
    st = model.new_state(16)
    kda_layers = [(i, s) for i, s in enumerate(st.layers) if isinstance(s, KDAState)]
    held = {i: (s.conv, s.S) for i, s in kda_layers}
    before = {i: (c.clone(), S.clone()) for i, (c, S) in held.items()}
    with torch.inference_mode():
        forward_batch(model, [(torch.tensor(PROMPT[:5]), st)], experts)  # chunked prefill
        forward_batch(model, [(torch.tensor([7]), st)], experts)  # one-token recurrence
    for i, s in kda_layers:
        assert s.conv is held[i][0] and s.S is held[i][1], f"layer {i}: state rebound instead of written in place"
        assert not torch.equal(s.S, before[i][1]) and not torch.equal(s.conv, before[i][0])


def test_mla_decode_at_device_position_equals_python_int():
    """The masked whole-buffer attention at a device-held position gives the Python-int decode's output, with
    stale finite rows past the position ignored. Not bit for bit: the softmax and the value sum run over the
    whole buffer (masked terms are exact zeros, but the vectorised sums group the terms by length), so
    within float32 rounding (measured ~1e-7 relative)."""
    model, _ = _model()
    mla_layer = next(i for i in range(model.num_layers) if not model.cfg.is_kda(i))
    pre = f"model.layers.{mla_layer}.self_attn."
    T, max_len = 11, 20
    x = torch.randn(T, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    plain = model.new_state(max_len).layers[mla_layer]
    at = model.new_state(max_len).layers[mla_layer]
    at.buf = torch.randn(max_len, *at.row, generator=torch.Generator().manual_seed(4))  # stale rows: masked
    for t in range(T):
        want = model._mla(pre, x[t : t + 1], plain, t)
        got = model._mla(pre, x[t : t + 1], at, t, torch.tensor([t]))
        at.length = t + 1
        assert _rel(got, want) < 1e-6, f"position {t}: {_rel(got, want):.3g}"
    assert torch.equal(at.rows(), plain.rows())


def test_runner_eager_on_cpu_equals_plain_path():
    """The runner's stages over static buffers, run eagerly, decode what the plain path decodes: the same
    tokens, logits and state within float32 rounding (the MLA sums over the whole cache buffer, above)."""
    out_a, out_b, a, b, _ = _greedy_pair(*_model(), steps=10)
    for t, (la, lb) in enumerate(zip(out_a, out_b, strict=True)):
        assert int(la.argmax()) == int(lb.argmax())
        assert _rel(lb, la) < 1e-5, f"step {t}: logits differ by {_rel(lb, la):.3g}"
    assert a.pos == b.pos == len(PROMPT) + 10
    for sa, sb in zip(a.layers, b.layers, strict=True):
        if isinstance(sa, KDAState):
            assert _rel(sb.S, sa.S) < 1e-5 and _rel(sb.conv, sa.conv) < 1e-5
        else:
            assert sa.length == sb.length and _rel(sb.rows(), sa.rows()) < 1e-5


def test_runner_moves_between_sequences():
    """Two sequences decoded in turns through one runner (each adopts the runner's buffers in turn, the other
    gets its own copies back) give the logits of decoding each alone; a prefill in between continues
    from the adopted state."""
    model, experts = _model()
    runner = DecodeGraphs(model, experts, capture=False)
    with torch.inference_mode():
        ref, mix = {}, {}
        for name, prompt in (("a", PROMPT), ("b", PROMPT[::-1])):
            st = model.new_state(32)
            forward_batch(model, [(torch.tensor(prompt), st)], experts)
            ref[name] = [_plain(model, experts, t, st) for t in (3, 4, 5)]
            forward_batch(model, [(torch.tensor([6, 7]), st)], experts)
            ref[name].append(_plain(model, experts, 8, st))
        states = {}
        for name, prompt in (("a", PROMPT), ("b", PROMPT[::-1])):
            states[name] = model.new_state(32)
            forward_batch(model, [(torch.tensor(prompt), states[name])], experts)
            mix[name] = []
        for t in (3, 4, 5):
            for name in ("a", "b"):
                mix[name].append(runner.step(torch.tensor([t]), states[name]))
        for name in ("a", "b"):
            forward_batch(model, [(torch.tensor([6, 7]), states[name])], experts)
            mix[name].append(runner.step(torch.tensor([8]), states[name]))
    for name in ("a", "b"):
        for la, lb in zip(ref[name], mix[name], strict=True):
            assert _rel(lb, la) < 1e-5


def test_runner_static_plan_grouped_kernels_through_interpreter(monkeypatch):
    """bf16 on the kernel path (Triton's interpreter on the CPU): the runner's fixed-grid launch from slab
    slots in static buffers gives the plain path's grouped launch (equal logits when measured; the bound
    leaves room for the MLA's whole-buffer sums)."""
    if torch.cuda.is_available():
        pytest.skip("the GPU test covers this compiled")
    pytest.importorskip("triton")
    from deltafin.kernels import cuda as kc

    monkeypatch.setenv("DELTAFIN_KERNELS", "interpret")
    kc.USED.clear()
    out_a, out_b, _, _, runner = _greedy_pair(*_model(torch.bfloat16, num_hidden_layers=3, mla_every=2), steps=2,
                                              max_len=12)
    assert "triton:grouped_mxfp4" in kc.USED
    assert {kind for kind, _ in runner.decided.values()} == {"plan"}  # every MoE layer took the static plan
    for la, lb in zip(out_a, out_b, strict=True):
        assert _rel(lb, la) < 1e-3  # 0 when measured; a wrong slot would be off by O(1)


class _SlabSource:
    """The tiny model's experts in one slab (shuffled slots), served as the streaming source's cache serves
    them: views of their slots; ``resident`` says whether it offers the slot tables (``resident_slots``)."""

    def __init__(self, experts: ResidentExperts, resident: bool):
        from deltafin.kernels.triton_moe import ExpertSlab

        keys = sorted(experts.experts)
        self.slab = ExpertSlab(len(keys), experts.experts[keys[0]], "cpu")
        order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(3)).tolist()
        self.slot = dict(zip(keys, order, strict=True))
        for k, s in self.slot.items():
            self.slab.write(s, experts.experts[k])
        self.resident, self.fetched, self.served = resident, [], 0
        self.E = 1 + max(e for _, e in keys)

    def fetch(self, layer, ids):
        self.fetched.append(layer)
        for e in ids:
            yield e, self.slab.views(self.slot[(layer, e)])

    def resident_slots(self, layer):
        if not self.resident:
            return None
        return torch.tensor([self.slot[(layer, e)] for e in range(self.E)], dtype=torch.int32,
                            device=self.slab.data["gate"].device)

    def served_resident(self, layer, n):
        self.served += n


def test_resident_layers_look_slots_up_on_the_device(monkeypatch):
    """A source that keeps every expert in its slab for good (``resident_slots``): the runner skips the layer's
    host fetch and looks the slots up on the device; the logits are the host path's, bit for bit (the same
    kernels over the same slots), through the kernels (Triton's interpreter on the CPU, compiled on CUDA)."""
    pytest.importorskip("triton")
    from deltafin.kernels import cuda as kc

    if not torch.cuda.is_available():
        monkeypatch.setenv("DELTAFIN_KERNELS", "interpret")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model, experts = _model(torch.bfloat16, dev, num_hidden_layers=3, mla_every=2)
    if dev == "cuda":
        experts.experts = {k: {n: t.cpu() for n, t in v.items()} for k, v in experts.experts.items()}
    out = {}
    for resident in (False, True):
        src = _SlabSource(experts, resident)
        if dev == "cuda":
            src.slab = _to_cuda_slab(src.slab, experts)
        st = model.new_state(12)
        with torch.inference_mode():
            forward_batch(model, [(torch.tensor(PROMPT, device=dev), st)], ResidentExperts(experts.experts, dev))
            runner = DecodeGraphs(model, src, capture=dev == "cuda")
            kc.USED.clear()
            out[resident] = [runner.step(torch.tensor([t], device=dev), st).clone() for t in (3, 40, 7)]
        assert "triton:grouped_mxfp4" in kc.USED
        assert {kind for kind, _ in runner.decided.values()} == {"plan"}
        if resident:
            assert src.fetched == [] and src.served == 3 * len(runner.moe) * runner.k
        else:
            assert len(src.fetched) == 3 * len(runner.moe)
    for a, b in zip(out[False], out[True], strict=True):
        assert torch.equal(a, b)


def _to_cuda_slab(slab, experts):
    from deltafin.kernels.triton_moe import ExpertSlab

    keys = sorted(experts.experts)
    cuda = ExpertSlab(slab.slots, experts.experts[keys[0]], "cuda")
    for r in ExpertSlab.ROLES:
        cuda.data[r].copy_(slab.data[r])
        cuda.scale[r].copy_(slab.scale[r])
    return cuda


def test_graphs_refused_with_a_reason():
    model, experts = _model()
    assert "cpu" in why_not(model, experts, torch.device("cpu"), torch.bfloat16)
    assert "float32" in why_not(model, experts, torch.device("cuda"), torch.float32)

    class Split(ResidentExperts):
        def combine(self, layer, out, ids):
            return out

    assert "ranks" in why_not(model, Split({}), torch.device("cuda"), torch.bfloat16)


# ---------------------------------------------------------------------------------------------- GPU
# The graphs are checked against the same stages run eagerly, step by step from the same state (so a
# difference cannot compound). Against the plain layer-by-layer path the comparison says little on the tiny
# random K3 in bf16: the plain path attends through torch's SDPA on CUDA (the scores rounded another way),
# and this model amplifies bf16 roundings (on the CPU, bf16 SDPA vs the grouped attention: logits 0.42 apart
# relative over 32 teacher-forced steps, 2 of 32 top tokens flipped; bf16 vs float32 ~1.4 at every step).

def _against_eager_stages(step_graph, eager: DecodeGraphs, state, tokens: list[int], copy_state) -> list[float]:
    """For each token: the graph step from a copy of the eager runner's state, then the eager step; the
    relative logit differences."""
    out = []
    for t in tokens:
        ids = torch.tensor([t], device=eager.model.device)
        lg = step_graph(ids, copy_state(state))
        le = eager.step(ids, state)
        out.append(((lg.float() - le.float()).norm() / le.float().norm()).item())
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_recorded_graphs_replay_the_eager_stages():
    """Tiny K3 in bf16 on CUDA, experts resident (not in a slab: the runner stages them into its own): 32
    decode steps replayed from the recorded graphs give the logits of the same stages run eagerly."""
    model, experts = _model(torch.bfloat16, "cuda")
    st = model.new_state(64)
    with torch.inference_mode():
        forward_batch(model, [(torch.tensor(PROMPT, device="cuda"), st)], experts)
        graphs, eager = DecodeGraphs(model, experts), DecodeGraphs(model, experts, capture=False)
        tokens = [int(t) for t in torch.randint(0, model.vocab_size, (32,), generator=torch.Generator().manual_seed(0))]
        rel = _against_eager_stages(graphs.step, eager, st, tokens, copy.deepcopy)
    assert all(g is not None for g in graphs.graphs), "every stage recorded"
    assert {kind for kind, _ in graphs.decided.values()} == {"plan"} and graphs.staging is not None
    assert max(rel) < 1e-3, f"graph vs eager stages: {max(rel):.3g} (relative; equal when measured on the CPU)"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_decodes_through_graphs_by_default(tmp_path, monkeypatch):
    """The engine's bf16 decode on CUDA replays the graphs (experts in the streaming source's slab), the
    stats name them, each step equals the eager stages from the same state; DELTAFIN_CUDA_GRAPHS=0 turns
    them off."""
    from deltafin.runtime.engine import Engine, EngineOptions
    from deltafin.store.drives import parse_drives
    from deltafin.store.pack import PackOptions, pack

    write_tiny_k3(tmp_path / "src")
    pack(str(tmp_path / "src"), str(tmp_path / "m"), parse_drives([f"{tmp_path}/d0=2", f"{tmp_path}/d1=1"]),
         PackOptions(progress=False))
    opts = EngineOptions(device="cuda", cache_gb=1.0, exact=False)
    eng = Engine(str(tmp_path / "m"), opts)
    try:
        toks = [t for t, _ in eng.generate(PROMPT, 32, stop_ids=())]
        assert "cuda:graphs" in eng.last_stats.kernels
        runner = eng._decode_graphs()
        assert runner is not None and all(g is not None for g in runner.graphs)
        assert {kind for kind, _ in runner.decided.values()} == {"plan"} and runner.staging is None  # source slab
        st = eng.new_state()
        eng.forward(PROMPT, st)
        eager = DecodeGraphs(eng.model, eng.source, capture=False)
        with torch.inference_mode():
            rel = _against_eager_stages(lambda ids, s: eng.forward(ids.tolist(), s)[None], eager, st, toks,
                                        eng.copy_state)
        assert max(rel) < 1e-3, f"engine graphs vs eager stages: {max(rel):.3g} (relative)"
    finally:
        eng.close()
    monkeypatch.setenv("DELTAFIN_CUDA_GRAPHS", "0")
    eng = Engine(str(tmp_path / "m"), opts)
    try:
        list(eng.generate(PROMPT, 2, stop_ids=()))
        assert eng._decode_graphs() is None
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_with_the_whole_model_cached_skips_the_host_fetch(tmp_path):
    """A cache that holds every expert of the model: once a layer's experts are all in the slab the streaming
    source offers its slot table, decode stops fetching that layer on the host, and each step's logits are those
    of the host path from the same state, bit for bit."""
    from deltafin.runtime.engine import Engine, EngineOptions
    from deltafin.store.drives import parse_drives
    from deltafin.store.pack import PackOptions, pack

    write_tiny_k3(tmp_path / "src")
    pack(str(tmp_path / "src"), str(tmp_path / "m"), parse_drives([f"{tmp_path}/d0=2"]), PackOptions(progress=False))
    eng = Engine(str(tmp_path / "m"), EngineOptions(device="cuda", cache_gb=1.0, exact=False))
    try:
        src, moe = eng.source, eng.packed.moe_layers
        st = eng.new_state()
        eng.forward(PROMPT, st)
        for L in moe:  # every expert once, so that every layer becomes resident
            list(src.fetch(L, list(range(eng.packed.num_experts))))
        assert all(src.resident_slots(L) is not None for L in moe)
        for L in moe:
            assert src.resident_slots(L).tolist() == [src._slot_of[(L, e)] for e in range(eng.packed.num_experts)]
        toks = [t for t, _ in eng.generate(PROMPT, 8, stop_ids=())]
        runner = eng._decode_graphs()
        host, hits, fetched = eng.copy_state(st), src.stats.hits, []
        fetch = src.fetch
        src.fetch = lambda L, ids: (fetched.append(L), fetch(L, ids))[1]
        with torch.inference_mode():
            a = [eng.forward([t], st) for t in toks]
            assert fetched == [] and src.stats.hits == hits + len(toks) * len(moe) * runner.k
            offer = src.resident_slots
            src.resident_slots = lambda L: None
            try:
                b = [eng.forward([t], host) for t in toks]
            finally:
                src.resident_slots = offer
        assert len(fetched) == len(toks) * len(moe)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert all(g is not None for g in runner.graphs)
    finally:
        eng.close()


def test_stacked_projections_are_views_and_keep_the_step(monkeypatch):
    """stack_decode_projections: every same-input group becomes one int8 record whose row views replace the
    originals (the other paths read the same numbers, prefill bit for bit), and a one-token step on the kernel
    path (the GPU's where there is one, else Triton's interpreter on the CPU) through the stacked GEMVs gives the
    unstacked step's logits within the kernels' rounding (split-K partial sums grouped by another width)."""
    from deltafin.quant import int8
    from deltafin.quant.record import QTensor

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":  # the interpreter runs the kernels on CPU tensors (TRITON_INTERPRET set at import above)
        monkeypatch.setenv("DELTAFIN_KERNELS", "interpret")
    config = tiny_config(num_hidden_layers=3, mla_every=2)
    trunk, records = checkpoint_records(config)
    for n, t in trunk.items():  # the packed trunk's int8 projections
        if "_proj" in n and n.endswith(".weight") and len(t.shape) == 2:
            trunk[n] = QTensor("int8", t.shape, *int8.quantize(t.data.float()))
    model = registry.build("kimi_k3", config["text_config"], trunk, dev, torch.bfloat16)
    experts = ResidentExperts(records, dev)
    before = {n: t.data.clone() for n, t in model.w.items() if getattr(t, "format", None) == "int8"}
    st = model.new_state(32)
    prompt, tok = torch.tensor(PROMPT, device=dev), torch.tensor([7], device=dev)
    with torch.inference_mode():
        (pre_a,) = forward_batch(model, [(prompt, st)], experts)
        one = copy.deepcopy(st)
        (step_a,) = forward_batch(model, [(tok, one)], experts)
        model.stack_decode_projections()
        model.stack_decode_projections()  # idempotent
        groups = model._stacked
        assert {k.split(".")[-2] for k in groups} >= {"self_attn", "mlp"}
        for t, sizes in groups.values():
            assert t.shape[0] == sum(sizes) and t.data.is_contiguous()
        views = [n for n, t in model.w.items() if getattr(t, "format", None) == "int8"
                 and any(t.data.untyped_storage().data_ptr() == g.data.untyped_storage().data_ptr()
                         for g, _ in groups.values())]
        assert len(views) >= 2 * len(groups)
        for n in before:
            assert torch.equal(model.w[n].data, before[n]), n
        (pre_b,) = forward_batch(model, [(prompt, model.new_state(32))], experts)
        assert torch.equal(pre_a, pre_b)
        used, inner = [], model._stacked_rows
        monkeypatch.setattr(model, "_stacked_rows", lambda key, x: used.append(key) or inner(key, x))
        assert len(groups) == 2 * model.num_layers  # attention and MLP input of every layer
        (step_b,) = forward_batch(model, [(tok, copy.deepcopy(st))], experts)
    assert set(used) == set(groups)  # every group ran stacked
    assert _rel(step_b, step_a) < 2e-2
