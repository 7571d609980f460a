"""The executor's device memory, term by term: one model that the stage model (`stages.evaluate_plan`), the MILP
(`formulation.build_milp`), MegaTrain's model (`baselines.evaluate_megatrain`) and the simulator (`simulate`) charge.

Every term is what the executor really allocates, measured with the CPU allocator's own records (a counting
allocator over the profiler's allocation events, `tests/helpers/memtrace.py`) on tiny qwen2 / qwen3 / qwen3_moe /
qwen3_5 (gated delta rule and gated attention) layers, sdpa and eager attention, fp32 and bf16, at two batch sizes;
`tests/test_memory_model.py` holds each term against the allocator and the whole model's predicted peak against the
executor's measured peak over the plan space. Symbols as in `costmodel`: N = B x T tokens, d hidden size, db the
compute dtype's bytes, I the MLP (or routed experts' k x Ie) intermediate width, E experts, V vocabulary, C loss-chunk
tokens, x = N d db one hidden state.

Per decoder layer (`LayerCost` fields):

- ``saved_bytes`` A: what autograd saves (the layer input included), exact (`costmodel.layer_saved_bytes`);
- ``ws_fwd_bytes``: the peak of a forward that saves A, beyond A: the output and the fp32 upcasts of the residual
  norms (`forward_working_set`);
- ``ws_nosave_bytes``: the peak of a forward that saves nothing but its input (a recomputed layer's first forward;
  with inline copies also an offloaded layer's, whose saved tensors are copied out as they are saved), beyond the input:
  the MLP's gate, up and activation outputs at once, or the attention core's transients (`nosave_working_set`);
- ``ws_bwd_bytes``: with the weight gradients g, the backward holds ``ws_bwd + g`` beyond its saved tensors: the
  incoming hidden-state gradient and the peak of the backward itself (`backward_working_set`).

Per step (`stages.evaluate_plan`): the head stage holds the final norm's graph and the chunked loss (`head_working_set`);
the gradient of a parameter that is not streamed (lm_head, embedding) is held from the stage that makes it until the
optimizer step, and the global norm at the end of backward copies them to fp32 a piece at a time (`resident_norm_bytes`);
the slot pool of each layer kind is allocated for the whole step (`slot_pools`, the executor's
sizing rule in `streaming/binder.py`); a layer's gradients leave the device after its backward stage (CUDA: one stage
later, their D2H copy in flight); where the executor copies inline (`copies_inline`: the CPU device on the synchronous
engine) an offloaded tensor is copied as it is saved, so an offloaded layer never holds its saved bytes on the device
during its forward, and gradients leave at once. The simulated asynchronous engine on the CPU device runs CUDA's copy
paths and holds what CUDA holds. With ``stream_embeddings`` the embedding and head are units in transient slots
instead of resident, their gradients leave as a layer's (`streamed_head_terms`).

Pure arithmetic; imports nothing of the package (and not torch).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

FP32 = 4
SLOT_ALIGN = 256  # a slot's size is rounded up to this (`layouts.ALIGN_BYTES`, which imports torch)
NORM_CHUNK = 1 << 24  # elements of a squared norm's fp32 piece (`streaming.gradients.NORM_CHUNK`)


# ------------------------------------------------------------------------------------------------ per layer
def layer_working_sets(
    config: Any, kind: str, N: int, db: int, params: int, gdb: int, attention_probs: int, gated: bool, saved: int
) -> tuple[int, int, int]:
    """``(ws_fwd, ws_bwd, ws_nosave)`` of one decoder layer of ``kind`` (``params`` parameters, gradients of
    ``gdb`` bytes, ``saved`` bytes saved for backward) for N tokens (bytes): `forward_working_set`,
    `backward_working_set` (or, where more, `norm_working_set` once the layer's gradients are complete) and
    `nosave_working_set` from the config's widths; ``attention_probs`` the eager attention's fp32 probabilities (0
    with sdpa), ``gated``: gated attention."""
    d = int(config.hidden_size)
    E = int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0))
    moe = "+moe" in kind
    inner = (
        int(config.moe_intermediate_size) * int(config.num_experts_per_tok) if moe else int(config.intermediate_size)
    )
    value_width = int(getattr(config, "linear_num_value_heads", 0) or 0) * int(
        getattr(config, "linear_value_head_dim", 0) or 0
    )
    ws_bwd = backward_working_set(
        N, d, inner, db, params * gdb, first_grad_params(config, kind) * gdb,
        N * int(config.num_experts_per_tok) if moe else 0,
    )  # fmt: skip
    # once the gradients are complete the saved tensors are freed: the input's gradient and the norm's fp32 copy
    ws_bwd = max(ws_bwd, N * d * db + norm_working_set(largest_grad_params(config, kind, gated), gdb) - saved)
    return (
        forward_working_set(N, d, db, kind, gated, E if moe else 0),
        ws_bwd,
        nosave_working_set(N, d, inner, db, kind, E if moe else 0, attention_probs, value_width),
    )


def norm_working_set(numel: int, gdb: int) -> int:
    """The squared norm of a layer's gradients taken on the device as the layer completes (Note: [Squared norms of
    accumulated gradients] in streaming/gradients.py): ``vector_norm(g, dtype=float32)`` of a gradient below fp32
    makes an fp32 copy of it, at most `NORM_CHUNK` elements at a time (`gradients.squared_norm`), one tensor at a
    time (bytes; ``numel`` the layer's largest gradient). The layer's gradients, the input's gradient and this copy
    are the backward's last peak: above its other one where the gradients are large beside the saved tensors (an MoE
    block's fused experts at batch 1)."""
    return 0 if gdb >= FP32 else min(numel, NORM_CHUNK) * FP32


def largest_grad_params(config: Any, kind: str, gated: bool) -> int:
    """Elements of a decoder layer's largest parameter: an MLP projection (``d x I``), an MoE block's fused
    gate/up experts (``E x 2 Ie x d``), or the query projection (``d x H hd``, twice that with gated attention)."""
    d = int(config.hidden_size)
    if "+moe" in kind:
        E = int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0))
        mlp = 2 * E * int(config.moe_intermediate_size) * d
    else:
        mlp = d * int(config.intermediate_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", 0) or d // heads)
    return max(mlp, d * heads * head_dim * (2 if gated else 1))


def forward_working_set(N: int, d: int, db: int, kind: str, gated: bool, experts: int) -> int:
    """Peak of a forward that saves its tensors, beyond them (bytes): the output and the residual norms' fp32 upcasts,
    ``2 N d`` fp32 for every kind in bf16. In fp32 the upcasts are no-ops and other intermediates take their place:
    gated attention ``3 N d``, the gated delta rule ``6 N d`` fp32. An MoE block adds ``2 N d`` fp32 (routed hidden
    states gathered and scattered back) and its router logits and weights (``2 N E`` fp32)."""
    c = 2
    if db == FP32 and kind.startswith("linear_attention"):
        c = 6
    elif db == FP32 and gated:
        c = 3
    out = c * N * d * FP32
    if "+moe" in kind:
        out += 2 * N * d * FP32 + 2 * N * experts * FP32
    return out


def nosave_working_set(
    N: int, d: int, inner: int, db: int, kind: str, experts: int, attention_probs: int, value_width: int
) -> int:
    """Peak of a forward that saves nothing but its input, beyond the input (bytes): the larger of its phases plus the
    output and the residual sum (``2 x``). MLP: gate, up and the activation alive at once (``3 N I db``); MoE block:
    ``8 x`` (tokens gathered per expert, their outputs and the scatter target) and the router's ``2 N E`` fp32;
    eager attention: its fp32 probabilities; gated delta rule: ``14 N Dv`` fp32 + ``4 N Dv db`` (Dv the value width;
    the chunked delta rule's fp32 state, decays and per-chunk products)."""
    x = N * d * db
    mlp = 8 * x + 2 * N * experts * FP32 if "+moe" in kind else 3 * N * inner * db
    attn = attention_probs
    if kind.startswith("linear_attention"):
        attn = 14 * N * value_width * FP32 + 4 * N * value_width * db
    return max(mlp, attn) + 2 * x


def backward_working_set(
    N: int, d: int, inner: int, db: int, grad_bytes: int, first_grad_bytes: int, routed: int
) -> int:
    """What a layer's backward holds beyond its saved tensors and its weight gradients ``g`` (bytes; negative when
    saved tensors are freed before the last gradients appear): the incoming hidden-state gradient ``x``, and the
    peak of the backward itself beyond ``A + x``: ``min(g, g_first + 2 N I db - 3 R d db)``, the first weight gradient
    of the MLP (its down projection; an MoE block's fused expert gradients, one tensor for every expert) with the two
    intermediate-sized activation gradients of the gated product, less what an MoE block frees before its fused
    gradients are complete (the R = N k routed tokens' gathered hidden states, gate/up and expert outputs), or, once
    those are freed, every gradient of the layer (the saved tensors they replace were freed first); at least the
    gated product's activation gradients themselves, ``2 N I db`` (an MoE block's fused gate/up: ``4 N k Ie db``),
    which the saved gate/up outputs are still beside and which exceed ``g`` from a few thousand tokens on (Qwen2.5-7B
    at batch 134 x 1024: 10.4 GB against g = 0.93 GB). Measured 0.5-1.0 g beyond ``A + x`` on every kind at batch 1
    and 4, ``2 N I db`` (dense) and ``4 N k Ie db`` (MoE) at 8 and 16 (`tests/test_memory_model.py`)."""
    first = max(0, first_grad_bytes + 2 * N * inner * db - 3 * routed * d * db)
    act_grads = (4 if routed else 2) * N * inner * db
    return N * d * db + max(min(grad_bytes, first), act_grads) - grad_bytes


def first_grad_params(config: Any, kind: str) -> int:
    """Parameters whose gradient a layer's backward makes first: the MLP's down projection (``d x I``), or an MoE
    block's fused experts (``3 x E x d x Ie``, one gradient tensor for all experts)."""
    d = int(config.hidden_size)
    if "+moe" in kind:
        E = int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0))
        return 3 * E * d * int(config.moe_intermediate_size)
    return d * int(config.intermediate_size)


