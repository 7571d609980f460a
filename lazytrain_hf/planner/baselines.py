"""Fixed policies to compare the MILP against, expressed as plans, and MegaTrain's executor modelled from its code.

- ``megatrain``: MegaTrain's executor (`evaluate_megatrain`): the hidden state is checkpointed every K layers on the
  device, each block is recomputed under ``no_grad`` and then every layer is run forward again with grad (3 forwards
  and 3 weight crossings per layer and step), prefetch depth 1 in forward only, nothing resident but the embedding,
  final norm and lm_head, and the CPU optimizer runs after backward with the device idle.
- ``megatrain_plus``: MegaTrain-Plus (bdqnghi/MegaTrain-Plus, infinity/model/cpu_master.py at 05c51e5,
  examples/sft/train.py and infinity/config/training.py at a7d510d), MegaTrain with ``store_all_activations``: the
  forward keeps every layer's input on the device (``checkpoints[i]`` for every i) and the backward skips the no_grad
  recompute of the block: per layer, weights fetched (the next layer's fetch issued while this one computes,
  ``backward_prefetch``, default on), forward with grad from the stored input and ``autograd.grad``. On our executor:
  every layer ``recompute`` with its input on the device, prefetch depth 1 in forward and backward, 2 weight crossings
  per layer, and the CPU optimizer after backward with nothing overlapped (train.py: ``clip_grad_norm_`` then
  ``optimizer.step()``), i.e. ``all_recompute`` without the optimizer overlap. Its zero-copy unflatten, triple
  buffering and gradient worker pool change only its own executor's constants. Published: +36% tokens/s mean over
  12 models against MegaTrain, +52% at Qwen2.5-14B, bit-exact loss (DGX Spark, README at a7d510d).
- ``slideformer``: SlideFormer (arXiv 2603.16428; RegiaYoung/SlideFormer, offload_transformer.py at 69350a4,
  sliding_checkpoint.py at a0ddba6): layers slide through a GPU cache of 2 units (the pre-forward hook fetches the
  next layer, the pre-backward hook the previous one: prefetch depth 1 both ways); every decoder layer runs as a
  checkpoint whose one saved tensor, the layer input, goes to a pinned host buffer (or NVMe with
  ``ac_offload_nvme``) and is prefetched back one layer ahead in backward, except the last layer's, which stays on
  the device (``is_last_layer``); fp32 master on the host, a layer-wise CPU Adam step launched right after each
  layer's backward. On our executor: every layer ``recompute`` with its input in pinned host memory (the last one on
  the device), reloads one stage ahead, and the CPU optimizer overlapping the next forward: our updates wait for the
  global gradient norm (clipping), SlideFormer's start during backward without it, so the plan keeps our clipping
  semantics and overlaps the optimizer with the forward instead (the one place it differs).
- ``all_recompute``: every layer recomputed from its input kept on the device, prefetch depth 1.
- ``keep_all``: every layer keeps what it saves on the device, prefetch depth 1.
- ``cpu_offload_inputs``: Unsloth-style: every layer's input goes to pinned host memory and the layer is
  recomputed in backward (input reloaded one stage ahead), prefetch depth 1.

``slideformer`` and the last three overlap the CPU optimizer with the next forward like LazyTrain's executor, so
they isolate the activation policy; ``megatrain`` is the matched layer-streaming baseline of the paper,
``megatrain_plus`` and ``slideformer`` the strongest published layer-streaming systems. Their ``predicted`` comes from
the stage model (`stages.evaluate_plan`); the ``megatrain`` plan's from `evaluate_megatrain`, plus ``"tflops_6n"``.

Note: [What the megatrain plan means on our executor]
`make_baseline("megatrain", cm)` returns MegaTrain's scheme as our executor runs it (``checkpoint_every=K``,
``block_graphs="layer"``, every layer ``recompute`` with its input on the device, ``optimizer_overlap=False``): at
the top layer's backward stage the block's lower layers run under ``no_grad`` from the block checkpoint keeping their
hidden states, then each layer's backward recomputes that one layer with grad, so like MegaTrain it holds K - 1
hidden states and one layer's graph and runs 3 forwards of every block layer below the top. Its memory under the
stage model is close to `evaluate_megatrain`'s (BENCHMARKS.md, "the MILP plan vs `megatrain`"); its measured step
still differs from ``plan.predicted``:

- the block's top layer is recomputed only once (its backward runs right after the no_grad pass; MegaTrain runs it
  under no_grad too), and the weights of the layers below the top two are fetched once more for the no_grad pass
  (MegaTrain fetches every layer 3 times), with the prefetches the plan names in backward too;
- it keeps an fp32 master and fp32 gradient accumulators on the host (MegaTrain: bf16 model, bf16 gradients, no
  fp32 master), and its chunked loss runs each chunk's backward before the next chunk's logits exist (MegaTrain keeps
  every chunk's logits until the whole loss is summed);
- its optimizer is Hybrid 8-bit AdamW (MegaTrain: DeepSpeedCPUAdam with fp32 moments), still run after backward
  with nothing overlapped, as the plan says.

`stages.evaluate_plan` / `simulate.simulate` of that plan describe our executor's run; `evaluate_megatrain`
describes MegaTrain's own. `fits` and `max_batch_size` judge ``megatrain`` by `evaluate_megatrain`'s memory.

Note: [Two TFLOPS conventions]
``predicted["tflops"]`` is the hardware convention of every plan here: useful FLOPs of the step (`CostModel.
model_flops`: layer GEMMs and attention, forward + backward, and the head; recomputation not counted) over the step
time; `lazytrain plan` prints it. ``predicted["tflops_6n"]`` (megatrain only) is MegaTrain's own convention
(examples/sft/train.py): ``6 * N * B * T / step_time`` with N every parameter (embedding and lm_head included) and no
attention FLOPs, the figure MegaTrain publishes (272 TFLOPS for Qwen2.5-7B, batch 158, seq 1024 on one H100).
`benchmarks/bench_planner.py` prints both. At one sequence length both numerators are proportional to the tokens
of a step, so the ratio of two plans is the same in either convention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .costmodel import CostModel, gated_attention
from .memterms import rmsnorm_saved
from .plan import LayerPlan, Plan
from .search import max_feasible_batch
from .stages import evaluate_plan, fits_budgets, reload_aheads

BASELINES: tuple[str, ...] = (
    "megatrain",
    "megatrain_plus",
    "slideformer",
    "all_recompute",
    "keep_all",
    "cpu_offload_inputs",
)
MEGATRAIN_CHECKPOINT_EVERY = 4  # CPUMasterConfig.checkpoint_interval default (configs: memory.checkpoint_interval)
MEGATRAIN_WEIGHT_CROSSINGS = 3  # forward, no_grad recompute, forward with grad (cpu_master.py backward loop)
# Host bytes per parameter MegaTrain keeps (cpu_master.py at 919520f): the bf16 HF model (2), its pinned flat copy
# per layer (2), bf16 gradients accumulated into p.grad (2), DeepSpeedCPUAdam fp32 m and v (8).
_MEGATRAIN_HOST_BYTES_PER_PARAM = 2 + 2 + 2 + 8
_MEGATRAIN_GRAD_SLABS = 12  # CPUMasterConfig.num_grad_slabs: pinned host slabs of the largest layer


def _check_checkpoint_every(checkpoint_every: Any) -> int:
    if not isinstance(checkpoint_every, int) or isinstance(checkpoint_every, bool) or checkpoint_every < 1:
        raise ValueError(
            f"checkpoint_every={checkpoint_every!r} must be an int >= 1 (MegaTrain's checkpoint_interval; its default "
            f"is {MEGATRAIN_CHECKPOINT_EVERY})."
        )
    return checkpoint_every


# ------------------------------------------------------------------------------------------------ MegaTrain model
@dataclass
class MegaTrainEvaluation:
    """MegaTrain's step on a `CostModel`, as its executor does it (see `evaluate_megatrain`).

    Args:
        step_time_s: forward + loss + backward (to the last gradient on the host) + optimizer + weight sync.
        forward_s, backward_s: end of the forward / of the backward (gradients on the host included) from step start.
        optimizer_s, sync_s: the serial CPU optimizer step and the upload of embedding / final norm / lm_head after it.
        peak_gpu_bytes: device bytes at the worst phase; ``fixed_gpu_bytes`` the batch-independent part of it.
        phase_peaks: device bytes at the worst point of each phase (``forward``, ``loss``, ``recompute``,
            ``backward``, ``embedding_backward``).
        h2d_bytes, d2h_bytes: bytes per step host -> device and device -> host.
        tflops: hardware convention (see Note [Two TFLOPS conventions]); tflops_6n: MegaTrain's convention.
    """

    checkpoint_every: int
    step_time_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    sync_s: float
    peak_gpu_bytes: int
    fixed_gpu_bytes: int
    peak_phase: str
    phase_peaks: dict[str, int]
    h2d_bytes: int
    d2h_bytes: int
    peak_host_bytes: int
    tflops: float
    tflops_6n: float
    tokens_per_s: float
    layer_fetches: list[int] = field(default_factory=list)  # H2D weight copies per layer and step

    def predictions(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "tflops": self.tflops,
            "tokens_per_s": self.tokens_per_s,
            "peak_gpu_bytes": self.peak_gpu_bytes,
            "peak_host_bytes": self.peak_host_bytes,
            "pinned_host_bytes": 0,  # no activation is offloaded
            "nvme_bytes": 0,
            "tflops_6n": self.tflops_6n,
        }


def _megatrain_memory(cm: CostModel, K: int) -> tuple[int, dict[str, int]]:
    """Fixed device bytes and the peak of each phase (cpu_master.py `_create_gpu_context` and
    `_forward_and_backward_single_gpu` at 919520f). Symbols: L layers, B x T tokens (N), d hidden, V vocabulary,
    db the compute dtype's bytes (bf16 in MegaTrain's configs: weights, gradients and logits all use it),
    x = N * d * db one hidden state, w_i / g_i layer i's weight / gradient bytes (= params_i * db)."""
    cfg = cm.config
    L, B, T, db = cm.num_layers, cm.micro_batch_size, cm.seq_len, cm.dtype_bytes
    N = B * T
    d, V = int(cfg.hidden_size), int(cfg.vocab_size)
    x = N * d * db
    w = [lc.params * db for lc in cm.layers]
    # ---- fixed: resident embedding + final norm + lm_head (`emb_gpu`, `norm_gpu`, `lm_head_gpu`, tied -> one copy),
    # two flat weight buffers of the largest layer (`gpu_flat_buffers`) and two templates per layer structure
    # (`gpu_layer_templates[group][0..1]`, weights copied in by `_unflatten_to_layer`); layer kinds stand for groups.
    groups: dict[str, int] = {}
    for lc, wi in zip(cm.layers, w):
        groups[lc.kind] = max(groups.get(lc.kind, 0), wi)
    fixed = (cm.embed_params + cm.head_params) * db + 2 * max(w, default=0) + 2 * sum(groups.values())
    # ---- per batch
    n_ckpt = math.ceil(L / K) + 1  # `checkpoints[i]` for i % K == 0, plus `checkpoints[L]`; kept until backward ends
    one_plus = gated_attention(cfg)
    norm_graph = x + rmsnorm_saved(N, d, db, one_plus)  # an RMSNorm's output and what it saves (x32, rsqrt, normed)
    # `hidden = ctx.norm_gpu(hidden)` after the forward loop runs with grad and is never freed before the function
    # returns: its output and saved tensors stay for the whole backward.
    leftover = norm_graph
    phases: dict[str, int] = {}
    # forward (no_grad): the checkpoints so far + the working set of a forward that saves nothing (memmodel)
    phases["forward"] = max(
        (math.ceil((i + 1) / K) * x + lc.ws_nosave_bytes for i, lc in enumerate(cm.layers)), default=0
    )
    # loss: the chunked CE keeps every chunk's logits (flash-attn CE with inplace_backward saves its input; PyTorch CE
    # saves a log-softmax of the same size) over the T - 1 predicted positions until `loss.backward()`, beside the
    # head's own final-norm graph, the gradient of the normed hidden state (x) and the lm_head gradient.
    logits = B * (T - 1) * V * db
    phases["loss"] = n_ckpt * x + leftover + norm_graph + logits + x + cm.head_params * db
    # recompute (no_grad) of block [j0, j1): up to K cached outputs (`recompute_cache`) + the layer's working set;
    # backward of layer i: the cached outputs of the block's layers up to i, one layer's graph (saved_bytes), the
    # larger of its forward's working set and its backward's with this layer's bf16 gradients, and the previous
    # layer's gradients (still on the grad stream).
    # Note: [MegaTrain's backward working set] the terms are the executor's memory model (`memmodel`): the backward
    # holds ``ws_bwd + g`` beyond the layer's saved tensors (measured 0.5-1.0 g beyond the incoming gradient on
    # every layer kind); the 4 gate/up-sized gradients the cost model once charged would need ~89 GB for Qwen2.5-7B
    # at batch 158, which MegaTrain runs on 80 GB.
    rec = bwd = 0
    for j0 in range(0, L, K):
        block = range(j0, min(j0 + K, L))
        for p, i in enumerate(block):
            lc = cm.layers[i]
            g_prev = w[i + 1] if i + 1 < L else cm.head_params * db
            rec = max(rec, (p + 1) * x + lc.ws_nosave_bytes)
            graph = lc.saved_bytes + max(lc.ws_fwd_bytes, lc.ws_bwd_bytes + w[i])
            bwd = max(bwd, (p + 1) * x + graph + g_prev)
    base = n_ckpt * x + leftover
    phases["recompute"] = base + rec
    phases["backward"] = base + bwd
    # `emb_out.backward(grad_hidden)`: a new embedding output, the incoming gradient and the dense embedding gradient
    phases["embedding_backward"] = base + 2 * x + cm.embed_params * db
    return fixed, phases


