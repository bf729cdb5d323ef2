"""The batched chunked KDA form against the token-by-token recurrence (the definition, §3.1 step 7).

Tolerances: in float64 both forms agree to rounding (1e-12 of the output scale). In float32 they round
differently: the chunked form exponentiates differences of in-chunk cumulative log-decays that reach
64 * 5 = 320 in magnitude, so each decay carries a relative error of about 320 * 2^-24 = 2e-5 at worst
(measured: ~1e-6 of the output scale); the bound 2e-5 of max(1, |reference|) leaves room for that.
"""

from __future__ import annotations

import math

import pytest
import torch

from deltafin import kernels
from deltafin.models import kda

F32_TOL = 2e-5
F64_TOL = 1e-12


def _inputs(T: int, H: int, K: int, V: int, seed: int, dtype=torch.float64, bound: float = -5.0, shift: float = 0.0,
            S_scale: float = 0.1):
    """Normalised q (scaled) and k, random v, lower-bound decays (shift > 0 pushes them to the bound)."""
    g0 = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    q = kda.l2norm(torch.randn(T, H, K, generator=g0, dtype=f64)) * K**-0.5
    k = kda.l2norm(torch.randn(T, H, K, generator=g0, dtype=f64))
    v = torch.randn(T, H, V, generator=g0, dtype=f64)
    a_log = (torch.rand(H, generator=g0, dtype=f64) * 15 + 1).log()
    g = kda.lower_bound_gate(2 * torch.randn(T, H, K, generator=g0, dtype=f64) + shift, a_log, bound)
    beta = torch.rand(T, H, generator=g0, dtype=f64)
    S = S_scale * torch.randn(H, K, V, generator=g0, dtype=f64)
    return [x.to(dtype) for x in (q, k, v, g, beta, S)]


def _close(got, want, tol: float) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        scale = max(1.0, b.abs().max().item())
        err = (a - b).abs().max().item() if a.numel() else 0.0
        assert err <= tol * scale, f"max error {err:.3g} over {tol * scale:.3g}"


SHAPES = [  # T, H, K, V: T = 1, T < chunk, a whole chunk, not a multiple of the chunk, several chunks
    (1, 1, 8, 8), (5, 2, 16, 8), (64, 3, 16, 16), (100, 2, 32, 24), (257, 4, 16, 32),
]


@pytest.mark.parametrize("T,H,K,V", SHAPES)
def test_chunked_matches_recurrent_float64(T, H, K, V):
    x = _inputs(T, H, K, V, seed=T)
    _close(kda.chunked(*x), kda.recurrent(*x), F64_TOL)


@pytest.mark.parametrize("T,H,K,V", SHAPES)
@pytest.mark.parametrize("shift", [0.0, 8.0])  # 8: decays at the gate's lower bound, the float32 range case
def test_chunked_matches_recurrent_float32(T, H, K, V, shift):
    x64 = _inputs(T, H, K, V, seed=T + 1, shift=shift)
    want = [t.float() for t in kda.recurrent(*x64)]
    x = [t.float() for t in x64]
    _close(kda.chunked(*x), want, F32_TOL)
    _close(kda.chunked(*x, gate_bound=-5.0), want, F32_TOL)
    _close(kda.chunked_reference(*x), want, F32_TOL)


@pytest.mark.parametrize("T,H,K,V", [(64, 3, 16, 16), (257, 4, 16, 32)])
def test_fast_cpu_path_raises_tiny_decays_to_the_exp_floor(T, H, K, V):
    """On the fast CPU path the chunked form's decays below e^-87 are taken as e^-87 (``kernels.exp_``: the CPU's exp
    is many times slower for results below the smallest normal float). Decays at the gate's bound (chunk sums to
    -320) hit the floor; the result keeps the float32 tolerance against the float64 recurrence, and the exact path
    computes exp unchanged."""
    x64 = _inputs(T, H, K, V, seed=T + 2, shift=8.0)
    want = [t.float() for t in kda.recurrent(*x64)]
    x = [t.float() for t in x64]
    with kernels.math(True, "cpu"):
        exact = kda.chunked(*x, gate_bound=-5.0)
    with kernels.fast():
        fast = kda.chunked(*x, gate_bound=-5.0)
        floored = kernels.exp_(torch.tensor([-300.0, -87.5, -87.0, -1.0], dtype=torch.float64))
    assert x[3][:64].cumsum(0).min() < -88  # the decays reach past the floor inside a chunk
    _close(fast, want, F32_TOL)
    _close(exact, want, F32_TOL)
    assert floored.tolist() == [math.exp(-87.0)] * 3 + [math.exp(-1.0)]
    assert kernels.exp_(torch.tensor([-300.0], dtype=torch.float64)).item() == math.exp(-300.0)  # not fast: exp


