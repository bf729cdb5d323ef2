"""config.json and the tokenizer checked at the door (``pack --plan`` and ``pack``): every setting the model
reads has the right type and range, the router picks no more experts than there are, and the embedding,
the experts and the tokenizer agree with the config. A bad value is one line naming it, before any write."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

from deltafin.errors import CheckpointError, DeltafinError

# settings that count something: zero would make an empty model
POSITIVE = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "moe_intermediate_size", "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
            "num_experts_per_token", "kda_num_heads", "kda_head_dim", "routed_expert_hidden_size")
TOP_K = (("num_experts_per_tok", ("n_routed_experts", "num_experts", "num_local_experts")),
         ("num_experts_per_token", ("num_experts",)))
_INT = ("int", "int | None")
_FLOAT = ("float", "float | None")


def check_config(family: str, tc: dict, where: str):
    """The model's config object built from the text config, or a CheckpointError naming the setting."""
    from deltafin.models.registry import module_for

    if not isinstance(tc, dict):
        raise CheckpointError(f"{where}: text_config is a JSON {type(tc).__name__}, not an object; re-download "
                              f"config.json")
    cls = module_for(family).Config
    check = FAMILY_CHECKS.get(family)
    if check is not None:
        check(tc, where)
    kinds = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    for key, val in tc.items():
        _check_value(where, key, val, kinds.get(key))
    try:
        cfg = cls.from_dict(tc)
    except DeltafinError as e:
        raise CheckpointError(f"{where}: {e}") from e
    except KeyError as e:
        raise CheckpointError(f"{where}: lacks {e.args[0]!r}, which a {family} model needs; re-download "
                              f"config.json") from e
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise CheckpointError(f"{where}: settings the {family} model cannot use ({e}); re-download config.json") from e
    for f in dataclasses.fields(cfg):
        _check_value(where, f.name, getattr(cfg, f.name), str(f.type))
    for k, totals in TOP_K:
        top = getattr(cfg, k, None)
        total = next((getattr(cfg, t) for t in totals if isinstance(getattr(cfg, t, None), int)), None)
        if isinstance(top, int) and total is not None and top > total:
            raise CheckpointError(f"{where}: {k} = {top} is more than the {total} experts per layer; the router "
                                  f"cannot pick them: fix config.json")
    return cfg


def _check_value(where: str, key: str, val, kind: str | None) -> None:
    if val is None or kind is None:
        return
    if kind in _INT:
        if isinstance(val, bool) or not isinstance(val, int) or val < 0 or (key in POSITIVE and val == 0):
            need = "a positive integer" if key in POSITIVE else "a non-negative integer"
            raise CheckpointError(f"{where}: {key} = {json.dumps(val)[:60]} must be {need}; fix config.json")
    elif kind in _FLOAT:
        if isinstance(val, bool) or not isinstance(val, int | float) or not math.isfinite(val):
            raise CheckpointError(f"{where}: {key} = {json.dumps(val)[:60]} must be a finite number; fix config.json")
    elif kind == "tuple[int, ...]" and isinstance(val, list | tuple):
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in val):
            raise CheckpointError(f"{where}: {key} must list non-negative integers; fix config.json")


def check_embedding(shape_of, embed_name: str | None, cfg, where: str) -> None:
    """The embedding is [vocab_size, hidden_size]: a config that disagrees with the weights is refused."""
    if embed_name is None:
        return
    dtype, shape = shape_of(embed_name, "")
    want = (getattr(cfg, "vocab_size", None), getattr(cfg, "hidden_size", None))
    if None not in want and tuple(shape) != want:
        raise CheckpointError(f"{embed_name}: shape {list(shape)}, but {where} says vocab_size x hidden_size = "
                              f"{want[0]} x {want[1]}; the config does not belong to these weights")


