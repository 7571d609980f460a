"""Cost model: per-layer FLOPs, bytes and times of one training step, from any HF config (no weights needed).

Symbols (one micro-batch; ``db`` = bytes of the compute dtype, 2 for bf16):

    B  micro-batch size          T  sequence length          N = B * T tokens
    d  hidden size               I  MLP intermediate size    V  vocabulary size
    H  query heads               Hkv key/value heads         hd head dim; hq = H * hd, hkv = Hkv * hd
    E  experts, k experts per token, Ie expert intermediate size, S = N * k routed (token, expert) pairs
    Hv / Hk linear-attention value / key heads, dv / dk their head dims, K conv kernel, C = 64 delta-rule chunk

Saved-activation bytes (``A``) count what autograd really saves for backward in a transformers 5 Qwen decoder
layer (sum of unique storages, parameters excluded, the shared rotary cos/sin excluded), term by term as the ops
save them; `tests/test_planner_costmodel.py` checks the formulas against `torch.autograd.graph.saved_tensors_hooks`
on tiny qwen2 / qwen3 / qwen3_moe / qwen3_5_text models. FLOPs follow the usual 2 * m * n * k per GEMM (nanoGPT
``estimate_mfu``, Megatron-LM's Narayanan et al. 2021, appendix) with the causal attention GEMMs halved (flash
kernels skip masked blocks); backward is 2x forward.

Times (`layer_compute_terms`, `layer_seconds`, `head_seconds`): each layer's FLOPs split by compute class (dense
GEMMs, attention core, gated-delta-rule core, MoE experts), each at its own rate ``P * eta_class`` of the hardware
profile, plus memory-bound passes (norms, activations, casts, softmax: ``MEMORY_PASSES_* x A`` bytes at ``BW_mem``)
and a fixed cost per kernel. The constants of the bundled GPU profiles are fitted to published runs or argued from
kernel measurements (hardware.py; `calibration.residuals()` checks them), the CPU's are measured (`measure`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..models import layer_kinds
from ..streams import simulate_async
from .hardware import HardwareProfile, get_profile
from .memmodel import head_working_set, layer_working_sets  # the executor's memory terms (memmodel.py)
from .memterms import MEMORY_PASSES_BWD, MEMORY_PASSES_FWD, rmsnorm_saved  # memory-bound traffic terms (memterms.py)
from .plan import POLICIES

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
DELTA_RULE_CHUNK = 64  # chunk_size of transformers' torch_chunk_gated_delta_rule
FP32 = 4
INT64 = 8
INT32 = 4
# Host bytes per parameter of the model state: fp32 master (4) + compute copy (db) + fp32 grad (4) + 8-bit m and v
# (1 + 1) + one fp32 absmax per 256-element block for each moment (2 * 4 / 256).
_HOST_STATE_FIXED = 4 + 4 + 2 + 8 / 256


# ------------------------------------------------------------------------------------------------ config access
def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, default)
    return default if value is None else value


def _dims(config: Any) -> dict[str, int]:
    d = int(config.hidden_size)
    H = int(config.num_attention_heads)
    hd = int(_get(config, "head_dim", d // H))
    Hkv = int(_get(config, "num_key_value_heads", H))
    return dict(d=d, H=H, hd=hd, Hkv=Hkv, hq=H * hd, hkv=Hkv * hd, V=int(config.vocab_size))


def gated_attention(config: Any) -> bool:
    """Qwen3-Next / Qwen3.5 full attention: q_proj also emits a sigmoid output gate, q/k norms are (1 + w) ones."""
    return config.model_type in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def _has_qk_norm(config: Any) -> bool:
    return config.model_type != "qwen2" and config.model_type != "qwen2_moe"


def _attention_bias(config: Any) -> bool:
    if config.model_type in ("qwen2", "qwen2_moe"):
        return True  # Qwen2Attention hard-codes bias on q/k/v
    return bool(_get(config, "attention_bias", False))


def _num_experts(config: Any) -> int:
    return int(_get(config, "num_experts", 0) or _get(config, "num_local_experts", 0))


def _shared_expert_size(config: Any) -> int:
    """Intermediate size of the shared expert, 0 for families whose MoE block has none (e.g. qwen3_moe: a config
    may still carry the attribute)."""
    from ..models import MODEL_TABLE

    spec = MODEL_TABLE.get(_get(config, "model_type", None))
    if spec is not None and not spec.has_shared_expert:
        return 0
    return int(_get(config, "shared_expert_intermediate_size", 0))


def _linear_dims(config: Any) -> dict[str, int]:
    Hv = int(_get(config, "linear_num_value_heads", 32))
    Hk = int(_get(config, "linear_num_key_heads", 16))
    dk = int(_get(config, "linear_key_head_dim", 128))
    dv = int(_get(config, "linear_value_head_dim", 128))
    K = int(_get(config, "linear_conv_kernel_dim", 4))
    return dict(Hv=Hv, Hk=Hk, dk=dk, dv=dv, K=K, conv=2 * Hk * dk + Hv * dv, vd=Hv * dv)


# ------------------------------------------------------------------------------------------------ parameters
def layer_param_count(config: Any, kind: str) -> int:
    """Parameters of one decoder layer of ``kind`` (as the transformers 5 modules define them)."""
    m = _dims(config)
    d = m["d"]
    attn, _, moe = kind.partition("+")
    n = 2 * d  # input_layernorm, post_attention_layernorm
    if attn == "full_attention":
        q_out = m["hq"] * (2 if gated_attention(config) else 1)
        n += d * q_out + 2 * d * m["hkv"] + m["hq"] * d
        if _attention_bias(config):
            n += q_out + 2 * m["hkv"] + (d if config.model_type not in ("qwen2", "qwen2_moe") else 0)
        if _has_qk_norm(config):
            n += 2 * m["hd"]
    else:
        ld = _linear_dims(config)
        # in_proj_qkv + in_proj_z + in_proj_b + in_proj_a + depthwise conv1d + dt_bias + A_log + gated norm + out_proj
        n += d * ld["conv"] + d * ld["vd"] + 2 * d * ld["Hv"] + ld["conv"] * ld["K"] + 2 * ld["Hv"] + ld["dv"]
        n += ld["vd"] * d
    if moe:
        E = _num_experts(config)
        Ie = int(config.moe_intermediate_size)
        n += E * d + 3 * E * d * Ie  # router + fused gate_up / down experts
        Is = _shared_expert_size(config)
        if Is:
            n += 3 * d * Is + d  # shared expert MLP + its sigmoid gate
    else:
        n += 3 * d * int(config.intermediate_size)
    return n


# ------------------------------------------------------------------------------------------------ saved bytes
def _attention_core_saved(m: dict[str, int], B: int, T: int, db: int, attn_impl: str) -> int:
    N = B * T
    if attn_impl == "sdpa":
        # flash / efficient SDPA: q, k, v (GQA without repeat), output, fp32 logsumexp per (B, H, T)
        return N * m["hq"] * db + 2 * N * m["hkv"] * db + N * m["hq"] * db + N * m["H"] * FP32
    # eager: repeated k and v, q, fp32 softmax probs (plus their dtype copy), and the contiguous output
    probs = B * m["H"] * T * T
    return (
        2 * N * m["hq"] * db + N * m["hq"] * db + probs * FP32 + (probs * db if db != FP32 else 0) + N * m["hq"] * db
    )


def _full_attention_saved(config: Any, B: int, T: int, db: int, attn_impl: str) -> int:
    m = _dims(config)
    N = B * T
    gated = gated_attention(config)
    n = 0
    if _has_qk_norm(config):
        n += rmsnorm_saved(N * m["H"], m["hd"], db, gated) + rmsnorm_saved(N * m["Hkv"], m["hd"], db, gated)
    n += _attention_core_saved(m, B, T, db, attn_impl)
    if gated:
        # the gate half of q_proj reshaped contiguous and its sigmoid, then o_proj's input (output * gate)
        n += 3 * N * m["hq"] * db
    elif attn_impl == "eager":
        pass  # o_proj input counted in the eager core (contiguous copy)
    return n


def _linear_attention_saved(config: Any, B: int, T: int, db: int) -> int:
    """Gated DeltaNet as transformers runs it without the fla kernels (torch conv1d + torch_chunk_gated_delta_rule)."""
    ld = _linear_dims(config)
    Hv, dk, dv, K, C = ld["Hv"], ld["dk"], ld["dv"], ld["K"], DELTA_RULE_CHUNK
    N = B * T
    Tp = -(-T // C) * C  # sequence padded to whole chunks
    nc = Tp // C
    n = 0
    # projections and short conv: conv input, full padded conv output (silu input), sigmoid(b), softplus(a) path
    n += B * ld["conv"] * T * db + B * ld["conv"] * (T + K - 1) * db + N * Hv * db + 2 * Hv * FP32 + 2 * N * Hv * FP32
    # delta rule inputs in fp32 (q, k repeated to Hv heads), l2norm inverse norms, beta, v, normalized k
    n += 2 * B * Hv * T * dk * FP32 + 2 * B * Hv * T * FP32 + B * Hv * Tp * FP32 + B * Hv * Tp * dv * FP32
    n += B * Hv * Tp * dk * FP32
    # intra-chunk: causal mask; pairwise decay, kk^T, ut system, qk^T, intra attn (C x C each); k and scaled q
    n += C * C + 5 * B * Hv * Tp * C * FP32 + 2 * B * Hv * Tp * dk * FP32
    # cum decay and its two exps, new values, k_cumdecay, chunk decay, states read per chunk, v_new, decayed k
    n += 3 * B * Hv * Tp * FP32 + B * Hv * Tp * dv * FP32 + B * Hv * Tp * dk * FP32 + B * Hv * nc * FP32
    n += nc * B * Hv * dk * dv * FP32 + B * Hv * Tp * dv * FP32
    # decayed q (reads of a state that needs grad) and decayed k (state updates) are saved only from the second
    # chunk on: chunk 0 reads the zero initial state and the last update is dropped (no final state is returned)
    n += 2 * B * Hv * Tp * dk * FP32 if nc > 1 else 0
    # gated RMSNorm on the output (fp32 in, rsqrt, dtype normed, fp32 gate and silu, dtype product) + out_proj input
    n += 3 * N * ld["vd"] * FP32 + N * Hv * FP32 + 3 * N * ld["vd"] * db
    return n


def _moe_saved(config: Any, B: int, T: int, db: int) -> int:
    """Qwen3-MoE sparse block, transformers 5 ``grouped_mm`` experts (sorted tokens, fused gate_up / down)."""
    m = _dims(config)
    d = m["d"]
    N = B * T
    E = _num_experts(config)
    k = int(config.num_experts_per_tok)
    Ie = int(config.moe_intermediate_size)
    S = N * k
    n = N * E * FP32 + N * k * INT64  # router softmax (fp32), top-k indices
    if _get(config, "norm_topk_prob", False):
        n += N * FP32 + N * k * FP32  # renormalisation: row sums and top-k values
    n += 2 * S * INT64 + E * INT32  # sort permutation, gather index, group offsets
    n += S * d * db + S * 2 * Ie * db + 2 * S * Ie * db + S * db + S * d * db + S * INT64  # experts path, inverse perm
    Is = _shared_expert_size(config)
    if Is:
        n += 4 * N * Is * db + N * d * db + N * db  # shared expert MLP, its output and sigmoid gate
    return n


def _mlp_saved(config: Any, B: int, T: int, db: int) -> int:
    # gate_proj out (silu), silu out (mul), up_proj out (mul), product (down_proj input)
    return 4 * B * T * int(config.intermediate_size) * db


def layer_saved_bytes(config: Any, kind: str, B: int, T: int, db: int = 2, attn_impl: str = "sdpa") -> int:
    """Bytes a decoder layer of ``kind`` saves for backward when nothing is recomputed (``keep``)."""
    if attn_impl not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation={attn_impl!r} is not supported; use one of {ATTN_IMPLEMENTATIONS}.")
    d = int(config.hidden_size)
    N = B * T
    attn, _, moe = kind.partition("+")
    one_plus = gated_attention(config)
    # two decoder RMSNorms and their outputs (inputs of the q/k/v and MLP projections)
    n = 2 * rmsnorm_saved(N, d, db, one_plus) + 2 * N * d * db
    if attn == "full_attention":
        n += _full_attention_saved(config, B, T, db, attn_impl)
    else:
        n += _linear_attention_saved(config, B, T, db)
    n += _moe_saved(config, B, T, db) if moe else _mlp_saved(config, B, T, db)
    return n


def saved_activation_bytes(
    config: Any,
    layer_index: int,
    policy: str,
    micro_batch_size: int,
    seq_len: int,
    dtype_bytes: int = 2,
    attn_implementation: str = "sdpa",
) -> int:
    """Device bytes layer ``layer_index`` holds between its forward and its backward under ``policy``.

    ``keep``: everything the layer saves for backward; ``recompute``: only its input ``B * T * d * db``;
    ``offload_cpu`` / ``offload_nvme``: 0 (the bytes live off the device)."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not one of {POLICIES}.")
    kinds = layer_kinds(config)
    if not 0 <= layer_index < len(kinds):
        raise ValueError(f"layer_index={layer_index} is out of range for {len(kinds)} layers.")
    if policy == "keep":
        return layer_saved_bytes(
            config, kinds[layer_index], micro_batch_size, seq_len, dtype_bytes, attn_implementation
        )
    if policy == "recompute":
        return micro_batch_size * seq_len * int(config.hidden_size) * dtype_bytes
    return 0