def _megatrain_time(cm: CostModel, K: int, overlap_backward_fetches: bool) -> dict[str, float]:
    """Lane recurrence of MegaTrain's step: one weight stream (H2D), the compute stream, one grad stream (D2H), then
    the CPU. Each weight load is followed by its compute; load k goes into flat buffer ``layer % 2``."""
    L, db = cm.num_layers, cm.dtype_bytes
    bh, bd = cm.h2d, cm.d2h
    w = [lc.params * db for lc in cm.layers]
    # the loads in order: (layer, compute seconds, phase); forward computes f_i, the no_grad recompute f_i, the
    # backward pass of a layer re-runs its forward with grad and calls autograd.grad: f_i + k_i
    loads: list[tuple[int, float, str]] = [(i, lc.fwd_s, "F") for i, lc in enumerate(cm.layers)]
    for j0 in reversed(range(0, L, K)):
        block = list(range(j0, min(j0 + K, L)))
        loads += [(j, cm.layers[j].fwd_s, "R") for j in block]
        loads += [(i, cm.layers[i].fwd_s + cm.layers[i].bwd_s, "B") for i in reversed(block)]
    h2d_end = 0.0  # the weight stream is free
    comp_end = 0.0
    d2h_end = 0.0
    last_start = {0: -math.inf, 1: -math.inf}  # compute start of the previous load per flat buffer
    template_free: dict[tuple[str, int], float] = {}  # (kind, buffer) -> end of the grad D2H of its last user
    head_end = forward_end = 0.0
    for n, (i, c, phase) in enumerate(loads):
        buf = i % 2
        if phase != "F" and (n == 0 or loads[n - 1][2] == "F"):
            comp_end += cm.head_s  # final norm, chunked loss and its backward, between forward and backward
            head_end = comp_end
            d2h_end = max(d2h_end, comp_end) + cm.head_params * db / bd  # lm_head + norm gradients
        # a load waits for the weight stream and for its flat buffer's previous unflatten (`buffer_free_events`, at
        # the start of that compute). Forward: issued before the previous layer computes (prefetch depth 1).
        # Recompute and backward: issued right before its own compute, so it starts after the previous compute.
        start = max(h2d_end, last_start[buf])
        if phase != "F":
            start = max(start, head_end) if overlap_backward_fetches else max(start, comp_end)
        h2d_end = start + w[i] / bh
        # the compute waits for its weights, and its unflatten for the template's last gradients to leave
        cs = max(comp_end, h2d_end, template_free.get((cm.layers[i].kind, buf), 0.0))
        last_start[buf] = cs
        comp_end = cs + c
        if phase == "F":
            forward_end = comp_end
        elif phase == "B":  # bf16 gradients D2H on the grad stream
            d2h_end = max(d2h_end, comp_end) + w[i] / bd
            template_free[(cm.layers[i].kind, buf)] = d2h_end
    # embedding backward (a gather's gradient, no GEMM) then its gradient D2H; `torch.cuda.synchronize()` waits for
    # the grad stream
    d2h_end = max(d2h_end, comp_end) + cm.embed_params * db / bd
    backward_end = max(comp_end, d2h_end)
    # train.py: clip_grad_norm_ + DeepSpeedCPUAdam.step() on the CPU with the device idle (profile rate R_opt), then
    # `_sync_params_to_gpu` uploads the embedding, final norm and lm_head before the next forward may start
    optimizer = cm.total_params / cm.hardware.cpu_optimizer_params_per_s
    sync = (cm.embed_params + cm.head_params) * db / bh
    return {
        "forward_s": forward_end,
        "backward_s": backward_end,
        "optimizer_s": optimizer,
        "sync_s": sync,
        "step_time_s": backward_end + optimizer + sync,
    }


