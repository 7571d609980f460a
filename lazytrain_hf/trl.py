"""TRL support: `LazySFTConfig` and `LazySFTTrainer`, TRL's `SFTTrainer` trained through LazyTrain's streaming path.

Needs the optional extra: ``pip install 'lazytrain-hf[trl]'`` (trl>=1.16). ``import lazytrain_hf`` never imports trl;
``from lazytrain_hf import LazySFTTrainer`` without it raises an ImportError naming that command.

What `LazySFTTrainer` takes from each side (everything not listed is inherited unchanged):

- from `trl.SFTTrainer`: model loading by id, PEFT wrapping, the chat template, tokenization, completion-only and
  assistant-only labels, packing, the data collator, `evaluate()`'s dataset preparation, the model card and the logs
  (`mean_token_accuracy`, `entropy`, `num_tokens`, averaged per log as `SFTTrainer.log` does);
- from `LazyTrainer`: planning, layer streaming, `HybridAdamW8bit`, fused clipping, atomic checkpoints, the
  throughput logs and the chunked causal-LM loss (`StreamHandle.causal_lm_loss`; only one chunk of logits exists).

While streaming, `SFTTrainer.compute_loss` (TRL's fused LM head, tiles of 32768 tokens outside the plan's memory
accounting) is replaced by the chunked loss, and the statistics it logs are recomputed chunk by chunk from the final
hidden states and the lm_head weight (`token_statistics`), never holding ``B x T x V`` logits. That costs one more
lm_head forward (no graph) over the tokens that have a target: ``2 x D x V`` FLOPs per scored token, about 2% of a
7B model's step. Not logged while streaming: TRL's `aux_loss` (MoE load balancing; the chunked loss adds it to the
loss without returning it). `SFTTrainer`'s own path is kept where the chunked loss does not apply: streaming off,
``return_outputs=True``, label smoothing, a ``compute_loss_func`` (as in `LazyTrainer`); `loss_type="dft"` is refused
while streaming (`LazySFTConfig`).
"""

from __future__ import annotations

TRL_INSTALL_HINT = "pip install 'lazytrain-hf[trl]'"
TRL_MIN_VERSION = "1.16"

# Checked first, so a missing trl is reported before anything heavy is imported.
try:
    import trl
    from trl import SFTConfig, SFTTrainer
    from trl.trainer.utils import create_model_from_path, get_config_model_id
except ImportError as e:  # trl missing, or a trl without these names
    raise ImportError(
        f"lazytrain_hf.LazySFTTrainer and LazySFTConfig need TRL >= {TRL_MIN_VERSION}: {TRL_INSTALL_HINT}"
    ) from e

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from packaging.version import Version  # noqa: E402
from transformers import TrainingArguments  # noqa: E402
from transformers.utils import logging  # noqa: E402

from . import models  # noqa: E402
from .args import LazyTrainingArguments  # noqa: E402
from .trainer import LazyTrainer  # noqa: E402
from .training.contract import custom_forward  # noqa: E402
from .training.planning import unwrap_base  # noqa: E402

if Version(trl.__version__) < Version(TRL_MIN_VERSION):
    raise ImportError(
        f"lazytrain_hf.LazySFTTrainer needs TRL >= {TRL_MIN_VERSION} (found {trl.__version__}): {TRL_INSTALL_HINT}"
    )

logger = logging.get_logger(__name__)

# Note: [SFT defaults LazySFTConfig changes]
# activation_checkpointing (and its deprecated alias gradient_checkpointing), on in SFTConfig: HF checkpointing
# re-enters the decoder layers during backward; the executor refuses a model that has it on (`attach` raises) and
# recomputes by plan policy instead. Off by default and refused while streaming; an upgraded SFTConfig has it turned
# off, with a warning. transformers 5.24 resolves the alias into `activation_checkpointing` and mirrors it back, so an
# upgrade resets both (None: off). SFTConfig's bf16 rule (True unless fp16) is kept: while streaming, an fp32 model
# then computes with a bf16 copy and keeps fp32 masters on the host (`LazyTrainer`).
_CHECKPOINTING_OFF = {"gradient_checkpointing": None, "activation_checkpointing": None}


