"""`HybridAdamW8bit`: CPU AdamW with fp32 master weights, block-wise 8-bit moments and the clip folded in.

The optimizer holds the bookkeeping (parameter groups, per-parameter state, state dicts); the math is the pure step
function in `kernels.py`, the state type is `Quantized8bit` in `quant.py`.

Thresholds follow bitsandbytes' block-wise 8-bit optimizers: blocks of 256 elements, and tensors under 4096
elements (norms, biases) keep fp32 moments, where 8-bit codes would save little and cost precision.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .kernels import AdamWScalars, adamw8bit_step, adamw32_step, resolve_backend, warm_up
from .quant import Quantized8bit, num_blocks

# Keys under which a `Quantized8bit` moment is flattened into plain tensors in `state_dict()`.
_Q_KEYS = ("exp_avg", "exp_avg_sq")
_Q_FLAT_KEYS = frozenset(f"{q}_{part}" for q in _Q_KEYS for part in ("codes", "absmax"))
_MAX_BLOCK_SIZE = 4096
# Layout version of `state_dict()`, stored under this key. 1 (no key, before issue #14): a positive exp_avg_sq could
# be stored as code 0; 2: it never is (Note: [A non-zero second moment keeps a non-zero code] in quant.py).
STATE_FORMAT = 2
FORMAT_KEY = "hybrid8bit_format"


class HybridAdamW8bit(torch.optim.Optimizer):
    """AdamW on host (CPU) fp32 parameters with 8-bit first and second moments, one fused pass per block.

    Each tensor of at least ``min_8bit_size`` elements keeps its moments as `Quantized8bit` (signed dynamic map for
    ``exp_avg``, unsigned for ``exp_avg_sq``, one fp32 absmax per ``block_size`` elements): about
    ``2 + 8 / block_size`` bytes of state per parameter instead of 8. Smaller tensors keep fp32 moments.

    Sparse gradients (embedding rows of tokens absent from a batch): a positive ``exp_avg_sq`` never rounds to
    zero (Note: [A non-zero second moment keeps a non-zero code] in quant.py), so with weight decay off no element
    steps more than 2 x lr (AdamW: ~1 x lr; measured up to 1.84 x lr on adversarial gradients, tested in
    tests/test_optim_sparse.py). An element whose ``v`` is under 1.6e-7 of its block's maximum steps less than
    with AdamW, since its ``v`` rounds up to the smallest non-zero code.

    Args:
        params (`Iterable`):
            Parameters or parameter groups, as for any `torch.optim.Optimizer`. Parameters must be float32 CPU
            tensors (the fp32 master copy). A flat per-layer master buffer (a plain tensor whose ``.grad`` is set to
            the flat gradient buffer) is a valid parameter.
        lr (`float`, *optional*, defaults to 1e-3):
            Learning rate; read from each group at every step, so LR schedulers work.
        betas (`tuple[float, float]`, *optional*, defaults to `(0.9, 0.999)`):
            Moment decay rates.
        eps (`float`, *optional*, defaults to 1e-8):
            Added to the bias-corrected ``sqrt(v)``.
        weight_decay (`float`, *optional*, defaults to 0.0):
            Decoupled weight decay (per group, so a no-decay group for norms and biases works).
        block_size (`int`, *optional*, defaults to 256):
            Elements per quantisation block (16 to 4096).
        min_8bit_size (`int`, *optional*, defaults to 4096):
            Tensors with fewer elements keep fp32 moments.
        backend (`str`, *optional*):
            ``"numba"`` (fused multi-threaded kernel) or ``"torch"`` (pure-torch fallback). Defaults to
            ``$LAZYTRAIN_OPTIM_BACKEND``, else numba when importable.

    Example:

    ```python
    >>> opt = HybridAdamW8bit(model.parameters(), lr=1e-4, weight_decay=0.01)
    >>> norm = global_norm(partial_sq_norms(p.grad for p in model.parameters()))
    >>> if norm_is_finite(norm):
    ...     opt.step(clip_coef=clip_coefficient(norm, max_norm=1.0))
    ```
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        block_size: int = 256,
        min_8bit_size: int = 4096,
        backend: str | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "block_size": block_size,
            "min_8bit_size": min_8bit_size,
        }
        _check_hyperparameters(defaults, where="HybridAdamW8bit")
        self.backend = resolve_backend(backend)
        super().__init__(params, defaults)
        if self.backend == "numba":
            warm_up()

    # ------------------------------------------------------------------------------------------------------------
    # groups and state
    # ------------------------------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        _check_hyperparameters(group, where=f"param_groups[{index}]")
        for i, p in enumerate(group["params"]):
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise TypeError(
                    f"HybridAdamW8bit updates float32 CPU master weights; {self._param_name(group, i)} is "
                    f"{p.dtype} on {p.device}. Keep an fp32 host copy of the weights and pass that."
                )

    def _param_name(self, group: dict[str, Any], i: int) -> str:
        names = group.get("param_names")
        gi = next((k for k, g in enumerate(self.param_groups) if g is group), len(self.param_groups))
        shape = tuple(group["params"][i].shape)
        label = f"param_groups[{gi}]['params'][{i}] (shape {shape})"
        return f"'{names[i]}' {label}" if names else label

    @staticmethod
    def _uses_8bit(p: torch.Tensor, group: dict[str, Any]) -> bool:
        return p.numel() >= group["min_8bit_size"]

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = 0
        if self._uses_8bit(p, group):
            state["exp_avg"] = Quantized8bit.zeros(p.numel(), group["block_size"], signed=True)
            state["exp_avg_sq"] = Quantized8bit.zeros(p.numel(), group["block_size"], signed=False)
        else:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return state

    def state_bytes(self) -> int:
        """Optimizer-state bytes of all parameters (codes, absmax and fp32 moments; the step counter excluded).

        Counts the layout every parameter has once stepped, whether or not it has been stepped yet.
        """
        total = 0
        for group in self.param_groups:
            for p in group["params"]:
                n = p.numel()
                if self._uses_8bit(p, group):
                    total += 2 * (n + 4 * num_blocks(n, group["block_size"]))
                else:
                    total += 2 * 4 * n
        return total

    def state_bytes_per_param(self) -> float:
        """`state_bytes()` divided by the number of parameter elements: ``2 + 8 / block_size`` for 8-bit tensors."""
        n = sum(p.numel() for group in self.param_groups for p in group["params"])
        return self.state_bytes() / n if n else 0.0

    # ------------------------------------------------------------------------------------------------------------
    # stepping
    # ------------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, clip_coef: float | None = None) -> float | None:
        """Update every parameter that has a gradient.

        Args:
            closure (`Callable`, *optional*):
                Re-evaluates the model and returns the loss (run with gradients enabled).
            clip_coef (`float`, *optional*):
                Gradient scale applied inside the fused pass, usually `clip_coefficient(norm, max_norm)`.

        Returns:
            The closure's loss, if a closure was given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        clip = _check_clip(clip_coef)
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                self._update(p, group, i, clip, None)
        return loss

    @torch.no_grad()
    def step_group(
        self,
        group_index: int,
        clip_coef: float | None = None,
        out_bf16: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """Update the parameters of one group (e.g. one layer), optionally writing their bf16 compute copy.

        Args:
            group_index (`int`): index into `param_groups`.
            clip_coef (`float`, *optional*): gradient scale folded into the pass.
            out_bf16 (`torch.Tensor` or sequence, *optional*):
                Where to write the updated weights in bfloat16 in the same pass. Either one contiguous bf16 tensor
                holding the group's parameters back to back in order (a flat per-layer compute buffer), or one
                tensor (or `None`) per parameter.
        """
        if not isinstance(group_index, int) or not 0 <= group_index < len(self.param_groups):
            raise ValueError(
                f"group_index={group_index!r} is not a parameter group; use 0..{len(self.param_groups) - 1}."
            )
        group = self.param_groups[group_index]
        outs = _split_out(out_bf16, group["params"], f"step_group({group_index})")
        clip = _check_clip(clip_coef)
        for i, p in enumerate(group["params"]):
            self._update(p, group, i, clip, outs[i])

    @torch.no_grad()
    def step_params(
        self,
        params: Sequence[torch.Tensor],
        clip_coef: float | None = None,
        out_bf16: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """Update only ``params`` (each with its own group's hyperparameters), in the order given.

        ``out_bf16`` is laid out as in `step_group`, over ``params``.
        """
        params = list(params)
        where = {id(p): (group, i) for group in self.param_groups for i, p in enumerate(group["params"])}
        outs = _split_out(out_bf16, params, "step_params")
        clip = _check_clip(clip_coef)
        for k, p in enumerate(params):
            if id(p) not in where:
                raise ValueError(
                    f"step_params: params[{k}] (shape {tuple(p.shape)}) is not managed by this optimizer; pass "
                    f"tensors from its param_groups."
                )
            group, i = where[id(p)]
            self._update(p, group, i, clip, outs[k])

    def _update(
        self, p: torch.Tensor, group: dict[str, Any], i: int, clip: float, out_bf16: torch.Tensor | None
    ) -> None:
        grad = p.grad
        if grad is None:
            return
        if grad.is_sparse or grad.dtype != torch.float32 or grad.shape != p.shape or grad.device.type != "cpu":
            raise TypeError(
                f"{self._param_name(group, i)} has a {grad.dtype} gradient of shape {tuple(grad.shape)} on "
                f"{grad.device}{' (sparse)' if grad.is_sparse else ''}; HybridAdamW8bit needs a dense float32 CPU "
                f"gradient of the parameter's shape."
            )
        if out_bf16 is not None and (
            out_bf16.dtype != torch.bfloat16 or out_bf16.numel() != p.numel() or not out_bf16.is_contiguous()
        ):
            raise ValueError(
                f"out_bf16 for {self._param_name(group, i)} must be a contiguous bfloat16 tensor of {p.numel()} "
                f"elements; got {out_bf16.dtype} with {out_bf16.numel()} elements."
            )
        state = self.state[p] if self.state.get(p) else self._init_state(p, group)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        scalars = AdamWScalars.make(
            group["lr"], beta1, beta2, group["eps"], group["weight_decay"], state["step"], clip
        )
        # Note: [Flat views] the kernels work on flat contiguous tensors; a non-contiguous parameter is updated
        # through a contiguous copy that is written back (rare: optimizer-managed tensors are normally contiguous).
        contiguous = p.is_contiguous()
        flat_p = p.view(-1) if contiguous else p.contiguous().view(-1)
        flat_g = grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().view(-1)
        flat_out = out_bf16.view(-1) if out_bf16 is not None else None
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if isinstance(m, Quantized8bit):
            adamw8bit_step(flat_p, flat_g, m, v, scalars, flat_out, self.backend)
        else:
            adamw32_step(flat_p, flat_g, m.view(-1), v.view(-1), scalars, flat_out)
        if not contiguous:
            p.copy_(flat_p.view_as(p))

    # ------------------------------------------------------------------------------------------------------------
    # state dicts
    # ------------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """As `torch.optim.Optimizer.state_dict`, with each 8-bit moment as two plain tensors.

        ``exp_avg`` becomes ``exp_avg_codes`` (uint8) and ``exp_avg_absmax`` (float32), likewise ``exp_avg_sq``,
        so the dict holds only tensors, ints and floats (loadable with ``torch.load(weights_only=True)``). Like
        torch's, the returned tensors are the live state, not copies. ``sd["hybrid8bit_format"]`` is the layout
        version (`STATE_FORMAT`).
        """
        sd = super().state_dict()
        packed: dict[Any, Any] = {}
        for key, entry in sd["state"].items():
            out = {}
            for name, value in entry.items():
                if isinstance(value, Quantized8bit):
                    out[f"{name}_codes"] = value.codes
                    out[f"{name}_absmax"] = value.absmax
                else:
                    out[name] = value
            packed[key] = out
        sd["state"] = packed
        sd[FORMAT_KEY] = STATE_FORMAT
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict()`; codes, scales and steps are restored bit for bit (as copies).

        A state dict of format 1 (saved before the non-zero rule for ``exp_avg_sq``; it has no
        ``"hybrid8bit_format"`` key) is converted, with a warning: where ``exp_avg`` is non-zero but ``exp_avg_sq``
        was stored as code 0, the true ``exp_avg_sq`` was positive (some gradient was non-zero), so it takes code 1,
        the code the current rule gives such a value. Its next step is then bounded instead of ``lr * m_hat / eps``.

        Raises:
            ValueError: when the groups do not match, or a parameter's saved moments have the wrong shape, number
                of codes or number of blocks for its size (the message names the parameter), or the state dict
                comes from a newer format.
        """
        fmt = state_dict.get(FORMAT_KEY, 1)
        if isinstance(fmt, bool) or not isinstance(fmt, int) or not 1 <= fmt <= STATE_FORMAT:
            raise ValueError(
                f"load_state_dict: {FORMAT_KEY}={fmt!r}; this version of lazytrain_hf reads formats 1 to "
                f"{STATE_FORMAT}. The state dict was written by a newer lazytrain_hf: upgrade it to resume."
            )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"load_state_dict: the state dict has {len(saved_groups)} parameter groups, this optimizer "
                f"{len(self.param_groups)}; build the optimizer with the same groups as the one that was saved."
            )
        # torch.optim casts every floating state tensor to the parameter dtype: the uint8 codes must bypass that.
        plain_state: dict[Any, Any] = {}
        quantized: dict[Any, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for key, entry in state_dict["state"].items():
            plain_state[key] = {k: v for k, v in entry.items() if k not in _Q_FLAT_KEYS}
            quantized[key] = {q: (entry[f"{q}_codes"], entry[f"{q}_absmax"]) for q in _Q_KEYS if f"{q}_codes" in entry}
        positions = {}
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(
                    f"load_state_dict: param_groups[{gi}] has {len(group['params'])} parameters here and "
                    f"{len(saved['params'])} in the state dict; build the optimizer with the same groups."
                )
            _check_hyperparameters(saved, where=f"state dict param_groups[{gi}]")
            for i, (p, key) in enumerate(zip(group["params"], saved["params"])):
                positions[key] = (group, saved, i, p)
        for key, (group, saved, i, p) in positions.items():
            if key in state_dict["state"]:
                self._check_saved_entry(p, group, saved, i, plain_state[key], quantized[key])
        super().load_state_dict({"state": plain_state, "param_groups": saved_groups})
        raised = 0
        for key, (_, saved, _, p) in positions.items():
            if key not in state_dict["state"]:
                continue
            state = self.state[p]
            for q, (codes, absmax) in quantized[key].items():
                state[q] = Quantized8bit(
                    codes.detach().to("cpu", copy=True),
                    absmax.detach().to("cpu", torch.float32, copy=True),
                    saved["block_size"],
                    signed=q == "exp_avg",
                )
            for q in _Q_KEYS:
                if isinstance(state.get(q), torch.Tensor):
                    state[q] = state[q].detach().clone()
            state["step"] = int(state["step"])
            if fmt == 1 and isinstance(state.get("exp_avg_sq"), Quantized8bit):
                m, v = state["exp_avg"], state["exp_avg_sq"]
                lost = (v.codes == v.lookup.zero_code) & (m.codes != m.lookup.zero_code)
                raised += int(lost.sum())
                v.codes[lost] = v.lookup.zero_code + 1
        if raised:
            warnings.warn(
                f"load_state_dict: converted a format-1 HybridAdamW8bit state: {raised} elements with a non-zero "
                f"exp_avg had exp_avg_sq stored as 0 (issue #14) and now take its smallest non-zero code.",
                stacklevel=2,
            )

    def _check_saved_entry(
        self,
        p: torch.Tensor,
        group: dict[str, Any],
        saved: dict[str, Any],
        i: int,
        plain: dict[str, Any],
        quantized: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        name = self._param_name(group, i)
        n = p.numel()
        eight_bit = n >= saved["min_8bit_size"]
        if "step" not in plain:
            raise ValueError(f"load_state_dict: the saved state of {name} has no 'step'.")
        for q in _Q_KEYS:
            if eight_bit:
                if q not in quantized:
                    raise ValueError(
                        f"load_state_dict: {name} has {n} elements (>= min_8bit_size={saved['min_8bit_size']}) "
                        f"but its saved '{q}' is not 8-bit; the state dict belongs to a different model or settings."
                    )
                codes, absmax = quantized[q]
                blocks = num_blocks(n, saved["block_size"])
                if codes.dtype != torch.uint8 or codes.shape != (n,) or absmax.shape != (blocks,):
                    raise ValueError(
                        f"load_state_dict: saved '{q}' of {name} has codes {tuple(codes.shape)} {codes.dtype} and "
                        f"absmax {tuple(absmax.shape)}; expected ({n},) uint8 and ({blocks},) for blocks of "
                        f"{saved['block_size']}. The state dict belongs to a different model or block_size."
                    )
            else:
                value = plain.get(q)
                if not isinstance(value, torch.Tensor) or value.shape != p.shape:
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ValueError(
                        f"load_state_dict: saved '{q}' of {name} is {got}; expected an fp32 tensor of shape "
                        f"{tuple(p.shape)}. The state dict belongs to a different model or min_8bit_size."
                    )

    def __repr__(self) -> str:
        # torch prints "Name (\n<groups>)"; name the kernel backend first so logs show which path ran.
        return super().__repr__().replace(" (\n", f" (\nbackend: {self.backend}\n", 1)


def _check_hyperparameters(group: dict[str, Any], where: str) -> None:
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor) or not isinstance(lr, int | float) or not lr >= 0:
        raise ValueError(f"{where}: lr={lr!r} must be a non-negative float (e.g. 1e-4).")
    betas = group.get("betas")
    if (
        not isinstance(betas, tuple | list)
        or len(betas) != 2
        or not all(isinstance(b, int | float) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ValueError(f"{where}: betas={betas!r} must be two floats in [0, 1), e.g. (0.9, 0.999).")
    eps = group.get("eps")
    if not isinstance(eps, int | float) or not eps > 0:
        raise ValueError(f"{where}: eps={eps!r} must be a positive float (e.g. 1e-8).")
    wd = group.get("weight_decay")
    if not isinstance(wd, int | float) or not wd >= 0:
        raise ValueError(f"{where}: weight_decay={wd!r} must be a non-negative float (e.g. 0.01).")
    bs = group.get("block_size")
    if isinstance(bs, bool) or not isinstance(bs, int) or not 16 <= bs <= _MAX_BLOCK_SIZE:
        raise ValueError(
            f"{where}: block_size={bs!r} must be an int in [16, {_MAX_BLOCK_SIZE}]; 256 is bitsandbytes' default."
        )
    m8 = group.get("min_8bit_size")
    if isinstance(m8, bool) or not isinstance(m8, int) or m8 < 1:
        raise ValueError(f"{where}: min_8bit_size={m8!r} must be a positive int (4096 as in bitsandbytes).")


def _check_clip(clip_coef: float | None) -> float:
    if clip_coef is None:
        return 1.0
    if isinstance(clip_coef, torch.Tensor):
        clip_coef = float(clip_coef)
    if not isinstance(clip_coef, int | float) or not math.isfinite(clip_coef) or clip_coef < 0:
        raise ValueError(
            f"clip_coef={clip_coef!r} must be a finite non-negative float; when the gradient norm is inf/nan "
            f"(see norm_is_finite) skip the step instead of calling it."
        )
    return float(clip_coef)


def _split_out(
    out_bf16: torch.Tensor | Sequence[torch.Tensor | None] | None, params: Sequence[torch.Tensor], where: str
) -> list[torch.Tensor | None]:
    if out_bf16 is None:
        return [None] * len(params)
    if isinstance(out_bf16, torch.Tensor):
        total = sum(p.numel() for p in params)
        if out_bf16.dtype != torch.bfloat16 or out_bf16.numel() != total or not out_bf16.is_contiguous():
            raise ValueError(
                f"{where}: out_bf16 must be a contiguous bfloat16 tensor of {total} elements (the parameters back "
                f"to back); got {out_bf16.dtype} with {out_bf16.numel()} elements."
            )
        flat = out_bf16.view(-1)
        outs, offset = [], 0
        for p in params:
            outs.append(flat[offset : offset + p.numel()])
            offset += p.numel()
        return outs
    outs = list(out_bf16)
    if len(outs) != len(params):
        raise ValueError(
            f"{where}: out_bf16 has {len(outs)} entries for {len(params)} parameters; pass one per parameter or "
            f"a single flat bfloat16 tensor."
        )
    return outs