# ------------------------------------------------------------------------------------------------ FLOPs
# Eager kernels per layer forward (backward runs about twice as many), counted from the transformers 5 modules:
# two RMSNorms (6 each), q/k/v/o projections, q/k norms, rotary (8), SDPA, residual adds, the SwiGLU MLP (5). The
# torch chunked delta rule adds its per-chunk loop (~12 ops per chunk) and the chunk_size - 1 = 63 steps of its
# triangular solve (3 ops each); the routed MoE block ~25 (router, top-k, sort, grouped GEMMs, scatter).
_KERNELS_FULL_ATTENTION = 45
_KERNELS_LINEAR_ATTENTION = 60 + 3 * (DELTA_RULE_CHUNK - 1)
_KERNELS_LINEAR_ATTENTION_PER_CHUNK = 12
_KERNELS_MLP = 5
_KERNELS_MOE = 25
# Backward also passes over the layer's weight gradients twice: written (accumulated) as the weight-gradient GEMMs
# finish, read by the per-layer squared norm taken on the device (optim/clip.py). On a GPU this is ~0.1% of a
# layer's backward; on the CPU (fp32, skinny GEMMs) ~10%, the gap the other terms leave to the timed layers.
WEIGHT_GRAD_PASSES = 2.0


def layer_compute_terms(
    config: Any, kind: str, B: int, T: int, db: int = 2, attn_impl: str = "sdpa"
) -> dict[str, float]:
    """Forward work of one decoder layer split by compute class (`hardware.COMPUTE_CLASSES`), plus its
    memory-bound bytes and kernel count.

    Returns:
        ``{"gemm", "attention", "linear_attention", "moe"}``: forward FLOPs of each class (backward is 2x);
        ``"memory_fwd"`` / ``"memory_bwd"``: bytes of memory-bound passes (``MEMORY_PASSES_* x A``; backward adds
        ``WEIGHT_GRAD_PASSES x`` the layer's gradient bytes in ``db``);
        ``"kernels"``: eager kernels of the forward.
    """
    m = _dims(config)
    d = m["d"]
    N = B * T
    attn, _, moe = kind.partition("+")
    gemm = attention = linear = experts = 0.0
    if attn == "full_attention":
        q_out = m["hq"] * (2 if gated_attention(config) else 1)
        gemm += 2 * N * d * (q_out + 2 * m["hkv"]) + 2 * N * m["hq"] * d
        attention += 2 * B * m["H"] * T * T * m["hd"]  # QK^T and AV (2 * 2 * B * H * T^2 * hd), causal: halved
        kernels = _KERNELS_FULL_ATTENTION
    else:
        ld = _linear_dims(config)
        C = DELTA_RULE_CHUNK
        Tp = -(-T // C) * C
        gemm += (
            2 * N * d * (ld["conv"] + ld["vd"] + 2 * ld["Hv"]) + 2 * N * ld["vd"] * d + 2 * N * ld["conv"] * ld["K"]
        )
        # chunked delta rule per token and head: intra-chunk kk^T, qk^T, two triangular solves, attn @ v_new,
        # and the state read / update (k_cumdecay @ S, q @ S, k^T @ v_new)
        linear += B * Tp * ld["Hv"] * (C * (5 * ld["dk"] + 3 * ld["dv"]) + 6 * ld["dk"] * ld["dv"])
        kernels = _KERNELS_LINEAR_ATTENTION + _KERNELS_LINEAR_ATTENTION_PER_CHUNK * (Tp // C)
    if moe:
        E = _num_experts(config)
        k = int(config.num_experts_per_tok)
        gemm += 2 * N * d * E  # router
        experts += 6 * N * k * d * int(config.moe_intermediate_size)
        Is = _shared_expert_size(config)
        if Is:
            gemm += 6 * N * d * Is + 2 * N * d
        kernels += _KERNELS_MOE
    else:
        gemm += 6 * N * d * int(config.intermediate_size)
        kernels += _KERNELS_MLP
    A = layer_saved_bytes(config, kind, B, T, db, attn_impl)
    return {
        "gemm": float(gemm),
        "attention": float(attention),
        "linear_attention": float(linear),
        "moe": float(experts),
        "memory_fwd": MEMORY_PASSES_FWD * A,
        "memory_bwd": MEMORY_PASSES_BWD * A + WEIGHT_GRAD_PASSES * layer_param_count(config, kind) * db,
        "kernels": float(kernels),
    }


def layer_forward_flops(config: Any, kind: str, B: int, T: int) -> float:
    """Forward FLOPs of one decoder layer (GEMMs + attention core; norms and elementwise ops neglected)."""
    t = layer_compute_terms(config, kind, B, T)
    return t["gemm"] + t["attention"] + t["linear_attention"] + t["moe"]


def layer_seconds(terms: dict[str, float], hardware: HardwareProfile) -> tuple[float, float]:
    """Forward and backward seconds of one layer from its `layer_compute_terms` on ``hardware``.

    ``f = sum_k F_k / (P eta_k) + memory_fwd / BW_mem + n t_kernel`` over the compute classes ``k``; backward
    ``2 F_k`` per class (dense GEMMs at ``eta_gemm_bwd``, the attention core at ``eta_attention_bwd``),
    ``memory_bwd / BW_mem`` and ``2 n`` kernels.
    Terms whose rate the profile does not model (``BW_mem`` or ``t_kernel`` 0) count nothing.
    """
    hw = hardware
    core = sum(terms[k] / hw.rate(k) for k in ("linear_attention", "moe") if terms[k])
    gemm_f = terms["gemm"] / hw.rate("gemm")
    gemm_b = 2 * terms["gemm"] / hw.rate("gemm_bwd")
    attn_f = terms["attention"] / hw.rate("attention") if terms["attention"] else 0.0
    attn_b = 2 * terms["attention"] / hw.rate("attention_bwd") if terms["attention"] else 0.0
    bw = hw.memory_bytes_per_s
    mem_f = terms["memory_fwd"] / bw if bw else 0.0
    mem_b = terms["memory_bwd"] / bw if bw else 0.0
    k = terms["kernels"] * hw.kernel_overhead_s
    return gemm_f + core + attn_f + mem_f + k, gemm_b + 2 * core + attn_b + mem_b + 2 * k


def head_seconds(
    N: int, d: int, V: int, db: int, loss_chunk_tokens: int, hardware: HardwareProfile, embed_grad_bytes: int = 0
) -> float:
    """Final norm + lm_head + chunked cross entropy, forward and backward, and the embedding's backward.

    GEMMs: ``2 N d V`` forward at the dense rate, ``4 N d V`` backward at the backward rate. Memory-bound per token
    and vocabulary entry (``5 db + 16`` bytes): the logits written by the GEMM and read by logsumexp through an fp32
    upcast (``db + 8``), read again by the backward (``db``), the fp32 gradient written and cast back (``4 + 4 +
    db``), read by the two backward GEMMs (``2 db``). The embedding has no stage of its own: its dense gradient is
    zeroed and scattered into (``2 x embed_grad_bytes``) here. Kernels: ~20 per loss chunk.
    """
    hw = hardware
    t = 2 * N * d * V / hw.rate("gemm") + 4 * N * d * V / hw.rate("gemm_bwd")
    if hw.memory_bytes_per_s:
        t += (N * V * (5 * db + 16) + 2 * embed_grad_bytes) / hw.memory_bytes_per_s
    t += 20 * -(-N // max(1, loss_chunk_tokens)) * hw.kernel_overhead_s
    return t


# ------------------------------------------------------------------------------------------------ cost model
@dataclass
class LayerCost:
    """Costs of one decoder layer for one micro-batch (bytes, FLOP, seconds).

    Args:
        weight_bytes: ``w_i``, compute-dtype weights streamed to the device.
        grad_bytes: ``g_i``, gradient bytes sent device -> host.
        input_bytes: ``x_i = B * T * d * db``, the layer input (all a recomputed layer saves).
        saved_bytes: ``A_i``, what the layer saves for backward under ``keep``.
        flops_fwd: forward FLOPs (backward is 2x).
        fwd_s, bwd_s: forward / backward seconds (``f_i``, ``k_i``); recompute costs ``fwd_s`` again.
        ws_fwd_bytes, ws_bwd_bytes, ws_nosave_bytes: the executor's memory terms (`memmodel`): forward beyond A,
            backward beyond A and g, a forward that saves only its input beyond it.
        optimizer_s: ``o_i``, CPU optimizer seconds for the layer's parameters.
    """

    index: int
    kind: str
    params: int
    weight_bytes: int
    grad_bytes: int
    input_bytes: int
    saved_bytes: int
    flops_fwd: float
    fwd_s: float
    bwd_s: float
    ws_fwd_bytes: int
    ws_bwd_bytes: int
    ws_nosave_bytes: int
    optimizer_s: float

    @property
    def recompute_s(self) -> float:
        return self.fwd_s


@dataclass
class CostModel:
    """Everything the MILP, the baselines and the simulator need about one (model, hardware, batch) triple.

    Build it with `CostModel.from_config`. Embedding and lm_head are kept resident on the device; their updated
    weights are uploaded after the CPU optimizer step (embedding before the next forward, lm_head before the head).
    """

    layers: list[LayerCost]
    hardware: HardwareProfile
    micro_batch_size: int
    seq_len: int
    dtype_bytes: int
    grad_dtype_bytes: int
    loss_chunk_tokens: int
    attn_implementation: str
    model_name: str
    embed_params: int
    head_params: int  # 0 when lm_head is tied to the embedding
    head_flops: float  # final norm + lm_head + cross entropy, forward and backward
    head_s: float  # head forward + backward, and the embedding's backward (it has no stage of its own)
    head_ws_bytes: int  # final norm's graph + chunked loss (memmodel.head_working_set); lm_head grad apart
    config: Any = field(default=None, repr=False)
    measured: bool = False
    serial_lanes: bool = False  # Note: [Serial lanes on the CPU device] (hardware.py): lanes add, never overlap
    inline_copies: bool = False  # the executor copies synchronously (CPU, no simulated lanes): memmodel.copies_inline

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(
        cls,
        config: Any,
        hardware: HardwareProfile | str,
        seq_len: int,
        micro_batch_size: int,
        dtype_bytes: int = 2,
        *,
        grad_dtype_bytes: int | None = None,
        loss_chunk_tokens: int = 1024,
        attn_implementation: str = "sdpa",
        model_name: str | None = None,
    ) -> CostModel:
        """Cost model of ``config`` (an HF config or a zoo config) on ``hardware`` for ``micro_batch_size`` x
        ``seq_len`` tokens in a ``dtype_bytes`` compute dtype."""
        hardware = get_profile(hardware)
        for name, value in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1.")
        if dtype_bytes not in (2, 4):
            raise ValueError(f"dtype_bytes={dtype_bytes!r} must be 2 (bf16/fp16) or 4 (fp32).")
        if loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens={loss_chunk_tokens} must be >= 1 (e.g. 1024).")
        if attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation={attn_implementation!r} is not supported; use one of {ATTN_IMPLEMENTATIONS}."
            )
        config = getattr(config, "config", config)
        gdb = dtype_bytes if grad_dtype_bytes is None else grad_dtype_bytes
        B, T, N = micro_batch_size, seq_len, micro_batch_size * seq_len
        m, gated = _dims(config), gated_attention(config)
        d, V = m["d"], m["V"]
        layers = []
        for i, kind in enumerate(layer_kinds(config)):
            p = layer_param_count(config, kind)
            terms = layer_compute_terms(config, kind, B, T, dtype_bytes, attn_implementation)
            flops = terms["gemm"] + terms["attention"] + terms["linear_attention"] + terms["moe"]
            fwd_s, bwd_s = layer_seconds(terms, hardware)
            eager_probs = B * m["H"] * T * T * FP32 if (attn_implementation == "eager" and "full" in kind) else 0
            A = layer_saved_bytes(config, kind, B, T, dtype_bytes, attn_implementation)
            wf, wb, wn = layer_working_sets(config, kind, N, dtype_bytes, p, gdb, eager_probs, gated, A)
            layers.append(
                LayerCost(
                    index=i,
                    kind=kind,
                    params=p,
                    weight_bytes=p * dtype_bytes,
                    grad_bytes=p * gdb,
                    input_bytes=N * d * dtype_bytes,
                    saved_bytes=A,
                    flops_fwd=flops,
                    fwd_s=fwd_s,
                    bwd_s=bwd_s,
                    ws_fwd_bytes=wf,
                    ws_bwd_bytes=wb,
                    ws_nosave_bytes=wn,
                    optimizer_s=p / hardware.cpu_optimizer_params_per_s,
                )
            )
        tied = bool(_get(config, "tie_word_embeddings", False))
        embed_params = V * d
        head_params = 0 if tied else V * d + d  # lm_head + final norm
        if tied:
            embed_params += d  # final norm rides with the embedding
        head_flops = 3 * 2 * N * d * V  # lm_head forward (2NdV) + backward (4NdV)
        head_ws = head_working_set(N, d, V, loss_chunk_tokens, dtype_bytes)
        cm = cls(
            layers=layers,
            hardware=hardware,
            micro_batch_size=B,
            seq_len=T,
            dtype_bytes=dtype_bytes,
            grad_dtype_bytes=gdb,
            loss_chunk_tokens=loss_chunk_tokens,
            attn_implementation=attn_implementation,
            model_name=model_name or getattr(config, "name", None) or getattr(config, "_name_or_path", "") or "",
            embed_params=embed_params,
            head_params=head_params,
            head_flops=float(head_flops),
            head_s=head_seconds(N, d, V, dtype_bytes, loss_chunk_tokens, hardware, embed_params * gdb),
            head_ws_bytes=int(head_ws),
            config=config,
            serial_lanes=hardware.serial_lanes,
            inline_copies=hardware.serial_lanes and not simulate_async(),
        )
        if hardware.layer_times and hardware.layer_times_shape:
            cm = cm._with_profile_layer_times()
        return cm

    def _with_profile_layer_times(self) -> CostModel:
        b0, t0 = self.hardware.layer_times_shape
        scale = (self.micro_batch_size * self.seq_len) / (b0 * t0)  # layer time is ~ linear in tokens
        fwd, bwd = [], []
        for lc in self.layers:
            measured = self.hardware.layer_times.get(lc.kind)
            fwd.append(measured[0] * scale if measured else lc.fwd_s)
            bwd.append(measured[1] * scale if measured else lc.bwd_s)
        return self.with_measured_times(fwd, bwd)

    def with_measured_times(self, fwd_s: list[float], bwd_s: list[float]) -> CostModel:
        """A copy whose per-layer forward / backward seconds are the measured ones (e.g. from timed warm-up steps).
        Recompute time follows the forward time."""
        L = len(self.layers)
        if len(fwd_s) != L or len(bwd_s) != L:
            raise ValueError(f"with_measured_times: got {len(fwd_s)} fwd and {len(bwd_s)} bwd times for {L} layers.")
        if any(t < 0 for t in [*fwd_s, *bwd_s]):
            raise ValueError("with_measured_times: times must be >= 0 seconds.")
        new = copy.copy(self)
        new.layers = [
            dataclasses.replace(lc, fwd_s=float(f), bwd_s=float(b)) for lc, f, b in zip(self.layers, fwd_s, bwd_s)
        ]
        new.measured = True
        return new

    def with_batch(self, micro_batch_size: int) -> CostModel:
        """The same model and hardware at another micro-batch size (measured times scale with tokens)."""
        new = CostModel.from_config(
            self.config,
            self.hardware,
            self.seq_len,
            micro_batch_size,
            self.dtype_bytes,
            grad_dtype_bytes=self.grad_dtype_bytes,
            loss_chunk_tokens=self.loss_chunk_tokens,
            attn_implementation=self.attn_implementation,
            model_name=self.model_name,
        )
        if self.measured:
            s = micro_batch_size / self.micro_batch_size
            new = new.with_measured_times([lc.fwd_s * s for lc in self.layers], [lc.bwd_s * s for lc in self.layers])
        for k in ("state_nvme", "accumulation_steps", "stream_embeddings"):
            setattr(new, k, getattr(self, k))
        return new

    # ------------------------------------------------------------------ training state on NVMe, step shape
    state_nvme: frozenset = frozenset()  # decoder layers whose training state is on NVMe (`with_state_nvme`)
    accumulation_steps: int = 1  # micro-batches per optimizer step (memmodel.with_accumulation, carried_grad_bytes)
    stream_embeddings: bool = False  # plans stream the embedding and head (memmodel.with_streamed_embeddings)

    def with_state_nvme(self, keys) -> CostModel:
        """A copy in which the decoder layers ``keys`` keep their training state on NVMe
        (`lazytrain_hf.streaming.nvmestate`): each weight fetch also reads the compute copy from NVMe, the gradients
        are written to NVMe, and the layer's optimizer step streams its state (`state_io_bytes`), so it lasts
        ``max(o_i, reads / BW_nvme_r + writes / BW_nvme_w)`` (the chunked step overlaps its compute and its I/O).
        The MILP never keeps such a layer resident."""
        new = copy.copy(self)
        new.state_nvme = frozenset(int(k) for k in keys if 0 <= int(k) < len(self.layers))
        return new

    def state_io_bytes(self, i: int) -> tuple[int, int, int]:
        """``(gradient bytes per micro-batch, optimizer reads, optimizer writes)`` of layer ``i`` with its state on
        NVMe: the fp32 gradient (4 B/param) written per micro-batch; per step the master, gradient and 8-bit moments
        in (10 B/param + block scales) and the master, moments and compute copy out (6 B/param + scales + w_i)."""
        from .layouts import update_bytes

        lc = self.layers[i]
        reads, writes = update_bytes([(lc.params, None, True)], lc.weight_bytes)  # the layer as one 8-bit tensor
        return 4 * lc.params, reads, writes

    def optimizer_s_of(self, i: int) -> float:
        """Layer ``i``'s optimizer seconds: ``o_i``, or its state I/O where that is longer (state on NVMe)."""
        lc = self.layers[i]
        if i not in self.state_nvme:
            return lc.optimizer_s
        _, r, w = self.state_io_bytes(i)
        return max(lc.optimizer_s, r / self.nvme_r + w / self.nvme_w)

    # ------------------------------------------------------------------ derived terms
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_len

    @property
    def embed_bytes(self) -> int:
        return self.embed_params * self.dtype_bytes

    @property
    def head_bytes(self) -> int:
        return self.head_params * self.dtype_bytes

    @property
    def embed_grad_bytes(self) -> int:
        return self.embed_params * self.grad_dtype_bytes

    @property
    def head_grad_bytes(self) -> int:
        return self.head_params * self.grad_dtype_bytes

    @property
    def embed_optimizer_s(self) -> float:
        return self.embed_params / self.hardware.cpu_optimizer_params_per_s

    @property
    def head_optimizer_s(self) -> float:
        return self.head_params / self.hardware.cpu_optimizer_params_per_s

    @property
    def total_params(self) -> int:
        return sum(lc.params for lc in self.layers) + self.embed_params + self.head_params

    @property
    def fixed_device_bytes(self) -> int:
        """Always on the device: the resident embedding and lm_head (+ final norm)."""
        return self.embed_bytes + self.head_bytes

    @property
    def host_state_bytes(self) -> int:
        """Peak host memory of a run besides its pinned activation buffers (`lazytrain_hf.planner.hostmem`): fp32
        masters, compute copy, fp32 grads, 8-bit moments and their scales, resident parameters' gradient copies,
        gradient staging and the checkpoint-save transient (the larger of the step and save peaks), every parameter
        trainable, embeddings resident (`hostmem.counts_footprint`)."""
        from .hostmem import counts_footprint

        fp = counts_footprint([lc.params for lc in self.layers], self.embed_params, self.head_params, self.dtype_bytes)
        return int(max(fp.total, fp.save_peak) - fp.activations)

    @property
    def model_flops(self) -> float:
        """Useful FLOPs of one step (forward + backward of layers and head; recomputation not counted)."""
        return 3 * sum(lc.flops_fwd for lc in self.layers) + self.head_flops

    @property
    def h2d(self) -> float:
        return self.hardware.h2d_bytes_per_s

    @property
    def d2h(self) -> float:
        return self.hardware.d2h_bytes_per_s

    @property
    def nvme_r(self) -> float:
        return self.hardware.nvme_read_bytes_per_s

    @property
    def nvme_w(self) -> float:
        return self.hardware.nvme_write_bytes_per_s

    def summary(self) -> str:
        L = self.num_layers
        A = sum(lc.saved_bytes for lc in self.layers) / L
        w = sum(lc.weight_bytes for lc in self.layers) / L
        f = sum(lc.fwd_s for lc in self.layers) / L
        return (
            f"{self.model_name or 'model'}: {L} layers, {self.total_params / 1e9:.2f}B params, B={self.micro_batch_size} "
            f"T={self.seq_len}; per layer: w={w / 2**20:.0f}MiB A={A / 2**20:.0f}MiB f={f * 1e3:.2f}ms "
            f"w/BW_h2d={w / self.h2d * 1e3:.2f}ms"
        )


def inner_width(config: Any, kind: str) -> int:
    """Width of the widest per-token intermediate (MLP / expert intermediate size)."""
    if "+moe" in kind:
        return int(config.moe_intermediate_size)
    return int(config.intermediate_size)
