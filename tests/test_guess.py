"""Reading the next layer's likely experts ahead (``--guess-next``): a decode layer's fetch takes the guessed reads it
asks for, the others are cancelled before they start or skipped when they land (their buffers back, their failures
forgotten); guesses are read only where they pay (mostly right, their unused reads shorter than the drives' idle
gap), and the logits never change."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from deltafin.io.direct import FileDriveReader
from deltafin.runtime import source as source_mod
from deltafin.runtime.engine import Engine, EngineOptions
from deltafin.runtime.layer_reads import LayerReads
from deltafin.runtime.source import StreamingExperts
from deltafin.store.model_dir import PackedModel
from tests.tiny_families import DEFAULT, build, pack_to, prompt
from tests.waiting import bounded

STEPS = 12


class _Held(FileDriveReader):
    """Reads of paths containing ``hold`` wait until released; reads of ``fail`` raise an I/O error."""

    def __init__(self, label, root, hold: str | None = None, fail: str | None = None):
        super().__init__(label, root)
        self.hold, self.fail = hold, fail
        self.release = threading.Event()
        self.started = threading.Event()
        self.paths: list[str] = []

    def read_into(self, path, offset, buf):
        self.paths.append(path)
        if self.hold and self.hold in path:
            self.started.set()
            self.release.wait(60)
        if self.fail and self.fail in path:
            raise OSError(5, "Input/output error")
        return super().read_into(path, offset, buf)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("qwen3_moe")
    build("qwen3_moe", root / "src")
    return pack_to(root, DEFAULT)


def _source(pm: PackedModel, reader: _Held, **kw) -> StreamingExperts:
    """One reader thread a drive; ``reader`` serves the first drive."""
    readers = [reader] + [FileDriveReader(d.label, d.path) for d in pm.drives[1:]]
    return StreamingExperts(pm, cache_bytes=0, threads=1, readers=readers, reserve=False, **kw)


def _first_drive(k3_model) -> tuple[PackedModel, str]:
    pm = PackedModel.open(str(k3_model / "model"))
    return pm, pm.drives[0].label


def _experts_on(pm: PackedModel, layer: int, drive: int = 0) -> list[int]:
    return [e for e in range(pm.num_experts) if drive in pm.locations(layer, e)]


def _decode(model: str, guess: bool, cache_gb: float, device: str = "cpu") -> tuple[torch.Tensor, object]:
    eng = Engine(model, EngineOptions(exact=False, max_len=64, cache_gb=cache_gb, guess_next=guess, device=device))
    eng.threads = None
    try:
        st, out = eng.new_state(), []
        tok = int(eng.forward(prompt(5), st).argmax())
        for _ in range(STEPS):
            lg = eng.forward([tok], st)
            out.append(lg.clone())
            tok = int(lg.argmax())
        return torch.stack(out), eng.source.stats
    finally:
        eng.close()


@pytest.fixture
def always_read(monkeypatch):
    """Every guess's misses read, however its guesses score (tiny random models route too unpredictably)."""
    monkeypatch.setattr(StreamingExperts, "guess_reads", property(lambda self: True))
    monkeypatch.setattr(source_mod, "GUESS_PROBE", 1 << 30)  # none scored unread


@pytest.mark.parametrize("family", ["qwen", "k3"])
def test_guessed_reads_change_no_logit(family, qwen, k3_model, always_read):
    """Qwen3-MoE guesses through the compiled one-token routing, Kimi K3 through its torch router: with every expert
    a miss, the guesses' reads start a layer early and the logits are the unguessed run's bit for bit."""
    model = qwen if family == "qwen" else str(k3_model / "model")
    plain, st0 = _decode(model, False, 0.0)
    guessed, st1 = _decode(model, True, 0.0)
    assert torch.equal(plain, guessed)
    assert st0.guessed == 0 and st1.guessed > 0
    assert 0 < st1.guess_used <= st1.guessed and st1.guess_cancelled <= st1.guessed - st1.guess_used
    assert st1.hits == st0.hits and st1.misses == st0.misses  # a guess changes when reads start, not what is read


