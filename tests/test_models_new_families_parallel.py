"""Expert parallel and classify on the families added in 2026 (Kimi K2.5, GLM-4.5, MiniMax-M2, Qwen3-Next,
Qwen3.5, DeepSeek-V3.2, GLM-5, DeepSeek-V4): each tiny model (transformers' own config class, a byte
tokenizer, the default pack) run over two ranks (gloo, each owning half of the experts) gives one process's
tokens, logits and classify log-probabilities bit for bit, and classify's batched scores (prompts prefilled
together, each label's tokens on a copy of the state) equal the label's log-probability from one pass over
prompt + label, and from the label's tokens stepped one at a time. (The DSA models get 8 indexer heads here:
with the shared tiny models' 2, the ReLU'd scores of a token are all 0 for a quarter of the tokens, and
torch.topk, as in the reference, breaks a tie at the k-th score differently for a one-token query than for a
chunk, so chunkings pick different tokens.)"""

from __future__ import annotations

import pytest
import torch

from deltafin.runtime.engine import Engine
from tests.dist_worker import CLASSIFY_LABELS, CLASSIFY_TEXTS, launch, one_process
from tests.test_jobs import manual_logp
from tests.tiny import save_byte_tokenizer
from tests.tiny_families import DEFAULT, NEW_TINY, build, pack_to

FAMILIES = ["kimi_k25", "glm4_moe", "minimax_m2", "qwen3_next", "qwen3_5_moe", "deepseek_v32", "glm_moe_dsa",
            "deepseek_v4"]
PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]
# DeepSeek-V4 with a window of 4, CSA every 2 tokens (the indexer's top 2) and HCA every 4: the 8-token prompt and
# its 8 new tokens pass the window, the top k and several compressed entries of each kind
V4_SHORT = {"deepseek_v4": dict(sliding_window=4, index_topk=2, compress_rates={
    "compressed_sparse_attention": 2, "heavily_compressed_attention": 4})}
VOCAB = 320  # the byte tokenizer's


def one_pass_logp(eng: Engine, prompt: list[int], label: list[int]) -> float:
    """log p(label | prompt) from one pass over prompt + label[:-1] (all its logits)."""
    logits = eng.step([(torch.tensor(prompt + label[:-1]), eng.new_state())], all_logits=True)[0]
    lp = torch.log_softmax(logits[len(prompt) - 1 :].float(), -1)  # row t predicts label token t
    return float(lp.gather(1, torch.tensor(label)[:, None]).sum())


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("newdist")
    out = {}
    for fam in FAMILIES:
        tiny = NEW_TINY[fam]
        over = {"text_config": {**tiny["text_config"], "vocab_size": VOCAB}} if "text_config" in tiny else \
            {"vocab_size": VOCAB} | ({"index_n_heads": 8} if "index_topk" in tiny else {}) | V4_SHORT.get(fam, {})
        build(fam, root / fam / "src", **over)
        save_byte_tokenizer(root / fam / "src", VOCAB)
        out[fam] = pack_to(root / fam, DEFAULT)
    return out


@pytest.fixture(scope="module")
def reference(models) -> dict[str, dict]:
    def also(eng, ref: dict) -> None:  # classify's definitions, computed by the engine without batching
        labels = [eng.codec.encode(lab) for lab in CLASSIFY_LABELS]
        prompts = [eng.codec.prompt_ids(f"{t} ok? ") for t in CLASSIFY_TEXTS]
        ref["one_pass"] = [[one_pass_logp(eng, p, ids) for ids in labels] for p in prompts]
        ref["stepped"] = [[manual_logp(eng, p, ids) for ids in labels] for p in prompts]

    return one_process(models, PROMPT, 8, also)  # 8 tokens: what the worker runs


def test_classify_batched_equals_one_pass_and_one_token_steps(reference):
    for fam, ref in reference.items():
        assert len(ref["classify"]) == len(CLASSIFY_TEXTS), fam
        for key in ("one_pass", "stepped"):
            for got, want in zip(ref["classify"], ref[key], strict=True):
                assert got == pytest.approx(want, abs=2e-4), (fam, key)


def test_two_ranks_equal_one_process_on_every_new_family(models, reference, tmp_path):
    got = launch(2, list(models.values()), tmp_path / "out.json")
    assert got["error"] is None, got["error"]
    for fam, m in models.items():
        ref = {k: v for k, v in reference[fam].items() if k not in ("stepped", "one_pass")}
        assert got["results"][m] == ref, fam  # tokens, every logit and classify's log-probabilities, bit for bit