def check_tokenizer(folder: str, vocab_size: int | None) -> None:
    """tokenizer.json, when shipped, is a tokenizer (JSON object with a model) whose ids fit the vocabulary;
    so are a tiktoken rank file (Kimi) and the added tokens of tokenizer_config.json beside it."""
    if os.path.isfile(os.path.join(folder, "tiktoken.model")):
        _check_tiktoken(folder, vocab_size)
    p = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(p):
        return
    try:
        with open(p, "rb") as f:
            doc = json.loads(f.read())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{p}: not a valid tokenizer ({str(e)[:120]}); re-download it") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
        raise CheckpointError(f"{p}: not a tokenizer (no 'model' object); re-download it")
    ids = []
    vocab = doc["model"].get("vocab")
    if isinstance(vocab, dict):
        ids += [v for v in vocab.values() if isinstance(v, int)]
    elif isinstance(vocab, list):  # unigram: [[piece, score], ...]
        ids.append(len(vocab) - 1)
    added = doc.get("added_tokens") or []
    ids += [t.get("id") for t in added if isinstance(t, dict) and isinstance(t.get("id"), int)]
    if vocab_size is not None and ids and max(ids) >= vocab_size:
        raise CheckpointError(f"{p}: token id {max(ids)} does not fit the model's vocab_size {vocab_size}; the "
                              f"tokenizer belongs to another model")


def _check_tiktoken(folder: str, vocab_size: int | None) -> None:
    from pathlib import Path

    from deltafin.tokenizers.kimi_k3 import RANKS_FILE, load_ranks, read_added_tokens

    ranks = load_ranks(Path(folder) / RANKS_FILE)  # a malformed file is one line naming it
    added = read_added_tokens(Path(folder)) or {}
    top = max([len(ranks) - 1, *added])
    if vocab_size is not None and top >= vocab_size:
        what = "tokenizer_config.json's added tokens" if added and max(added) == top else RANKS_FILE
        raise CheckpointError(f"{os.path.join(folder, RANKS_FILE)}: token id {top} ({what}) does not fit the "
                              f"model's vocab_size {vocab_size}; the tokenizer belongs to another model")


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_layers(tc: dict, names, has_experts: bool, where: str) -> None:
    """The config's layer count and router width against the weights: a missing ``num_experts_per_tok`` would
    run with a default, a wrong ``num_hidden_layers`` would skip or miss layers; both refused at pack."""
    from deltafin.store.load_checks import TOP_K_KEYS

    if has_experts and not any(isinstance(tc.get(k), int) for k in TOP_K_KEYS):
        raise CheckpointError(f"{where}: lacks num_experts_per_tok (how many experts the router picks per token); "
                              f"the model would run with a guess: add it to config.json")
    n = tc.get("num_hidden_layers")
    if not isinstance(n, int):
        raise CheckpointError(f"{where}: lacks num_hidden_layers; add it to config.json")
    found = {int(m.group(1)) for name in names for m in [_LAYER.search(name)] if m}
    if not found:
        return
    extra = tc.get("num_nextn_predict_layers") or 0
    missing = sorted(set(range(n)) - found)
    if missing:
        raise CheckpointError(f"{where}: num_hidden_layers = {n}, but the weights have no layer {missing[0]} (they hold "
                              f"layers {min(found)}-{max(found)}); fix config.json")
    if max(found) >= n + extra:
        raise CheckpointError(f"{where}: num_hidden_layers = {n}, but the weights hold layer {max(found)} "
                              f"({max(found) + 1 - extra} layers); fix config.json")


# ------------------------------------------------------------------------------------------ per family
# Settings a family's code does not implement are refused, never read as the default: a checkpoint whose
# model_type was set by hand to a near family would otherwise decode wrong without a word.


def _refuse(where: str, key: str, val, allowed: tuple, why: str) -> None:
    raise CheckpointError(f"{where}: {key} = {json.dumps(val)[:60]}, but this code implements only "
                          f"{' or '.join(json.dumps(a) for a in allowed)}; {why}")


def _only(tc: dict, where: str, key: str, allowed: tuple, why: str) -> None:
    """``key`` absent, null, or one of ``allowed``."""
    val = tc.get(key)
    if val is not None and val not in allowed:
        _refuse(where, key, val, allowed, why)


def _no_indexer(tc: dict, where: str, family: str) -> None:
    keys = [k for k in ("index_topk", "index_n_heads", "index_head_dim") if tc.get(k) is not None]
    if keys:
        raise CheckpointError(f"{where}: {', '.join(keys)} set: a DSA lightning indexer (DeepSeek-V3.2, GLM-5), which "
                              f"the {family} code does not implement; set model_type to the checkpoint's own")