@dataclass
class LazySFTConfig(SFTConfig, LazyTrainingArguments):
    r"""
    Configuration for `LazySFTTrainer`: every field of `trl.SFTConfig` and of `LazyTrainingArguments`, with their
    defaults, so TRL's SFT options and LazyTrain's options can be set on one object.

    > SFT (`trl.SFTConfig`, trl 1.16): model loading (`model_init_kwargs`, `chat_template_path`, ...), data
    preprocessing (`dataset_text_field`, `max_length` (1024), `packing`, `padding_free`, ...) and training
    (`completion_only_loss` (None: on for prompt-completion data), `assistant_only_loss` (False), `loss_type` ("nll"),
    `activation_offloading`), as `SFTConfig` documents them. SFT's own `TrainingArguments` defaults are kept:
    `learning_rate=2e-5`, `logging_steps=10`, `bf16` on unless `fp16`.

    > LazyTrain (`LazyTrainingArguments`): the streaming (`stream_*`), planner (`planner_*`), activations
    (`activation_*`) and optimizer (`optim_*`) groups, as `LazyTrainingArguments` documents them.

    Checks (with ``stream_enabled=True``; each a ValueError naming the option and the fix):
    `gradient_checkpointing=True` (use the planner's recompute policies), `activation_offloading=True` (use
    `activation_tiers`), `loss_type="dft"` (the chunked loss computes the NLL).

    Changed `SFTConfig` default (Note: [SFT defaults LazySFTConfig changes] in this module):
    `activation_checkpointing` / `gradient_checkpointing` are off (SFTConfig: on); the executor recomputes activations
    by plan policy instead. SFTConfig's `bf16` rule (`True` unless `fp16`) is kept: streamed, an fp32 model computes
    with a bf16 copy and fp32 masters.
    """

    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Deprecated alias of activation_checkpointing (off by default, unlike SFTConfig: streaming "
            "recomputes by plan policy and refuses HF checkpointing)."
        },
    )

    def __post_init__(self):
        # SFTConfig's checks; through the MRO they call LazyTrainingArguments' and TrainingArguments' first.
        super().__post_init__()
        if not self.stream_enabled:
            return
        if self.gradient_checkpointing:  # TrainingArguments mirrors activation_checkpointing into it
            raise ValueError(
                "activation_checkpointing=True (or gradient_checkpointing=True) with stream_enabled=True: the "
                "streaming executor refuses HF activation checkpointing and recomputes activations by plan policy "
                "instead; leave both unset (the planner picks 'recompute' where memory needs it), or set "
                "stream_enabled=False."
            )
        if self.activation_offloading:
            raise ValueError(
                "activation_offloading=True with stream_enabled=True: the streaming executor places saved activations "
                "itself; set activation_offloading=False and use activation_tiers=['gpu', 'cpu'] (the default), or "
                "stream_enabled=False."
            )
        if self.loss_type == "dft":
            raise ValueError(
                "loss_type='dft' with stream_enabled=True: the chunked loss computes the negative log-likelihood "
                "only; use loss_type='nll', or stream_enabled=False to train with TRL's DFT loss."
            )


def as_lazy_sft_config(args: TrainingArguments) -> LazySFTConfig:
    """Upgrade a `TrainingArguments` (an `SFTConfig`, a `LazyTrainingArguments`, ...) to `LazySFTConfig`: every field
    it has is kept, the others take their defaults, except that activation checkpointing (SFTConfig's default) is
    turned off, with a warning, when it streams (Note: [SFT defaults LazySFTConfig changes])."""
    if isinstance(args, LazySFTConfig):
        return args
    overrides: dict[str, Any] = {}
    if getattr(args, "stream_enabled", True) and any(getattr(args, name, None) for name in _CHECKPOINTING_OFF):
        fields = {f.name for f in dataclasses.fields(LazySFTConfig)}
        overrides = {k: v for k, v in _CHECKPOINTING_OFF.items() if k in fields}
        logger.warning(
            "LazySFTTrainer: activation (gradient) checkpointing turned off: the streaming executor recomputes "
            "activations by plan policy instead (Note: [SFT defaults LazySFTConfig changes] in lazytrain_hf/trl.py)."
        )
    return LazySFTConfig.from_training_arguments(args, **overrides)


