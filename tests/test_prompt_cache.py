"""The prompt cache on its own (no server): restored states continue exactly like states prefilled in full,
for every family's kind of state (KV caches, MLA latent caches, K3's KDA recurrent state), with the
cut-back rule, the byte budget and LRU eviction."""

from __future__ import annotations

import pytest
import torch

from deltafin.k3_tiny import write_tiny_k3
from deltafin.runtime.batched import BatchDecoder, GenSpec, new_seqs
from deltafin.runtime.engine import Engine, EngineOptions
from deltafin.runtime.prompt_cache import PromptCache, common_prefix
from deltafin.store.drives import parse_drives
from deltafin.store.pack import PackOptions, pack
from tests.tiny import pack_tiny

FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "kimi_k3"]
OPTS = EngineOptions(exact=True, cache_gb=0.05, max_len=128, threads=2)
A = [5, 17, 99, 3, 42, 7, 250, 11, 60, 61]  # the shared prefix
B = [8, 9, 200, 31]  # the new turn
MB = 1 << 20


@pytest.fixture(scope="module", params=FAMILIES)
def eng(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"pc-{request.param}")
    if request.param == "kimi_k3":
        write_tiny_k3(root / "src", num_hidden_layers=6)  # KDA and MLA layers, two AttnRes blocks
        pack(
            str(root / "src"),
            str(root / "model"),
            parse_drives([f"{root}/d0=2", f"{root}/d1=1"]),
            PackOptions(progress=False),
        )
        path = str(root / "model")
    else:
        path = pack_tiny(root, request.param)
    e = Engine(path, OPTS)
    yield e
    e.close()