def _check_noaux_router(family: str, indexer: bool = False):
    """DeepSeek-V3's router (deepseek_v3, kimi_k25, glm4_moe, deepseek_v32): sigmoid scores, top-k by the
    correction bias; an indexer only where the family has one. A DeepSeek-V2-style router (softmax, greedy top-k)
    is another model."""
    def check(tc: dict, where: str) -> None:
        why = "a softmax or greedy top-k router is another model's (DeepSeek-V2): set model_type to the checkpoint's own"
        _only(tc, where, "scoring_func", ("sigmoid",), why)
        _only(tc, where, "topk_method", ("noaux_tc",), why)
        _only(tc, where, "norm_topk_prob", (True, False), "it must be true or false")
        if indexer:
            _check_indexer(tc, where)
        else:
            _no_indexer(tc, where, family)
    return check


def _check_indexer(tc: dict, where: str) -> None:
    """DSA settings this code implements: the bf16-equivalent indexer (no FP8 scoring, no Hadamard rotation,
    which leave the dot products as they are), every query choosing its own top k."""
    missing = [k for k in ("index_topk", "index_n_heads", "index_head_dim") if tc.get(k) is None]
    if missing:
        raise CheckpointError(f"{where}: lacks {', '.join(missing)}, which the DSA indexer needs; re-download "
                              f"config.json")
    kinds = tc.get("layer_types")
    dsa = {"indexed_attention", "deepseek_sparse_attention"}  # the DSA layer as transformers releases name it
    if isinstance(kinds, list) and set(kinds) - dsa:
        raise CheckpointError(f"{where}: layer_types names {sorted(set(kinds) - dsa)}; this code "
                              f"implements DSA layers (indexed_attention) only")



def _check_minimax_m2(tc: dict, where: str) -> None:
    _only(tc, where, "scoring_func", ("sigmoid",), "MiniMax-M2 routes with sigmoid scores")
    _only(tc, where, "use_routing_bias", (True,), "MiniMax-M2's router always adds its correction bias")
    _only(tc, where, "use_qk_norm", (True,), "MiniMax-M2 always norms q and k")
    _only(tc, where, "qk_norm_type", ("per_layer",), "q and k are normed over all heads at once")
    kinds = tc.get("attn_type_list")
    if isinstance(kinds, list) and any(k != 1 for k in kinds):
        raise CheckpointError(f"{where}: attn_type_list holds layers of linear (lightning) attention (0), which the "
                              f"minimax_m2 code does not implement (MiniMax-M1 / Text-01 are other models)")


def _check_mixtral(tc: dict, where: str) -> None:
    why = "a sigmoid router with a bias or QK-norm is MiniMax-M2 (model_type minimax_m2), not Mixtral"
    _only(tc, where, "scoring_func", ("softmax",), why)
    _only(tc, where, "use_routing_bias", (False,), why)
    _only(tc, where, "use_qk_norm", (False,), why)
    for key in ("rotary_dim", "partial_rotary_factor"):
        val = tc.get(key)
        full = tc.get("head_dim") or tc.get("hidden_size", 0) // max(1, tc.get("num_attention_heads") or 1)
        if val is not None and val not in ((full,) if key == "rotary_dim" else (1, 1.0)):
            raise CheckpointError(f"{where}: {key} = {val}: partial RoPE, which the Mixtral code does not implement; "
                                  f"{why}")


def _check_qwen3_next(tc: dict, where: str) -> None:
    _only(tc, where, "attn_output_gate", (True,), "Qwen3-Next and Qwen3.5 gate every full-attention output")
    _only(tc, where, "hidden_act", ("silu",), "the short conv and the MLPs use SiLU")


FAMILY_CHECKS = {
    "deepseek_v3": _check_noaux_router("deepseek_v3"),
    "deepseek_v32": _check_noaux_router("deepseek_v32", indexer=True),
    "kimi_k25": _check_noaux_router("kimi_k25"),
    "glm4_moe": _check_noaux_router("glm4_moe"),
    "minimax_m2": _check_minimax_m2,
    "mixtral": _check_mixtral,
    "qwen3_next": _check_qwen3_next,
    "qwen3_5_moe": _check_qwen3_next,
}
