"""``--shape`` of the synthetic benchmarks (deltafin/bench/shapes.py): a family's routed-expert size and top-k
written into the synthetic files, routed and streamed, with the shape's activation; bad names and sizes are one
line before anything is written."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from deltafin import kernels
from deltafin.bench import shapes
from deltafin.bench.synthetic import k3_expert_layout, random_expert
from deltafin.cli import main
from deltafin.errors import UsageError
from deltafin.models.base import dense


def test_presets_and_overrides():
    q = shapes.resolve("qwen3.5-397b")
    assert (q.hidden, q.inter, q.experts, q.k, q.act) == (4096, 1024, 512, 10, ("silu",))
    assert k3_expert_layout(q.hidden, q.inter).file_bytes == 6_688_768  # 3 MXFP4 matrices of 1024 x 4096
    k3 = shapes.resolve("k3")
    assert (k3.hidden, k3.inter, k3.k, k3.act[0]) == (3584, 3072, 16, "situ")
    o = shapes.resolve("qwen3.5-397b", hidden=512, k=4)
    assert (o.hidden, o.inter, o.k) == (512, 1024, 4) and "with overrides" in shapes.describe(o, 8)
    with pytest.raises(UsageError, match=r"--shape qwen9: no such expert shape; use one of k3, qwen3.5-397b"):
        shapes.resolve("qwen9")
    with pytest.raises(UsageError, match="multiples of 32"):
        shapes.resolve("k3", hidden=100)
    with pytest.raises(UsageError, match="k <= experts"):
        shapes.resolve("minimax-m2", k=300)


def test_transformers_defaults_match_the_presets_that_name_them():
    transformers = pytest.importorskip("transformers")
    m = "moe_intermediate_size"
    for name, cls, inter, experts in (("qwen3.5-35b", "Qwen3_5MoeTextConfig", m, "num_experts"),
                                      ("qwen3-next-80b", "Qwen3NextConfig", m, "num_experts"),
                                      ("glm4.5-air", "Glm4MoeConfig", m, "n_routed_experts"),
                                      ("minimax-m2", "MiniMaxM2Config", "intermediate_size", "num_local_experts"),
                                      ("deepseek-v3", "DeepseekV3Config", m, "n_routed_experts")):
        c, s = getattr(transformers, cls)(), shapes.SHAPES[name]
        assert (s.hidden, s.inter, s.experts, s.k) == (c.hidden_size, getattr(c, inter), getattr(c, experts),
                                                        c.num_experts_per_tok), name


def test_bench_decode_streams_the_shape_with_its_top_k(tmp_path, capsys):
    out = tmp_path / "decode.json"
    main(["bench", "decode", "--shape", "qwen3.5-35b", "--layers", "1", "--experts", "12", "--tokens", "2",
          "--threads", "2", "--io-only", "--dir", str(tmp_path), "--json", str(out)])
    line = capsys.readouterr().out
    rec = json.loads(out.read_text())
    nbytes = k3_expert_layout(2048, 512).file_bytes
    assert rec["k"] == 8 and rec["shape"] == "qwen3.5-35b" and rec["expert_file_bytes"] == nbytes
    assert rec["bytes_read"] == 2 * 1 * 8 * nbytes  # tokens x layers x top-k, cold cache
    assert "expert shape qwen3.5-35b" in line and "top-8 of 256; 12 expert files per layer written" in line
    assert f"{40 * 8 * nbytes / 1e9:.2f} GB of routed experts per token (40 MoE layers x top-8)" in line


def test_bench_decode_full_mode_with_overrides_runs_the_shapes_activation(tmp_path, capsys):
    out = tmp_path / "decode.json"
    main(["bench", "decode", "--shape", "qwen3.5-397b", "--hidden", "256", "--inter", "128", "--layers", "1",
          "--tokens", "1", "--threads", "2", "--dir", str(tmp_path), "--json", str(out)])
    rec = json.loads(out.read_text())
    assert (rec["hidden"], rec["inter"], rec["k"], rec["experts"]) == (256, 128, 10, 64)  # 64: the files cap
    assert rec["mode"] == "full" and rec["math_s"] > 0 and "with overrides" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["qwen3.5-397b", "k3"])
def test_shape_expert_is_its_gated_activation(name):
    """The expert the bench runs equals down(act(gate x, up x)) on the dequantized weights (SwiGLU or SiTU-GLU)."""
    from types import SimpleNamespace

    from deltafin.bench.decode import shape_expert

    shape = shapes.resolve(name, hidden=256, inter=128)
    t = random_expert(np.random.default_rng(0), 256, 128)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    g, u = (x @ dense(t[n], torch.float32).T for n in ("gate", "up"))
    a = torch.nn.functional.silu(g) * u if name != "k3" else \
        4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    want = a @ dense(t["down"], torch.float32).T
    for exact in (True, False):
        with kernels.math(exact, "cpu"):
            got = shape_expert(SimpleNamespace(expert_shape=shape))(x, t)
        assert torch.allclose(got, want, rtol=0, atol=2e-2 * want.abs().max().item()), exact