def test_narrowed_reads_cancel_what_has_not_started_and_skip_what_has(k3_model):
    pm, label = _first_drive(k3_model)
    L = pm.moe_layers[0]
    ids = _experts_on(pm, L)[:4]
    reader = _Held(label, pm.drives[0].path, hold=pm.expert_path(L, ids[0], 0))  # the others queue behind it
    src = _source(pm, reader)
    try:
        reads = LayerReads(src, L, ids)
        assert bounded(lambda: reader.started.wait(10), 20, "the first read starts")
        cancelled = reads.narrow({ids[2]})  # the first is under way, the second and fourth have not started
        assert cancelled == 2
        reader.release.set()
        e, buf, nbytes, _ = bounded(reads.next, 20, "the wanted expert lands")
        assert e == ids[2] and nbytes == pm.file_bytes(L)
        src.pool.buffers.put(buf)
        assert bounded(lambda: _poll_until_done(reads), 20, "the unwanted read lands")
        read = set(reader.paths)
        assert pm.expert_path(L, ids[1], 0) not in read and pm.expert_path(L, ids[3], 0) not in read
        free = sum(len(v) for v in src.pool.buffers._free.values())
        assert free == 2  # the skipped expert's buffer and the wanted one's, both back
        assert src.pool.pending_bytes() == [0] * len(pm.drives)
    finally:
        reader.release.set()
        src.close()


def _poll_until_done(reads: LayerReads) -> bool:
    while not reads.poll():
        time.sleep(0.01)
    return True


def test_a_failed_read_of_an_unwanted_expert_is_forgotten(k3_model):
    pm, label = _first_drive(k3_model)
    L = pm.moe_layers[0]
    a, b = _experts_on(pm, L)[:2]
    reader = _Held(label, pm.drives[0].path, fail=pm.expert_path(L, a, 0))
    reader.hold = pm.expert_path(L, a, 0)
    src = _source(pm, reader)
    try:
        reads = LayerReads(src, L, [a, b])
        assert bounded(lambda: reader.started.wait(10), 20, "the read of the first starts")
        assert reads.narrow({b}) == 0  # the second is queued behind the first, which has started: nothing cancels
        reader.release.set()
        e, buf, _, _ = bounded(reads.next, 20, "the wanted expert lands")  # the unwanted one's error is not raised
        assert e == b
        src.pool.buffers.put(buf)
        assert bounded(lambda: _poll_until_done(reads), 20, "nothing left in flight")
        assert src.stats.failed_reads == 0
    finally:
        reader.release.set()
        src.close()


def test_a_fetch_takes_the_guessed_reads_it_asks_for(k3_model, always_read):
    """The guess is read once the next fetch has queued its own reads; the guessed layer's fetch yields exactly what
    it asks for, the right guesses among them, and the same bytes as an unguessed fetch."""
    pm, label = _first_drive(k3_model)
    L0, L1 = pm.moe_layers[:2]
    on1 = _experts_on(pm, L1)
    src = _source(pm, _Held(label, pm.drives[0].path))
    try:
        src._note_misses(1)  # a miss was seen: guessing is on
        assert src.wants_guess(L1)
        src.guess(L1, on1[:3])
        for _ in src.fetch(L0, _experts_on(pm, L0)[:2]):
            pass
        assert src.stats.guessed == 3 and L1 in src._ahead
        got = []
        for e, t in src.fetch(L1, [on1[1], on1[4]]):  # checked as it comes: its buffer is reused after
            want = pm.read_expert(L1, e)
            assert all(torch.equal(t[k].data, want[k].data) for k in want)
            got.append(e)
        assert sorted(got) == sorted([on1[1], on1[4]])
        assert src.stats.guess_used == 1
    finally:
        src.close()