@pytest.mark.parametrize("bound,sub", [(-5.0, 16), (-20.0, 4), (-100.0, 1)])
def test_wide_gate_bounds_take_smaller_sub_blocks(bound, sub):
    """A wider gate range shrinks the sub-block so no factored decay leaves float32; results stay exact."""
    assert kda.sub_block(64, bound) == sub
    x64 = _inputs(150, 2, 16, 16, seed=3, bound=bound, shift=4.0)
    want = kda.recurrent(*x64)
    _close(kda.chunked(*x64), want, F64_TOL)
    got = kda.chunked(*(t.float() for t in x64), gate_bound=bound)
    assert all(torch.isfinite(t).all() for t in got)
    _close(got, [t.float() for t in want], F32_TOL)


def test_sub_block_divides_the_chunk():
    assert kda.sub_block(48, -5.0) == 16 and kda.sub_block(40, -5.0) == 10 and kda.sub_block(37, -5.0) == 1
    assert kda.sub_block(64, 0.0) == 16


def test_other_chunk_lengths():
    x = _inputs(90, 2, 16, 8, seed=4)
    want = kda.recurrent(*x)
    for chunk in (16, 32, 40, 128):
        _close(kda.chunked(*x, chunk=chunk), want, F64_TOL)


def test_split_prompt_continues_from_the_state():
    """Chunked on the first part, then recurrent (decode) or chunked again on the rest, equals one pass."""
    q, k, v, g, beta, S = _inputs(170, 3, 16, 16, seed=5, dtype=torch.float32)
    o_all, S_all = kda.recurrent(q, k, v, g, beta, S)
    for cut in (1, 63, 100):
        a, b = slice(0, cut), slice(cut, None)
        o1, S1 = kda.chunked(q[a], k[a], v[a], g[a], beta[a], S)
        for second in (kda.recurrent, kda.chunked):
            o2, S2 = second(q[b], k[b], v[b], g[b], beta[b], S1)
            _close((torch.cat([o1, o2]), S2), (o_all, S_all), F32_TOL)


def test_repeated_token_keeps_the_wy_solve_exact():
    """One key repeated with beta ~ 1 and no decay: I + L is the all-ones lower triangle, whose inverse has
    entries of mixed sign; the blocked inverse must not lose them (powers of L would reach C(63, 31))."""
    T, H, K = 130, 2, 16
    q, k, v, g, beta, S = _inputs(T, H, K, K, seed=6, dtype=torch.float32)
    k = k[:1].expand(T, H, K).contiguous()
    g = torch.full_like(g, -1e-4)
    beta = torch.full_like(beta, 0.999)
    want = [t.float() for t in kda.recurrent(*(t.double() for t in (q, k, v, g, beta, S)))]
    _close(kda.chunked(q, k, v, g, beta, S), want, F32_TOL)


def test_unit_lower_inverse():
    g0 = torch.Generator().manual_seed(7)
    L = torch.randn(3, 2, 64, 64, generator=g0, dtype=torch.float64).tril(-1) * 0.3
    eye = torch.eye(64, dtype=torch.float64)
    X = kda.unit_lower_inverse(L, 16)
    assert (X @ (eye + L) - eye).abs().max() < 1e-10
    assert (kda.unit_lower_inverse(L, 8) - X).abs().max() < 1e-10


def test_empty_and_state_untouched():
    q, k, v, g, beta, S = _inputs(9, 2, 8, 8, seed=8, dtype=torch.float32)
    S0 = S.clone()
    o, S_out = kda.chunked(q[:0], k[:0], v[:0], g[:0], beta[:0], S)
    assert o.shape == (0, 2, 8) and torch.equal(S_out, S0)
    kda.chunked(q, k, v, g, beta, S)
    assert torch.equal(S, S0)  # the caller's state is not written in place
