"""Several sequences through the model together: sequence mixing per sequence, MoE on all their tokens.

The MoE part is token-wise, so the carries of all sequences are concatenated for it: each routed expert
is fetched once for every token of every sequence in the step (shared reads for batched prefill and for
decoding several requests together). Head only on each sequence's last token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltafin.models.base import ExpertSource, SequenceState


def cat(carries: list):
    if isinstance(carries[0], torch.Tensor):
        return torch.cat(carries)
    return type(carries[0]).cat(carries)


def split(carry, sizes: Sequence[int]) -> list:
    if isinstance(carry, torch.Tensor):
        return list(carry.split(list(sizes)))
    return carry.split(sizes)


def last(carry, n: int):
    """The carry of the last token of a sequence of n tokens."""
    return split(carry, [n - 1, 1])[1] if n > 1 else carry


# Decode steps of up to this many tokens (sequences) guess the next layer's experts; a prompt's layer asks for most
# experts anyway, read expert-major.
GUESS_TOKENS = 8


def forward_batch(model, seqs: Sequence[tuple[torch.Tensor, SequenceState]], experts: ExpertSource,
                  all_logits: bool = False, on_layer=None) -> list[torch.Tensor]:
    """Advance each (ids [T_j], state) by its tokens; returns logits per sequence ([1, V], or [T_j, V]).
    ``on_layer()`` is called after each layer (progress of long prefills). A model's ``known_routes(ids)``
    (layers whose experts follow from the token ids) go to a source's ``prefetch`` before the first layer runs. In
    decode steps, a source that ``guess``es gets each next layer's likely experts (``model.guess_experts``) before
    this layer's MLP, to read them while it runs."""
    sizes = [int(ids.shape[0]) for ids, _ in seqs]
    carries = [model.embed(ids) for ids, _ in seqs]
    prefetch = getattr(experts, "prefetch", None)  # None: the source reads only when a layer asks
    if hasattr(model, "known_routes") and prefetch is not None:  # experts fixed by the token ids
        for layer, eids in model.known_routes(torch.cat([ids for ids, _ in seqs])):
            prefetch(layer, eids)
    guess, wants = (getattr(experts, "guess", None), getattr(experts, "wants_guess", None))
    ahead = getattr(model, "guess_experts", None) if guess and wants and sum(sizes) <= GUESS_TOKENS else None
    for i in range(model.num_layers):
        carries = [model.attn_part(i, c, st) for c, (_, st) in zip(carries, seqs, strict=True)]
        merged = cat(carries) if len(carries) > 1 else carries[0]
        if ahead is not None and i + 1 < model.num_layers and wants(i + 1):
            guess(i + 1, ahead(i + 1, merged))  # the next layer's likely experts, read while this layer runs
        merged = model.mlp_part(i, merged, experts)
        carries = split(merged, sizes) if len(carries) > 1 else [merged]
        if on_layer is not None:
            on_layer()
    for (_, st), n in zip(seqs, sizes, strict=True):
        st.pos += n
    return [model.head(c if all_logits else last(c, n)) for c, n in zip(carries, sizes, strict=True)]