def test_guesses_are_read_only_while_they_score_well(k3_model):
    """Guesses are scored against what their layer asks for; unread while too few are scored or they score low (then
    one turn in GUESS_PROBE), read once they score well."""
    pm, label = _first_drive(k3_model)
    L0, L1 = pm.moe_layers[:2]
    on0, on1 = _experts_on(pm, L0), _experts_on(pm, L1)
    src = _source(pm, _Held(label, pm.drives[0].path))

    def rounds(n: int, guessed: list[int]) -> list[bool]:
        offered = []
        for _ in range(n):
            offered.append(src.wants_guess(L1))
            if offered[-1]:
                src.guess(L1, guessed)
            for _ in src.fetch(L0, on0[:1]):
                pass
            for _ in src.fetch(L1, on1[2:4]):
                pass
        return offered

    try:
        offered = rounds(3 * source_mod.GUESS_PROBE * src._guess_log.maxlen, on1[:2])  # always wrong
        assert not src.guess_reads and src.stats.guessed == 0  # scored, never read
        assert "0% of their misses were asked for" in src.guess_note
        late = offered[len(offered) // 2:]
        assert 0 < sum(late) <= len(late) // source_mod.GUESS_PROBE + 1  # a probe now and then, no more
        rounds(2 * source_mod.GUESS_PROBE * src._guess_log.maxlen, on1[2:4])  # right: the probes notice
        assert src.guess_gap_s is not None and src.guess_waste_s == 0  # nothing wasted: any gap is worth filling
        assert src.guess_reads and src.wants_guess(L1) and src.guess_note == ""
        rounds(2 * source_mod.GUESS_PROBE, on1[2:4])
        assert src.stats.guessed > 0 and src.stats.guess_used == src.stats.guessed
        assert len(src._gaps) > 0  # one guess in GUESS_PROBE scored unread, so the gap is still measured
    finally:
        src.close()


def test_guesses_whose_unused_reads_outweigh_the_gap_are_not_read(k3_model):
    """Guesses mostly right, but their unused reads would take longer than the drives sit idle: not read."""
    pm, label = _first_drive(k3_model)
    src = _source(pm, _Held(label, pm.drives[0].path))
    try:
        for _ in range(4):
            src._log_guess(8, 5)  # 5 of 8 asked for: useful 62%, 3 unused reads a guess
        src._gaps.append(1e-6)  # the drives idle 1 us before a layer's reads
        assert src.guess_useful >= source_mod.GUESS_MIN_USEFUL and src.guess_waste_s > src.guess_gap_s
        assert not src.guess_reads and "against 0.0 ms the drives sat idle" in src.guess_note
        src._gaps.append(10.0)  # ten seconds idle: worth it
        assert src.guess_reads
    finally:
        src.close()


def test_no_guess_next_turns_guessing_off(k3_model):
    pm, label = _first_drive(k3_model)
    src = _source(pm, _Held(label, pm.drives[0].path), guess_next=False)
    try:
        src._note_misses(3)
        assert not src.wants_guess(pm.moe_layers[1])
    finally:
        src.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["qwen", "k3"])
def test_guessed_reads_change_no_logit_on_cuda(family, qwen, k3_model, always_read):
    """On CUDA the guesses' reads land in slab slots and are checked there like the layer's own."""
    model = qwen if family == "qwen" else str(k3_model / "model")
    plain, _ = _decode(model, False, 0.0, "cuda")
    guessed, st = _decode(model, True, 0.0, "cuda")
    assert torch.equal(plain, guessed) and st.guessed > 0