def greedy(eng: Engine, state, logits: torch.Tensor, n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = eng.forward([out[-1]], state)
    return out


def prefilled(eng: Engine, ids: list[int]):
    st = eng.new_state()
    (lg,), _ = eng.prefill([ids], [st])
    return st, lg


def test_restored_prefix_continues_like_a_full_prefill(eng):
    ref_state, ref_logits = prefilled(eng, A + B)
    ref = greedy(eng, ref_state, ref_logits.clone(), 12)

    pc = PromptCache(64 * MB)
    st, lg = prefilled(eng, A)
    assert pc.store(A, st, lg)
    st2 = eng.new_state()
    n, full = pc.resume(A + B, st2)
    assert (n, full, st2.pos) == (len(A), None, len(A))
    (lg2,), _ = eng.prefill([B], [st2])  # only the new tokens
    torch.testing.assert_close(lg2, ref_logits, rtol=1e-4, atol=1e-4)
    assert greedy(eng, st2, lg2, 12) == ref
    assert pc.counters.reused_tokens == len(A) and pc.counters.hits == 1


def test_whole_prompt_hit_needs_no_model_pass(eng):
    pc = PromptCache(64 * MB)
    st, lg = prefilled(eng, A)
    ref = greedy(eng, *prefilled(eng, A), 6)
    pc.store(A, st, lg)
    st2 = eng.new_state()
    n, full = pc.resume(A, st2)
    assert n == len(A) and full is not None
    assert greedy(eng, st2, full, 6) == ref


def test_cut_back_only_for_per_position_state(eng):
    """A stored A+C serves A+B by cutting back to A, unless the state is recurrent (Kimi K3's KDA)."""
    pc = PromptCache(64 * MB)
    C = [1, 2, 3]
    st, lg = prefilled(eng, A + C)
    pc.store(A + C, st, lg)
    st2 = eng.new_state()
    n, _ = pc.resume(A + B, st2)
    if eng.packed.family == "kimi_k3":
        assert n == 0 and st2.pos == 0 and not pc.cuttable_state(st)
        return
    assert n == len(A) and pc.cuttable_state(st)
    ref_state, ref_logits = prefilled(eng, A + B)
    (lg2,), _ = eng.prefill([B], [st2])
    assert greedy(eng, st2, lg2, 8) == greedy(eng, ref_state, ref_logits, 8)
    # a prompt that is a prefix of the entry still prefills its last token
    assert pc.resume(A, eng.new_state())[0] == len(A) - 1


def test_two_turns_through_the_batch_decoder(eng):
    """Turn 2 (turn 1's prompt + reply + a new turn) prefills only what turn 1 did not feed; greedy tokens
    equal a decoder without a cache."""

    def run(dec, prompt, n=6):
        (s,) = new_seqs([GenSpec(tuple(prompt), n)])
        dec.prefill([s])
        while not s.done:
            dec.sample([s])
            dec.advance([s])
        return s

    plain, cached = BatchDecoder(eng), BatchDecoder(eng, prompt_cache=PromptCache(64 * MB))
    t1 = run(cached, A)
    assert t1.emitted == run(plain, A).emitted and t1.cached == 0
    turn2 = A + t1.emitted + B
    t2 = run(cached, turn2)
    assert t2.emitted == run(plain, turn2).emitted
    assert t2.cached == len(A) + len(t1.emitted) - 1  # all but the reply's last token, never fed
    assert cached.counters.prompt_tokens == len(A) + len(B) + 1
    assert cached.counters.cached_tokens == t2.cached


def test_recurrent_state_is_kept_at_turn_boundaries(eng, monkeypatch):
    """A conversation whose last message changes resumes after the message before it: cuttable state by
    cutting back, recurrent state from the snapshot taken at that turn boundary."""
    EOS = 251
    monkeypatch.setattr(Engine, "eos_ids", property(lambda self: (EOS,)))
    dec, plain = BatchDecoder(eng, prompt_cache=PromptCache(64 * MB)), BatchDecoder(eng)
    (s1,) = new_seqs([GenSpec(tuple(A + [EOS] + B + [EOS] + [1, 2]), 2)])
    edited = A + [EOS] + [33, 34, 35]
    (s2,), (ref,) = new_seqs([GenSpec(tuple(edited), 4)]), new_seqs([GenSpec(tuple(edited), 4)])
    for s, d in ((s1, dec), (s2, dec), (ref, plain)):
        d.prefill([s])
        while not s.done:
            d.sample([s])
            d.advance([s])
    assert s2.cached == len(A) + 1
    assert s2.emitted == ref.emitted


def _fake_state(n: int, width: int = 1024):
    from deltafin.models.base import SequenceState
    from deltafin.models.layers import GrowingCache

    c = GrowingCache((width,), 64, "cpu", torch.float32)
    c.write(0, torch.randn(n, width))
    st = SequenceState([c])
    st.pos = n
    return st


def test_budget_and_lru_eviction():
    entry = 10 * 1024 * 4 + 16 * 4  # 10 rows of 1024 fp32 plus the logits
    pc = PromptCache(2 * entry)
    lg = torch.randn(16)
    for first in (1, 2, 3):
        assert pc.store([first] * 10, _fake_state(10), lg)
    assert len(pc) == 2 and pc.used == 2 * entry and pc.counters.evicted == 1
    assert pc.resume([1] * 10 + [5], _fake_state(0))[0] == 0  # the oldest went first
    assert pc.resume([2] * 10 + [5], _fake_state(0))[0] == 10  # touches [2]*10
    pc.store([4] * 10, _fake_state(10), lg)
    assert set(pc.entries) == {(2,) * 10, (4,) * 10}  # [3]*10 was least recently used
    assert not pc.store([9] * 30, _fake_state(30), lg)  # larger than the whole budget: not kept
    assert PromptCache(0).store([1], _fake_state(1), lg) is False


def test_an_extending_entry_replaces_the_one_it_extends():
    pc = PromptCache(10 * MB)
    lg = torch.randn(16)
    pc.store([1, 2, 3], _fake_state(3), lg)
    pc.store([1, 2, 3, 4, 5], _fake_state(5), lg)
    assert list(pc.entries) == [(1, 2, 3, 4, 5)]
    st = _fake_state(0)
    assert pc.resume([1, 2, 3, 7], st)[0] == 3 and st.layers[0].length == 3


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5], [1]) == 0
