"""What of the user's Trainer set-up the streamed path honours, and what it refuses at construction.

Principle (issue #28): whatever the user hands `LazyTrainer` is honoured (the same losses as `transformers.Trainer`)
or refused when the trainer is built, with an error naming the option, the value and the fix; never changed quietly.
This module holds the checks `LazyTrainer.__init__` runs on its class, arguments and model, and the two facts the
training path asks at run time: whether the model's own `forward` must compute the loss (`custom_forward`) and the
first rows of a dataset without a length (`first_rows`). It never imports `transformers.Trainer` or the trainer
module: the trainer passes itself (its class) and its arguments as plain values.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
from transformers.utils import logging

from .. import models
from ..loading import weights_on_disk
from .planning import unwrap_base

logger = logging.get_logger(__name__)

# Modules whose `forward` methods are the libraries' own (the model classes, PEFT's wrappers, TRL's fused-head patch
# which without ``fused_lm_head`` calls the model's forward, accelerate's output casts): a `forward` from anywhere
# else is the user's.
LIBRARY_MODULES = ("transformers.", "peft.", "torch.", "trl.", "accelerate.")

# TRL's trainers the streamed path supports (through `lazytrain_hf.LazySFTTrainer`), and their bases.
TRL_SUPPORTED = ("SFTTrainer", "_BaseTrainer", "BaseTrainer")
SUPPORTED_TRAINERS = "lazytrain_hf.LazyTrainer (transformers.Trainer) and lazytrain_hf.LazySFTTrainer (trl.SFTTrainer)"


def _qualnames(cls: type) -> list[tuple[str, type]]:
    return [(f"{c.__module__}.{c.__qualname__}", c) for c in cls.__mro__]


def check_construction(
    trainer_cls: type, lazy_cls: type, args: Any, model: Any, optimizer_cls_and_kwargs: Any
) -> None:
    """Every check `LazyTrainer.__init__` makes before `Trainer.__init__` runs (the functions below)."""
    check_trainer_class(trainer_cls, lazy_cls, args.stream_enabled)
    check_optimizer_options(args, optimizer_cls_and_kwargs)
    check_model(model, args.stream_enabled)


def check_trainer_class(trainer_cls: type, lazy_cls: type, stream_enabled: bool) -> None:
    """Refuse, while streaming, a `LazyTrainer` subclass mixed with a TRL trainer other than SFT (its loss is not the
    causal-LM loss the executor computes) or overriding `create_optimizer` (the streamed layers are updated by the
    HybridAdamW8bit over the host masters that `train()` builds; another optimizer would never reach them)."""
    if not stream_enabled:
        return
    foreign = [
        c.__name__
        for name, c in _qualnames(trainer_cls)
        if name.startswith("trl.") and c.__name__.endswith("Trainer") and c.__name__ not in TRL_SUPPORTED
    ]
    if foreign:
        raise ValueError(
            f"{trainer_cls.__name__} mixes LazyTrainer with TRL's {foreign[0]} while stream_enabled=True: the "
            f"streaming executor computes a causal-LM loss, not {foreign[0]}'s, so it would train another objective "
            f"than the one asked for. Supported while streaming: {SUPPORTED_TRAINERS}. Train with trl.{foreign[0]} "
            "and stream_enabled=False (plain TRL, the model in memory)."
        )
    owner = next(c for c in trainer_cls.__mro__ if "create_optimizer" in vars(c))
    if owner is not lazy_cls and not issubclass(lazy_cls, owner):
        raise ValueError(
            f"{owner.__qualname__}.create_optimizer overrides LazyTrainer's while stream_enabled=True: the streamed "
            "layers are updated layer by layer by the HybridAdamW8bit that train() builds over the host fp32 "
            "masters, so an optimizer built elsewhere would never update them. Drop the override (tune the "
            "optimizer with learning_rate, weight_decay, adam_* and the optim_* arguments, or edit the param groups "
            "of trainer.create_optimizer() before train()), or set stream_enabled=False to use your optimizer."
        )


def check_optimizer_options(args: Any, optimizer_cls_and_kwargs: Any) -> None:
    """Refuse ``optimizer_cls_and_kwargs`` where HybridAdamW8bit would replace it (as a non-default ``optim`` is)."""
    if optimizer_cls_and_kwargs is None or not args.optim_hybrid_8bit:
        return
    cls, kwargs = (list(optimizer_cls_and_kwargs) + [None, None])[:2]
    shown = f"({getattr(cls, '__name__', cls)}, {kwargs!r})"
    cause, off = (
        ("stream_enabled=True", "set stream_enabled=False")
        if args.stream_enabled
        else ("optim_hybrid_8bit=True", "leave optim_hybrid_8bit unset")
    )
    raise ValueError(
        f"optimizer_cls_and_kwargs={shown} with {cause}: the model is updated by HybridAdamW8bit (tuned by "
        "learning_rate, weight_decay, adam_beta1, adam_beta2, adam_epsilon and the optim_* arguments), which would "
        f"silently replace it; drop optimizer_cls_and_kwargs, or {off} to train with it."
    )


def check_given_optimizer(optimizer: Any) -> None:
    """Refuse, at `train()` with streaming, an optimizer the user gave (``optimizers=``; ours from an earlier
    `train()` or `create_optimizer()` were cleared by then): the streamed layers are updated by the HybridAdamW8bit
    over the host masters that `train()` builds."""
    if optimizer is not None:
        raise ValueError(
            "LazyTrainer(optimizers=...) with stream_enabled=True: the streamed model is updated by the "
            "HybridAdamW8bit that train() builds over the host fp32 masters, so a given optimizer would never "
            "update the streamed layers. Drop `optimizers` (tune it with the optim_* arguments) or set "
            "stream_enabled=False."
        )


def check_model(model: Any, stream_enabled: bool) -> None:
    """The model the trainer is given (or `model_init` returned): a supported causal LM when streaming; in memory
    when not (a `lazytrain_hf.from_pretrained` model keeps its decoder weights on disk for the executor)."""
    if not isinstance(model, torch.nn.Module):  # None (model_init), or a model id TRL loads itself
        return
    if stream_enabled:
        models.check_causal_lm(unwrap_base(model))
        return
    n = weights_on_disk(model)
    if n:
        raise ValueError(
            f"LazyTrainer(model={type(model).__name__}) with stream_enabled=False: {n} parameters of the model are "
            "still on disk (lazytrain_hf.from_pretrained leaves decoder weights on disk for the streaming executor "
            "to read layer by layer), and plain Trainer training needs them in memory. Set stream_enabled=True, or "
            "load the model with transformers.AutoModelForCausalLM.from_pretrained(...)."
        )


def custom_forward(model: torch.nn.Module) -> str | None:
    """Why the loss must come from the model's own ``forward`` (which the chunked loss, calling the base model and
    the lm_head weight, would bypass), or None: a ``forward`` replaced on the instance (a user's wrapper) or defined
    by a class outside transformers / PEFT (a subclass overriding it), on the model, its PEFT wrapper or its
    `*ForCausalLM`. The decoder layers stream through their hooks whichever forward calls them."""
    seen: set[int] = set()
    for m in (model, getattr(model, "base_model", None), unwrap_base(model)):
        if not isinstance(m, torch.nn.Module) or id(m) in seen:
            continue
        seen.add(id(m))
        reason = None
        if "forward" in vars(m) and not _defined_in(vars(m)["forward"]).startswith(LIBRARY_MODULES):
            reason = f"{type(m).__name__}.forward is replaced on the instance"
        owner = next((c for c in type(m).__mro__ if "forward" in vars(c)), None)
        if reason is None and owner is not None and not owner.__module__.startswith(LIBRARY_MODULES):
            reason = f"{owner.__qualname__}.forward ({owner.__module__}) overrides it"
        if reason is not None:
            _say_full_logits(reason)
            return reason
    return None


def _defined_in(fn: Any) -> str:
    """The module a function was defined in, from its globals (``functools.wraps`` copies ``__module__`` from the
    function it wraps, not the globals), or "" when unknown (a partial, a callable object)."""
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__globals__", {}).get("__name__", "") + "."


@functools.cache
def _say_full_logits(reason: str) -> None:
    logger.warning(
        f"LazyTrainer: {reason}; the loss is computed by the model's own forward (its decoder layers streamed), "
        "with the full batch x sequence x vocabulary logits, instead of LazyTrain's chunked loss. Use a forward "
        "hook (register_forward_hook) to observe the model without changing its loss path."
    )


def first_rows(dataset: Any, n: int) -> list[Any]:
    """The first ``n`` rows of ``dataset``: by index when it has a length, else (an iterable dataset, streamed data)
    by iterating from its start (a new iterator: the training dataloader's is not touched)."""
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return [dataset[i] for i in range(min(n, len(dataset)))]
    return list(itertools.islice(iter(dataset), n))


def prebuilt_optimizer(
    optimizer: torch.optim.Optimizer, prebuilt: torch.optim.Optimizer | None, args: Any, handle: Any
) -> torch.optim.Optimizer | None:
    """`LazyTrainer.create_optimizer` made ``optimizer``: built before `train()` while streaming, it is returned (to
    be remembered as the early optimizer); built inside `train()`, it takes the early one's group settings
    (`adopt_group_settings`) and None is returned. Note: [create_optimizer() before train()]."""
    if handle is not None:
        if prebuilt is not None:
            adopt_group_settings(optimizer, prebuilt)
        return None
    return optimizer if args.stream_enabled else None


def adopt_group_settings(optimizer: torch.optim.Optimizer, prebuilt: torch.optim.Optimizer) -> None:
    """Note: [create_optimizer() before train()]
    Called before `train()`, `LazyTrainer.create_optimizer()` builds its HybridAdamW8bit over the model's parameters
    (the host store, whose masters the streamed optimizer updates, only exists inside `train()`), with Trainer's
    decay / no-decay groups. `train()` then builds the optimizer over the host masters, the same groups in the same
    order, and takes from the early one every hyperparameter its groups hold then (``lr``, ``weight_decay``,
    ``betas``, ``eps``, ...), so an edit made to it before `train()` is honoured. One that cannot be carried over is
    refused: other groups, or state (steps taken outside `train()`)."""
    if len(prebuilt.param_groups) != len(optimizer.param_groups) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(prebuilt.param_groups, optimizer.param_groups)
    ):
        raise ValueError(
            "trainer.create_optimizer() was called before train() and its param_groups were changed "
            f"({len(prebuilt.param_groups)} groups of {[len(g['params']) for g in prebuilt.param_groups]} tensors; "
            f"LazyTrain builds {[len(g['params']) for g in optimizer.param_groups]}): the streamed optimizer runs "
            "over the host fp32 masters with Trainer's decay / no-decay groups, whose hyperparameters may be edited "
            "but not their membership. Edit the groups' settings only, or set stream_enabled=False."
        )
    if any(prebuilt.state.values()):
        raise ValueError(
            "trainer.create_optimizer() was called before train() and the optimizer was stepped outside train(): "
            "its state belongs to the unstreamed parameters, not to the host masters train() updates. Build the "
            "trainer anew, or set stream_enabled=False."
        )
    for group, early in zip(optimizer.param_groups, prebuilt.param_groups):
        group.update({k: v for k, v in early.items() if k not in ("params", "initial_lr")})
