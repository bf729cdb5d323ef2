"""``store.memory.state_sizes`` against what each family's model code allocates per sequence: the recurrent
state (Kimi K3's KDA, Qwen3-Next / Qwen3.5's Gated DeltaNet) that does not grow, and the cache values per token
(K and V, or MLA's latent and rope key plus DSA's indexer key). Configs are transformers' own defaults (the
flagship shapes), so a linear-attention layer counted as KV, or a cache left out, changes the figures."""

from __future__ import annotations

import types

import pytest
import torch

from deltafin.models import kda, layers, registry
from deltafin.store.memory import sequence_memory, state_sizes

CASES = {  # family -> transformers config class (the text config where the model is multimodal)
    "qwen3_next": "Qwen3NextConfig",
    "qwen3_5_moe": "Qwen3_5MoeTextConfig",
    "deepseek_v32": "DeepseekV32Config",
    "glm_moe_dsa": "GlmMoeDsaConfig",
    "deepseek_v3": "DeepseekV3Config",
    "glm4_moe": "Glm4MoeConfig",
    "kimi_k3": None,  # deltafin.k3_tiny's config (transformers has no class for it)
}


def _allocated(family: str, tc: dict) -> tuple[int, int, int]:
    """(fixed bytes, cache values per token, recurrent layers) of the states the model code makes for one
    sequence (float32), read off the tensors themselves."""
    mod = registry.module_for("deepseek_v32" if family == "glm_moe_dsa" else family)
    cfg = mod.Config.from_dict(tc)
    stub = types.SimpleNamespace(cfg=cfg, device="cpu", dtype=torch.float32)
    fixed = per_tok = rec = 0
    for i in range(cfg.num_hidden_layers):
        st = mod.Model.new_layer_state(stub, i, 1)  # a capacity of one position: a cache's bytes are one token's
        if isinstance(st, kda.KDAState):
            fixed += st.conv.nbytes + st.S.nbytes
            rec += 1
            continue
        bufs = [st.keys, st.values] if isinstance(st, layers.KVCache) else [st]
        per_tok += sum(b.buf.nbytes for b in bufs) // 4
    return fixed, per_tok, rec


@pytest.mark.parametrize("family", CASES)
def test_state_sizes_equal_what_the_model_allocates(family):
    if CASES[family] is None:
        from deltafin.k3_tiny import tiny_config

        tc = tiny_config()["text_config"]
    else:
        tc = getattr(pytest.importorskip("transformers"), CASES[family])().to_dict()
    fixed, per_tok, attn, rec = state_sizes(tc)
    assert (fixed, per_tok, rec) == _allocated(family, tc)
    assert attn + rec == tc["num_hidden_layers"]
    if family == "kimi_k3":
        assert rec == len(tc["linear_attn_config"]["kda_layers"]) and fixed > 0
    if family in ("qwen3_next", "qwen3_5_moe"):  # 3 of every 4 layers are Gated DeltaNet: fixed state, no KV
        assert rec == tc["num_hidden_layers"] * 3 // 4 and fixed > 0
    if family in ("deepseek_v32", "glm_moe_dsa"):  # the indexer's key beside the latent in every layer
        assert per_tok == (tc["kv_lora_rank"] + tc["qk_rope_head_dim"] + tc["index_head_dim"]) * attn
        assert "DSA indexer keys" in sequence_memory(tc)["cache_kind"]