@torch.no_grad()
def token_statistics(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = 1024,
    ignore_index: int = -100,
    lm_head_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counts behind SFT's logs, computed chunk by chunk like `chunked_causal_lm_loss` (one chunk of logits at a time).

    Args:
        hidden_states: ``(B, T, D)`` final hidden states (after the final norm).
        lm_head_weight: ``(V, D)`` lm_head weight.
        labels: ``(B, T')`` labels, shifted left inside as in the loss. ``T' < T`` (a prompt-learning adapter's virtual
            tokens come first) is padded on the left with ``ignore_index``, as PEFT pads the labels.
        chunk_tokens: scored tokens per chunk.
        ignore_index: label value that is not scored.
        lm_head_bias: optional ``(V,)`` bias.

    Returns:
        ``(num_valid, num_correct, entropy_sum)`` as device tensors: the tokens with a target, those whose target is
        the first arg-max of the logits (`trl`'s ``is_top1``), and the sum over them of the next-token distribution's
        entropy in nats (fp32 logits, as TRL's fused head).
    """
    B, T, D = hidden_states.shape
    if labels.shape[1] < T:
        labels = F.pad(labels, (T - labels.shape[1], 0), value=ignore_index)
    dev = hidden_states.device
    target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1).to(dev)
    valid = target != ignore_index
    # only positions with a target are scored (prompt tokens of completion-only data cost nothing)
    h, y = hidden_states.reshape(-1, D)[valid], target[valid]
    correct = torch.zeros((), dtype=torch.int64, device=dev)
    entropy = torch.zeros((), dtype=torch.float32, device=dev)
    for s in range(0, h.shape[0], chunk_tokens):
        z = F.linear(h[s : s + chunk_tokens], lm_head_weight, lm_head_bias).float()
        correct += (z.argmax(-1) == y[s : s + chunk_tokens]).sum()
        logp = torch.log_softmax(z, dim=-1)
        del z
        entropy -= (logp.exp() * logp).sum()
        del logp
    return valid.sum(), correct, entropy


@contextlib.contextmanager
def _final_hidden(module: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the outputs of ``module`` (the final norm: its output is the last hidden state) while inside."""
    seen: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda m, args, out: seen.append(out.detach()))
    try:
        yield seen
    finally:
        handle.remove()


class LazySFTTrainer(LazyTrainer, SFTTrainer):
    """`trl.SFTTrainer` streamed by LazyTrain: SFT's data handling, logs and defaults, LazyTrain's streaming path.

    The MRO is ``LazySFTTrainer -> LazyTrainer -> SFTTrainer -> Trainer``: LazyTrain's overrides (`train`,
    `create_optimizer`, clipping, `evaluate`, saving, `log`) run first and reach SFT's through ``super()`` (SFT's
    metrics are added to the logs, its model card written with each checkpoint). The other order would run
    `SFTTrainer.compute_loss` (the fused head) instead of the chunked loss. The one method joined here is
    `compute_loss` (see the module docstring). With ``stream_enabled=False`` it is `SFTTrainer` (with
    `HybridAdamW8bit` when ``optim_hybrid_8bit=True``).

    Args are `SFTTrainer`'s. `args` may be a `LazySFTConfig`, or any `TrainingArguments` (an `SFTConfig` included),
    which is upgraded (`as_lazy_sft_config`); `None` gives ``LazySFTConfig("<model name>-SFT")`` as SFTTrainer does.
    A model id is loaded on the host when streaming (SFTTrainer would dispatch it with ``device_map="auto"``), with
    ``args.model_init_kwargs``.
    """

    def __init__(self, model: Any, args: TrainingArguments | None = None, **kwargs: Any):
        # Phase 1: arguments. Any TrainingArguments is upgraded, not rejected.
        if args is None:
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = LazySFTConfig(f"{name.split('/')[-1]}-SFT")
        else:
            args = as_lazy_sft_config(args)

        # Phase 2: a model id is loaded on the host: the executor owns placement (LazyTrainer checks the model type
        # before SFTTrainer would load it).
        init_kwargs = args.model_init_kwargs
        if isinstance(model, str) and args.stream_enabled:
            model = _load_on_host(model, args, kwargs.pop("quantization_config", None))
            args.model_init_kwargs = None  # used above; SFTTrainer would warn that they are ignored

        try:
            super().__init__(model=model, args=args, **kwargs)
        finally:
            args.model_init_kwargs = init_kwargs

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        if not self._uses_chunked_loss(model, return_outputs):
            # streaming off, or what the chunked loss cannot do: SFTTrainer's own loss and logs
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        mode = "train" if self.model.training else "eval"
        logged = len(self._metrics[mode]["mean_token_accuracy"])
        root = unwrap_base(model)
        with _final_hidden(models.final_norm(root)) as seen:
            loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)  # LazyTrainer's
        # (should LazyTrainer ever hand this call on to SFTTrainer.compute_loss, that has logged it already)
        if len(self._metrics[mode]["mean_token_accuracy"]) == logged:
            self._log_token_statistics(mode, inputs, seen[-1], models.lm_head(root))
        return loss

    def _router_aux_weight(self, num_items_in_batch: Any) -> float | None:
        """Note: [SFT weighs the router aux loss per optimizer step]
        `SFTTrainer.compute_loss` adds ``router_aux_loss_coef * aux_loss`` (its own coefficient, `SFTConfig`'s or the
        model config's) divided by the gradient-accumulation steps when ``num_items_in_batch`` normalises the NLL
        (Trainer then leaves accumulation to the loss), and after the NLL was multiplied by the process count under
        ``average_tokens_across_devices``: the aux term is a per-micro-batch mean. `LazyTrainer.compute_loss`
        multiplies the whole loss by the process count, so the weight is divided by it here. Without this the MoE
        loss was ``GA x`` TRL's aux term (15.6% above at GA 2). Test:
        ``tests/test_trainer_honoured.py::test_lazy_sft_moe_loss_equals_trl_under_gradient_accumulation``."""
        if not getattr(self, "aux_loss_enabled", False):
            return None
        weight = float(self.router_aux_loss_coef)
        if num_items_in_batch is not None:
            weight /= self.current_gradient_accumulation_steps
            if self.args.average_tokens_across_devices:
                weight /= self.accelerator.num_processes
        return weight

    def _uses_chunked_loss(self, model, return_outputs: bool) -> bool:
        """Whether `LazyTrainer.compute_loss` takes the chunked path (the same conditions)."""
        return not (
            self.stream_handle is None
            or return_outputs
            or self.label_smoother is not None
            or self.compute_loss_func is not None
            or custom_forward(model) is not None
        )

    def _log_token_statistics(self, mode: str, inputs: dict[str, Any], hidden: torch.Tensor, head: Any) -> None:
        """Append what `SFTTrainer.compute_loss` logs (`entropy`, `mean_token_accuracy`, `num_tokens`), gathered
        over processes the same way, from `token_statistics`."""
        num_valid, num_correct, entropy_sum = token_statistics(
            hidden,
            head.weight,
            inputs["labels"],
            chunk_tokens=self.stream_handle.plan.loss_chunk_tokens,
            lm_head_bias=getattr(head, "bias", None),
        )
        gather = self.accelerator.gather_for_metrics
        num_valid = gather(num_valid).sum()
        entropy_sum = gather(entropy_sum).sum()
        num_correct = gather(num_correct).sum()
        self._metrics[mode]["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append((num_correct / num_valid).item() if num_valid > 0 else 0.0)
        if mode == "train":
            if "attention_mask" in inputs:
                tokens = gather(inputs["attention_mask"].sum()).sum().item()
            elif "position_ids" in inputs:  # padding-free batches carry position_ids instead
                local = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
                tokens = gather(local).sum().item()
            else:
                raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
            self._total_train_tokens += tokens // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]


def _load_on_host(model_id: str, args: LazySFTConfig, quantization_config: Any) -> torch.nn.Module:
    """`SFTTrainer`'s model loading (``args.model_init_kwargs``, dtype float32 unless given) without a device map."""
    kwargs = dict(args.model_init_kwargs or {})
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    kwargs.setdefault("device_map", None)
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return create_model_from_path(model_id, **kwargs)


__all__ = ["TRL_INSTALL_HINT", "LazySFTConfig", "LazySFTTrainer", "as_lazy_sft_config", "token_statistics"]