def evaluate_megatrain(
    cost_model: CostModel,
    checkpoint_every: int = MEGATRAIN_CHECKPOINT_EVERY,
    *,
    overlap_backward_fetches: bool = False,
) -> MegaTrainEvaluation:
    """MegaTrain's step time, device memory and transfers for ``cost_model`` (its executor as its code does it:
    infinity/model/cpu_master.py and examples/sft/train.py at 919520f).

    Time: the forward streams layer i+1 while layer i computes; the loss is one compute span; in backward, per block
    of K layers top block first, every layer is fetched and recomputed under ``no_grad``, then fetched again and run
    forward with grad + ``autograd.grad`` (f_i + k_i); each of those loads is issued right before its own compute and
    so starts after the previous compute (``overlap_backward_fetches=True`` lets it start as soon as the weight stream
    and its buffer are free, as when the host runs ahead of the device). Layer gradients go down in the compute dtype
    on their own stream (a template is reused only after its gradients left). Then the CPU optimizer over all
    parameters at the profile's rate with the device idle, and the upload of embedding / final norm / lm_head.
    Not charged: the CPU gradient clipping pass, the re-flattening of the pinned layer copies after the step and the
    worker thread's accumulation into ``p.grad`` (all CPU work that would only lengthen MegaTrain's step).

    Memory: see `_megatrain_memory`; the peak is the largest phase.

    Args:
        checkpoint_every: K, MegaTrain's ``checkpoint_interval``.
        overlap_backward_fetches: model the recompute / backward fetches as overlapping the previous compute.

    Raises:
        ValueError: ``checkpoint_every`` is not an int >= 1, or the cost model has no config.
    """
    cm = cost_model
    K = _check_checkpoint_every(checkpoint_every)
    if cm.config is None:
        raise ValueError("evaluate_megatrain needs cost_model.config (build it with CostModel.from_config).")
    t = _megatrain_time(cm, K, overlap_backward_fetches)
    fixed, phases = _megatrain_memory(cm, K)
    phase = max(phases, key=phases.get)
    db = cm.dtype_bytes
    w_total = sum(lc.params for lc in cm.layers) * db
    step = t["step_time_s"]
    host = cm.total_params * _MEGATRAIN_HOST_BYTES_PER_PARAM
    host += (_MEGATRAIN_GRAD_SLABS * max((lc.params for lc in cm.layers), default=0) + cm.embed_params) * db
    host += cm.head_params * db
    return MegaTrainEvaluation(
        checkpoint_every=K,
        step_time_s=step,
        forward_s=t["forward_s"],
        backward_s=t["backward_s"],
        optimizer_s=t["optimizer_s"],
        sync_s=t["sync_s"],
        peak_gpu_bytes=int(fixed + phases[phase]),
        fixed_gpu_bytes=int(fixed),
        peak_phase=phase,
        phase_peaks={k: int(fixed + v) for k, v in phases.items()},
        # 3 crossings of every layer's weights + the embedding / norm / lm_head upload after the optimizer step
        h2d_bytes=int(MEGATRAIN_WEIGHT_CROSSINGS * w_total + (cm.embed_params + cm.head_params) * db),
        # every gradient once, in the compute dtype
        d2h_bytes=int(w_total + (cm.embed_params + cm.head_params) * db),
        peak_host_bytes=int(host),
        tflops=cm.model_flops / step / 1e12,
        # examples/sft/train.py: flops = 6 * num_params * batch_size * max_seq_len
        tflops_6n=6 * cm.total_params * cm.tokens / step / 1e12,
        tokens_per_s=cm.tokens / step,
        layer_fetches=[MEGATRAIN_WEIGHT_CROSSINGS] * cm.num_layers,
    )