def test_the_graph_runner_guesses_and_changes_no_logit(k3_model, always_read):
    """Kimi K3's decode-step runner (runtime/cuda_graphs.py, its stages run eagerly here) guesses each next MoE layer
    after the trunk stage before it; the logits are the unguessed runner's bit for bit. The runner holds a layer's
    experts all at once (``list(fetch)``), which on the CPU needs them cached (an uncached expert's read buffer is
    reused once the next is asked for); on CUDA they are slab copies."""
    from deltafin.runtime.cuda_graphs import DecodeGraphs

    outs = {}
    for guess in (False, True):
        eng = Engine(str(k3_model / "model"), EngineOptions(exact=False, max_len=64, cache_gb=1.0, guess_next=guess))
        try:
            runner = DecodeGraphs(eng.model, eng.source, capture=False)
            st, got = eng.new_state(), []
            tok = int(eng.forward(prompt(5), st).argmax())
            with torch.inference_mode():
                for _ in range(STEPS):
                    lg = runner.step(torch.tensor([tok]), st)
                    got.append(lg.clone())
                    tok = int(lg.argmax())
            outs[guess] = torch.stack(got), eng.source.stats
        finally:
            eng.close()
    (plain, st0), (guessed, st1) = outs[False], outs[True]
    assert torch.equal(plain, guessed)
    assert st0.guessed == 0 and st1.guessed > 0 and st1.guess_used > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_recorded_graphs_guess_and_change_no_logit(k3_model, always_read):
    """On CUDA the runner records each guess as a graph of its own and replays it while the source guesses."""
    from deltafin.runtime.cuda_graphs import DecodeGraphs

    outs = {}
    for guess in (False, True):
        eng = Engine(str(k3_model / "model"), EngineOptions(exact=False, max_len=64, cache_gb=0.0, guess_next=guess,
                                                            device="cuda"))
        try:
            runner = DecodeGraphs(eng.model, eng.source)
            st, got = eng.new_state(), []
            tok = int(eng.forward(prompt(5), st).argmax())
            with torch.inference_mode():
                for _ in range(STEPS):
                    lg = runner.step(torch.tensor([tok], device="cuda"), st)
                    got.append(lg.clone())
                    tok = int(lg.argmax())
            outs[guess] = torch.stack(got), eng.source.stats, len(runner.guess_graphs), all(runner.graphs)
        finally:
            eng.close()
    (plain, st0, g0, rec0), (guessed, st1, g1, rec1) = outs[False], outs[True]
    assert rec0 and rec1  # every stage recorded
    assert torch.equal(plain, guessed)
    assert st0.guessed == 0 and g0 == 0 and st1.guessed > 0 and g1 > 0


def test_a_split_trunk_guesses_within_each_side(qwen, always_read):
    """``--gpu-layers``' split (both sides on the CPU here): each side guesses its own layers, none across the hand-over,
    and the logits are the unguessed split's bit for bit."""
    from deltafin.runtime import offload
    from deltafin.runtime.batch import forward_batch
    from deltafin.runtime.offload_plan import OffloadPlan

    pm = PackedModel.open(qwen)
    L = int(pm.text_config["num_hidden_layers"])
    plan = OffloadPlan(L, L // 2, 0, 0, "test")
    cpu = torch.device("cpu")
    outs = {}
    for guess in (False, True):
        model = offload.build_split(pm.family, pm.text_config, pm.trunk_records(), plan, cpu, torch.float32,
                                    torch.float32)
        src = offload.SplitExperts(*(StreamingExperts(pm, 0, 2, "cpu", reserve=False, guess_next=guess)
                                     for _ in range(2)), plan.first_gpu)
        st, got = model.new_state(64), []
        try:
            with torch.inference_mode():
                tok = int(forward_batch(model, [(torch.tensor(prompt(5)), st)], src)[0][-1].argmax())
                for _ in range(STEPS):
                    lg = forward_batch(model, [(torch.tensor([tok]), st)], src)[0]
                    got.append(lg.clone())
                    tok = int(lg[-1].argmax())
            outs[guess] = torch.stack(got), src.stats
        finally:
            src.close()
    assert torch.equal(outs[False][0], outs[True][0])
    assert outs[False][1].guessed == 0 and outs[True][1].guessed > 0