def head_working_set(N: int, d: int, V: int, chunk: int, db: int) -> int:
    """The head stage beyond the last layer's output and the lm_head gradient (bytes): the final norm's graph (its
    fp32 upcast, ``rsqrt``, the normalized hidden state and the norm's output; in fp32 the upcast is the input itself)
    and the chunked loss: one chunk's fp32 logits and their log-probabilities (``8 C V``) and the gradient of the
    hidden state (``N d db``) (`streaming/loss.py`)."""
    C = min(chunk, N)
    norm = N * d * (2 * db + (0 if db == FP32 else FP32)) + N * FP32
    return norm + 8 * C * V + N * d * db


# ------------------------------------------------------------------------------------------------ per plan
def slot_pools(plan: Any, weight_bytes: Sequence[int], kinds: Sequence[str]) -> dict[str, int]:
    """Bytes of the executor's slot pool of each layer kind for ``plan``: ``min(n, max(1, depth) + 1 + extra)``
    slots of the kind's largest streamed layer (256-byte aligned), ``n`` its streamed layers, ``depth`` their deepest
    fetch ahead, ``extra = min(2, K - 1 - backward depth)`` for block checkpointing every K layers
    (`streaming/binder.py`, Note: [Block recomputation binds its layers one by one]). Allocated at attach, held the
    whole step."""
    by_kind: dict[str, list[int]] = {}
    for lp in plan.layers:
        if not lp.resident:
            by_kind.setdefault(kinds[lp.index], []).append(lp.index)
    pools = {}
    for kind, idx in by_kind.items():
        nbytes = -(-max(weight_bytes[i] for i in idx) // SLOT_ALIGN) * SLOT_ALIGN
        depth = max(max(plan.layers[i].fetch_fwd_ahead, plan.layers[i].fetch_bwd_ahead) for i in idx)
        bwd_depth = max(plan.layers[i].fetch_bwd_ahead for i in idx)
        pools[kind] = nbytes * min(len(idx), pool_slots(plan.checkpoint_every, depth, bwd_depth))
    return pools


def pool_slots(K: int, depth: int, bwd_depth: int) -> int:
    """Slots of one kind's pool for fetch depth ``depth`` (forward or backward), backward depth ``bwd_depth`` and
    block checkpointing every ``K`` layers (1: none), before the cap at the number of streamed layers."""
    return max(1, depth) + 1 + min(2, max(0, K - 1 - bwd_depth))


def held_grad_bytes(cm: Any) -> tuple[int, int]:
    """``(from the head stage, from B_0)``: gradients of parameters that are not streamed, held until the optimizer
    step: the lm_head + final norm's from the head stage (a tied lm_head's is the embedding's, from the head stage
    too), the embedding's from its backward at the end of ``B_0``."""
    if cm.head_params:
        return cm.head_grad_bytes, cm.embed_grad_bytes
    return cm.embed_grad_bytes, 0


def with_accumulation(cm: Any, steps: int) -> Any:
    """A copy of cost model ``cm`` planning ``steps`` micro-batches per optimizer step (`carried_grad_bytes`)."""
    new = copy.copy(cm)
    new.accumulation_steps = max(1, int(steps))
    return new


def with_streamed_embeddings(cm: Any, on: bool = True) -> Any:
    """A copy of cost model ``cm`` whose plans stream the embedding and head (``Plan.stream_embeddings``,
    `streamed_head_terms`) when ``on``: every plan made from it (`stages.plan_from_options`, the baselines, the MILP's)
    carries the flag, and the MILP charges the streamed units in place of the resident weights and held gradients."""
    new = copy.copy(cm)
    new.stream_embeddings = bool(on)
    return new


def carried_grad_bytes(cm: Any) -> tuple[int, int]:
    """``(the lm_head's, the embedding's)`` gradient bytes held on the device from the first micro-batch of an
    optimizer step through the forward and backward of the others (gradient accumulation,
    ``cm.accumulation_steps`` > 1): the resident parameters' gradients are accumulated in place on the device and
    leave at the optimizer step (`held_grad_bytes`), so every stage of a later micro-batch holds them. None without
    accumulation, nor for streamed embedding and head (their gradients leave as a layer's).

    A later micro-batch's backward also makes each resident gradient anew before adding it into the held one: the
    head stage holds a second lm_head gradient (the stage models charge the carried one through the head stage),
    and the embedding's backward a second embedding gradient at the end of backward, before the norm's fp32 copy
    (`end_of_backward_bytes`). Measured on the CPU device (`tests/test_memory_model.py`, two micro-batches)."""
    return held_grad_bytes(cm) if getattr(cm, "accumulation_steps", 1) > 1 else (0, 0)


def end_of_backward_bytes(cm: Any) -> int:
    """Bytes at the end of backward beyond the held gradients, one at a time: the global norm's fp32 copy
    (`resident_norm_bytes`) or, under gradient accumulation, the embedding's new gradient before it is added into
    the held one (`carried_grad_bytes`)."""
    return max(resident_norm_bytes(cm), carried_grad_bytes(cm)[1])


def resident_norm_bytes(cm: Any) -> int:
    """The global gradient norm's fp32 copy of a resident gradient (bytes), at the end of backward beside every held
    gradient: `StreamHandle.grad_sq_norms` (clipping, the logged norm) takes the squared norm of each resident
    parameter's gradient (embedding, final norm, lm_head) in fp32, a gradient below fp32 in pieces of `NORM_CHUNK`
    elements (`norm_working_set`); the largest is ``V x d`` (the embedding's or the lm_head's; tied, the embedding's
    count includes the final norm's ``d``). Measured on the CPU device (`tests/test_memory_model.py`), where
    ``vector_norm(piece, dtype=float32)`` copies the piece to fp32; a CUDA reduction reads bf16 directly, so there the
    charge is an upper bound by one piece (64 MiB). None with fp32 gradients, nor with streamed embedding and head
    (their norms are taken as they complete, `streamed_head_terms`)."""
    if not cm.embed_params:
        return 0
    return norm_working_set(min(p for p in (cm.embed_params, cm.head_params) if p), cm.grad_dtype_bytes)


def streamed_head_terms(cm: Any) -> dict[str, int]:
    """Device bytes of the embedding and head as streamed units (``plan.stream_embeddings``, Note: [Streamed
    embeddings and head] in streaming/units.py), in place of their resident weights and held gradients:

    - ``embed_fwd``: the embedding's transient slot and its output, before layer 0's forward (the slot is released
      once the lookup ran);
    - ``head_slots``: the head's slot (final norm + lm_head) through the head stage, with the embedding's again when
      the lm_head is tied to it;
    - ``head_done``: the head's completion, beyond its slots and gradients: the hidden state's gradient and the
      device norm's fp32 copy of the lm_head gradient (`norm_working_set`), the loss's working set freed;
    - ``head_grad``: the head unit's gradients (it completes in the head stage); with a tied lm_head, the
      embedding's gradient, made in the head stage and held on the device until the lookup's part is added at the
      end of ``B_0``;
    - ``embed_done``: the embedding's completion at the end of ``B_0``: its gradient and the norm's fp32 copy."""
    tied = not cm.head_params
    x = cm.layers[0].input_bytes if cm.layers else 0
    gdb = cm.grad_dtype_bytes
    return {
        "embed_fwd": cm.embed_bytes + x,
        "head_slots": cm.head_bytes + (cm.embed_bytes if tied else 0),
        "head_done": x + (0 if tied else norm_working_set(cm.head_params, gdb)),
        "head_grad": cm.embed_grad_bytes if tied else cm.head_grad_bytes,
        "embed_done": cm.embed_grad_bytes + norm_working_set(cm.embed_params, gdb),
    }


def copies_inline(cm: Any) -> bool:
    """Whether the executor copies synchronously (the CPU device without the simulated asynchronous engine,
    `CostModel.inline_copies`): an offloaded tensor leaves the device as it is saved, gradients as they are made.
    Otherwise (CUDA, and the CPU under ``LAZYTRAIN_SIMULATE_ASYNC=1``) copies are in flight for up to two stages
    (Note: [Two stages of copies in flight] in streaming/engine.py) and their sources stay on the device meanwhile."""
    return bool(getattr(cm, "inline_copies", False))


def grads_leave_next_stage(cm: Any) -> bool:
    """Whether a layer's device gradients are held one stage after its backward (their D2H in flight); with inline
    copies (`copies_inline`) they are added into the host accumulators at once."""
    return not copies_inline(cm)


def block_recompute_terms(cm: Any, K: int, layer_graphs: bool) -> dict[str, list[tuple]]:
    """The terms of block checkpointing every ``K`` layers beyond those every recomputed layer has (its backward
    working set, `stages.evaluate_plan`), as the executor runs it (`activations/recompute.py`), for the stage model,
    the MILP and the simulator alike. Stages: ``F i`` is ``i``, ``B i`` is ``2 L - i``; a block ``[j, j + K)`` is
    recomputed from ``B`` of its top layer (``s_rec``).

    - ``alive``: ``(first stage, last stage, bytes)``: the block checkpoint (the input of layer ``j``, from ``F j``
      to ``B j``); ``layer_graphs=False`` (``block_graphs="block"``): every saved tensor of every block layer ``k``
      from ``s_rec`` to ``B k``; ``True`` (``"layer"``, Note: [A block's layers are recomputed one graph at a time]):
      the kept input of every block layer above ``j`` from ``s_rec`` to ``B k`` and layer ``k``'s saved tensors
      during ``B k`` only;
    - ``comp``: ``(stage, seconds)``: the recomputation at ``s_rec`` (the whole block with grad; or its layers below
      the top under ``no_grad``) and, with ``layer_graphs``, each layer's forward again at ``B k``;
    - ``h2d`` / ``od``: ``(stage, bytes)``: the recomputation's weight fetches at ``s_rec`` (those of the layers it
      runs) and the first of them, which has nothing to hide behind."""
    L = cm.num_layers
    alive: list[tuple[int, int, int]] = []
    comp: list[tuple[int, float]] = []
    h2d: list[tuple[int, int]] = []
    od: list[tuple[int, int]] = []
    for j in range(0, L, K):
        block = list(range(j, min(j + K, L)))
        s_rec = 2 * L - block[-1]
        alive.append((j, 2 * L - j, cm.layers[j].input_bytes))
        ran = block[:-1] if layer_graphs else block
        if ran:
            comp.append((s_rec, sum(cm.layers[k].fwd_s for k in ran)))
            h2d.append((s_rec, sum(cm.layers[k].weight_bytes for k in ran)))
            od.append((s_rec, cm.layers[j].weight_bytes))
        for k in block:
            if not layer_graphs:
                alive.append((s_rec, 2 * L - k, cm.layers[k].saved_bytes))
                continue
            if k > j:
                alive.append((s_rec, 2 * L - k, cm.layers[k].input_bytes))
            alive.append((2 * L - k, 2 * L - k, cm.layers[k].saved_bytes))
            comp.append((2 * L - k, cm.layers[k].fwd_s))
    return {"alive": alive, "comp": comp, "h2d": h2d, "od": od}