# ------------------------------------------------------------------------------------------------ plans
def baseline_plan(name: str, cost_model: CostModel, *, checkpoint_every: int = MEGATRAIN_CHECKPOINT_EVERY) -> Plan:
    """The decisions of baseline ``name`` (one of `BASELINES`) for ``cost_model``, without predictions (see
    `make_baseline`). Needs only the layers of the cost model, not its config.

    Raises:
        ValueError: unknown ``name`` or a ``checkpoint_every`` that is not an int >= 1.
    """
    if name not in BASELINES:
        raise ValueError(f"baseline={name!r} is not known; use one of {', '.join(BASELINES)}.")
    K = _check_checkpoint_every(checkpoint_every)
    cm = cost_model
    L = cm.num_layers
    policy, tier = {
        "megatrain": ("recompute", "gpu"),
        "megatrain_plus": ("recompute", "gpu"),
        "slideformer": ("recompute", "cpu"),
        "all_recompute": ("recompute", "gpu"),
        "keep_all": ("keep", "gpu"),
        "cpu_offload_inputs": ("recompute", "cpu"),
    }[name]

    def tier_of(i: int) -> str:
        # SlideFormer's last decoder layer keeps its checkpoint on the device (`SlidingCheckpoint(is_last_layer)`):
        # its backward follows its forward with only the head between
        return "gpu" if name == "slideformer" and i == L - 1 else tier

    def reload_ahead(i: int) -> int:
        # one stage ahead where the copy it waits for allows it (the last layer's input goes down during the head
        # stage: its reload is issued at its backward, `stages.reload_aheads`)
        option = "rec_cpu" if (policy, tier_of(i)) == ("recompute", "cpu") else "keep"
        return 1 if option == "keep" or reload_aheads(L, i, option, 1) == [0, 1] else 0

    layers = [
        LayerPlan(
            index=i,
            kind=lc.kind,
            policy=policy,
            input_tier=tier_of(i),
            fetch_fwd_ahead=1,
            fetch_bwd_ahead=1,
            reload_ahead=reload_ahead(i),
        )
        for i, lc in enumerate(cm.layers)
    ]
    return Plan(
        layers=layers,
        micro_batch_size=cm.micro_batch_size,
        seq_len=cm.seq_len,
        loss_chunk_tokens=cm.loss_chunk_tokens,
        source=f"baseline:{name}",
        hardware=cm.hardware.name,
        model=cm.model_name,
        checkpoint_every=K if name == "megatrain" else 1,
        # MegaTrain's backward: a no_grad pass over the block keeping its hidden states, then one layer's graph at a
        # time (Note: [A block's layers are recomputed one graph at a time] in activations/recompute.py)
        block_graphs="layer" if name == "megatrain" else "block",
        # MegaTrain and MegaTrain-Plus clip and step after backward with the device idle (examples/sft/train.py)
        optimizer_overlap=name not in ("megatrain", "megatrain_plus"),
        stream_embeddings=cm.stream_embeddings,
    )


