"""The unrolled decode-2 MXFP4 expert kernels (kernels/triton_gemv.py, ``unrolled`` / ``unrolled_down``): against
the float64 reference at Kimi K3 widths and at widths that end inside a chunk or a row tile, beside the tile
kernels, and the same bits launch after launch. Inline PTX: GPU only."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from deltafin.kernels.triton_gemv import moe_gemv_config  # noqa: E402
from deltafin.kernels.triton_moe import ACT_SILU, ACT_SITU, ExpertSlab, grouped_glu  # noqa: E402
from tests.test_kernels_triton import _experts, _moe_ref, _rel  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("D,inter,act", [(3584, 3072, ACT_SITU), (1056, 160, ACT_SILU), (96, 544, ACT_SITU)])
def test_unrolled_gemv_matches_reference_and_repeats(D, inter, act):
    """(K 1056: the last chunk of 512 holds one block of 32; 96: K shorter than one chunk; down's K 160 and 544
    end inside a chunk too.)"""
    g = torch.Generator().manual_seed(D + inter)
    experts = _experts("mxfp4", 6, D, inter, g)
    slab = ExpertSlab.stack(experts, "cuda")
    tile = moe_gemv_config(unrolled=False, unrolled_down=False)
    cfgs = [moe_gemv_config(unrolled=True, unrolled_down=True), moe_gemv_config(unrolled=True, unrolled_down=False),
            moe_gemv_config(unrolled=True, unrolled_down=True, pf_rows=1, pf_rows_down=0, BK=512, num_warps=4,
                            BN_down=8, BK_down=256, num_warps_down=2)]
    assert cfgs[0]["decode"] == 2
    for T in (1, 3):
        ids = torch.stack([torch.randperm(6, generator=g)[:4] for _ in range(T)])
        wts = torch.rand(T, 4, generator=g)
        x = (torch.randn(T, D, generator=g) * 0.5).to("cuda", torch.bfloat16)
        ref = _moe_ref(x, ids, wts, experts, act)
        y_tile = grouped_glu(x, ids, wts, slab, act, cfg=tile)
        for cfg in cfgs:
            y = grouped_glu(x, ids, wts, slab, act, cfg=cfg)
            assert _rel(y, ref) < 1.5e-2
            assert _rel(y, y_tile) < 1e-2  # the same products, summed in another order
            assert torch.equal(grouped_glu(x, ids, wts, slab, act, cfg=cfg), y)  # no order left to chance
