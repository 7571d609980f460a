"""The parameter groups of LazyTrainer's `HybridAdamW8bit`, named and in one order whether the model streams or not,
and the resume that matches a checkpoint's optimizer state to them by name.

Note: [Optimizer state is matched by parameter name]
    `torch.optim.Optimizer.load_state_dict` pairs saved states with parameters by position. The streamed run listed
    its masters resident parameters first, then layer by layer; the unstreamed run in `model.named_parameters()`
    order. A checkpoint resumed with ``stream_enabled`` toggled therefore put the Adam moments on other tensors:
    silently where shapes agree (qwen2 tied, full multi-head attention: weights 6e-3 off), or refused as "a different
    model" (qwen3). Both runs now build Trainer's decay / no-decay groups in `named_parameters()` order
    (`decay_groups`), each group carrying ``param_names`` (torch's named parameter groups), and `load_by_name` maps a
    saved state to the current groups through those names: a resume with streaming toggled continues as an
    uninterrupted run, and a state for other parameters is refused naming them. A checkpoint written before the
    names existed is read in the order its writer used: this run's own legacy order when the streaming mode is the
    same (`legacy_names`), else it is refused naming ``stream_enabled`` and the fix (the writer's order is not
    recorded). Test: ``tests/test_trainer_honoured.py::test_resume_with_streaming_toggled``.

This module never imports `transformers.Trainer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


class OptimizerStateMismatch(ValueError):
    """A checkpoint's optimizer state does not belong to the parameters this run trains (the message says why)."""


def decay_groups(
    named: list[tuple[str, torch.Tensor]], decay: set[str], weight_decay: float, order: list[str]
) -> tuple[list[dict[str, Any]], list[list[str]]]:
    """Trainer's groups (``decay`` names with ``weight_decay``, the others with 0; empty groups dropped) over the
    tensors ``named`` (the parameters, or their fp32 masters), each sorted by ``order`` (the model's
    `named_parameters()` names) and carrying ``param_names``. Also the names per group in the order of ``named``
    itself (the order checkpoints written before Note: [Optimizer state is matched by parameter name] used)."""
    rank = {n: i for i, n in enumerate(order)}
    groups, legacy = [], []
    for in_decay, wd in ((True, weight_decay), (False, 0.0)):
        members = [(n, t) for n, t in named if (n in decay) == in_decay]
        if not members:
            continue
        legacy.append([n for n, _ in members])
        members.sort(key=lambda nt: rank.get(nt[0], len(rank)))
        groups.append({"params": [t for _, t in members], "param_names": [n for n, _ in members], "weight_decay": wd})
    return groups, legacy


@contextlib.contextmanager
def load_by_name(
    optimizer: Any,
    checkpoint: str | None,
    streamed: bool,
    legacy_names: list[list[str]] | None,
    writer_streamed: bool = False,
) -> Iterator[None]:
    """While inside, ``optimizer.load_state_dict`` (the optimizer inside an accelerate wrapper) maps the saved
    state to its groups by parameter name (Note: [Optimizer state is matched by parameter name]). A no-op for an
    optimizer whose groups carry no names (not built by `decay_groups`). ``streamed``: this run streams;
    ``writer_streamed``: the run that wrote ``checkpoint`` did (its plan is beside the weights)."""
    with mapped_load(
        optimizer, checkpoint, lambda sd, gs: _by_name(sd, gs, checkpoint, streamed, legacy_names, writer_streamed)
    ):
        yield


@contextlib.contextmanager
def mapped_load(
    optimizer: Any, checkpoint: str | None, mapping: Callable[[dict[str, Any], list[dict]], dict[str, Any]]
) -> Iterator[None]:
    """While inside, ``optimizer.load_state_dict(sd)`` (the optimizer inside an accelerate wrapper) loads
    ``mapping(sd, groups)`` instead of ``sd``, ``groups`` being its parameter groups. A no-op without a checkpoint or
    when the groups carry no names (an optimizer not built by `decay_groups`)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    groups = getattr(inner, "param_groups", None)
    if checkpoint is None or not groups or not all("param_names" in g for g in groups):
        yield
        return
    original = inner.load_state_dict

    def load(state_dict: dict[str, Any]) -> None:
        return original(mapping(state_dict, groups))

    inner.load_state_dict = load
    try:
        yield
    finally:
        del inner.load_state_dict  # the class's method again


def _by_name(
    sd: dict[str, Any],
    groups: list[dict],
    checkpoint: str,
    streamed: bool,
    legacy: list[list[str]] | None,
    writer_streamed: bool,
) -> dict[str, Any]:
    saved_groups = sd["param_groups"]
    if len(saved_groups) != len(groups):
        return sd  # the optimizer's own check names the group counts
    names = [g.get("param_names") for g in saved_groups]
    if any(n is None for n in names):
        if writer_streamed != streamed or legacy is None:
            raise OptimizerStateMismatch(
                f"checkpoint {checkpoint} was written with stream_enabled={writer_streamed} by an earlier lazytrain_hf "
                "whose optimizer.pt lists the parameters in that mode's order without their names, and this run has "
                f"stream_enabled={streamed}: its Adam moments cannot be matched to their parameters. Resume it with "
                f"stream_enabled={writer_streamed} (its checkpoints then carry the names and resume either way), "
                "or start without resume_from_checkpoint."
            )
        names = legacy
    out = []
    for gi, (group, saved, saved_names) in enumerate(zip(groups, saved_groups, names)):
        current = group["param_names"]
        if len(saved_names) != len(saved["params"]) or set(saved_names) != set(current):
            missing = [n for n in current if n not in set(saved_names)]
            extra = [n for n in saved_names if n not in set(current)]
            raise OptimizerStateMismatch(
                f"checkpoint {checkpoint}: its optimizer state (param_groups[{gi}]) belongs to other parameters than "
                f"this run trains (missing: {missing[:3]}, not trained here: {extra[:3]}). Resume from a checkpoint "
                "of this model with the same trainable parameters (requires_grad, adapters, weight_decay groups), "
                "or start without resume_from_checkpoint."
            )
        key_of = dict(zip(saved_names, saved["params"]))
        out.append({**saved, "params": [key_of[n] for n in current], "param_names": list(current)})
    return {**sd, "param_groups": out}