def make_baseline(name: str, cost_model: CostModel, *, checkpoint_every: int = MEGATRAIN_CHECKPOINT_EVERY) -> Plan:
    """The baseline plan ``name`` (one of `BASELINES`) for ``cost_model``.

    ``predicted`` comes from the stage model, except for ``megatrain``: from `evaluate_megatrain` (its keys plus
    ``"tflops_6n"``; a key the MegaTrain model does not define keeps the stage model's value for our executor's run
    of the plan). See Note [What the megatrain plan means on our executor].

    Args:
        checkpoint_every: K of ``megatrain`` (MegaTrain's ``checkpoint_interval``); the other baselines use 1.

    Raises:
        ValueError: unknown ``name`` or a ``checkpoint_every`` that is not an int >= 1.
    """
    cm = cost_model
    plan = baseline_plan(name, cm, checkpoint_every=checkpoint_every)
    plan.predicted = evaluate_plan(plan, cm).predictions()
    if name == "megatrain":
        plan.predicted.update(evaluate_megatrain(cm, plan.checkpoint_every).predictions())
    return plan


def fits(plan: Plan, cost_model: CostModel, gpu_budget: int, host_budget: int, nvme_budget: int = 0) -> bool:
    """Whether ``plan`` fits the budgets: a ``megatrain`` baseline plan under `evaluate_megatrain`'s memory, any
    other plan under the stage model's accounting (the MILP's own test)."""
    if plan.source == "baseline:megatrain":
        ev = evaluate_megatrain(cost_model, plan.checkpoint_every)
        return ev.peak_gpu_bytes <= gpu_budget  # no activation goes to pinned host memory or NVMe
    return fits_budgets(evaluate_plan(plan, cost_model), gpu_budget, host_budget, nvme_budget)


def max_batch_size(
    name: str,
    cost_model: CostModel,
    gpu_budget: int,
    host_budget: int,
    max_batch: int = 256,
    *,
    checkpoint_every: int = MEGATRAIN_CHECKPOINT_EVERY,
) -> int:
    """Largest micro-batch size at which baseline ``name`` fits (0: not even 1)."""

    def ok(b: int) -> bool:
        cm = cost_model.with_batch(b)
        return fits(make_baseline(name, cm, checkpoint_every=checkpoint_every), cm, gpu_budget, host_budget)

    return max_feasible_batch(ok, max_batch)
