"""How much of a prompt to prefill at once, planned from a memory budget before any work starts.

Rule: the whole prompt in one pass (each touched expert read once per layer) when its activations fit the
budget; otherwise the largest chunk that fits, halving from the prompt length. The sequence state
(KV / latent cache) for the whole context must fit too, or the prompt is refused with the sizes named.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltafin.errors import UsageError
from deltafin.store.memory import state_sizes

F32 = 4


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    tokens: int
    chunk: int
    state_bytes: int
    activation_bytes: int  # peak estimate for one chunk
    budget: int

    @property
    def chunks(self) -> int:
        return -(-self.tokens // self.chunk)


def _dims(tc: dict) -> dict:
    fixed, per_tok, _, _ = state_sizes(tc)
    k = tc.get("num_experts_per_tok") or tc.get("num_experts_per_token") or 1
    width = tc.get("routed_expert_hidden_size") or tc["hidden_size"]
    inter = tc.get("moe_intermediate_size") or tc.get("intermediate_size") or width
    return dict(heads=tc.get("num_attention_heads", 1), per_tok=per_tok * F32, fixed=fixed, k=k, width=width,
                inter=inter, hidden=tc["hidden_size"], dense_inter=tc.get("intermediate_size") or inter)


def activation_bytes(tc: dict, chunk: int, context: int) -> int:
    d = _dims(tc)
    attn = 3 * d["heads"] * chunk * context * F32  # scores, probabilities, a temporary
    moe = chunk * d["k"] * d["width"] * F32 * 2 + 3 * chunk * max(d["inter"], d["dense_inter"]) * F32
    trunk = 24 * chunk * d["hidden"] * F32  # residual stream, norms, projections, AttnRes snapshots
    return attn + moe + trunk


def plan_prefill(tc: dict, tokens: int, past: int, budget: int, sequences: int = 1) -> PrefillPlan:
    d = _dims(tc)
    state = int(sequences * (d["fixed"] + d["per_tok"] * (past + tokens)))
    if state > budget:
        raise UsageError(
            f"{sequences} x {past + tokens} tokens need {state / 1e9:.2f} GB of sequence state "
            f"(KV/latent cache and recurrent state), over the {budget / 1e9:.2f} GB prefill budget; "
            f"shorten the prompt or raise --prefill-gb"
        )
    chunk = tokens
    while chunk > 1 and state + sequences * activation_bytes(tc, chunk, past + chunk) > budget:
        chunk = (chunk + 1) // 2
    act = sequences * activation_bytes(tc, chunk, past + chunk)
    if state + act > budget:
        raise UsageError(
            f"even one token at a time needs {(state + act) / 1e9:.2f} GB (state {state / 1e9:.2f} GB + "
            f"activations {act / 1e9:.2f} GB), over the {budget / 1e9:.2f} GB prefill budget; raise --prefill-gb"
        )
    return PrefillPlan(tokens, chunk, state, act, budget)


def default_context(tc: dict, budget: int) -> tuple[int, str]:
    """(context limit in tokens, why): the model's max_position_embeddings, lowered (to a multiple of 1,024)
    when one sequence's state for that many tokens would not fit ``budget`` bytes."""
    from deltafin import fmt

    d = _dims(tc)
    limit = int(tc.get("max_position_embeddings") or 4096)
    fits = int((budget - d["fixed"]) // max(d["per_tok"], 1))
    if fits >= limit:
        return limit, "the model's max_position_embeddings"
    n = max(fits // 1024 * 1024, min(limit, 1024))
    return n, (f"what {fmt.size(budget)} for sequence state holds; the model allows {limit:,}: "
               f"free memory or a smaller --cache-gb raises it")
