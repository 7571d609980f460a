"""`attach_standalone`: drive an `ActivationEngine` from hooks on an ordinary (un-streamed) HF model, as the streaming
executor would, so tests can compare the engine against plain autograd without the executor."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from lazytrain_hf.activations import ActivationEngine


class StandaloneHandle:
    """Hooks installed by `attach_standalone`; `remove` takes them all off."""

    def __init__(self, model: nn.Module, engine: ActivationEngine, prefetch: bool) -> None:
        self.model, self.engine, self.prefetch = model, engine, prefetch
        self.handles: list[Any] = []
        self.reload_stages: dict[int, list[int]] = {}
        for stage, items in engine.plan.issue_schedule().items():
            layers = [i for what, i in items if what == "reload"]
            if layers:
                self.reload_stages[stage] = layers
        self.issued: list[tuple[int, int]] = []  # (stage, layer) in issue order, for tests

    def issue(self, stage: int) -> None:
        if not self.prefetch:
            return
        for layer in self.reload_stages.get(stage, ()):
            self.issued.append((stage, layer))
            self.engine.prefetch(layer)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def __repr__(self) -> str:
        return (
            f"StandaloneHandle(layers={self.engine.plan.num_layers}, prefetch={self.prefetch}, engine={self.engine})"
        )


def attach_standalone(model: nn.Module, engine: ActivationEngine, prefetch: bool = True) -> StandaloneHandle:
    """Drive ``engine`` from hooks on an ordinary (un-streamed) HF model, as the streaming executor would.

    Forward pre/post hooks on each decoder layer call `ActivationEngine.begin_layer` / `end_layer`; reloads are
    issued at the stages ``engine.plan.issue_schedule()`` names: forward stages in the layer pre-hooks, the head
    stage when the last layer's forward ends, the backward stage of layer ``i`` when the gradient of its output
    arrives (where `ActivationEngine.begin_backward` also runs). Call ``engine.end_step()`` (or use
    ``with engine.step():``) after backward.

    Args:
        model: a `*ForCausalLM` of a type in `lazytrain_hf.models.MODEL_TABLE`.
        engine: the engine; its plan must have one layer per decoder layer.
        prefetch: issue reloads per the plan (False: every reload happens on demand at unpack).

    Returns:
        `StandaloneHandle`; ``handle.remove()`` takes every hook off again.
    """
    from lazytrain_hf.models import decoder_layers

    layers = decoder_layers(model)
    L = engine.plan.num_layers
    if len(layers) != L:
        raise ValueError(
            f"the plan has {L} layers but the model has {len(layers)} decoder layers; plan for this model."
        )
    handle = StandaloneHandle(model, engine, prefetch)

    for i, layer in enumerate(layers):

        def pre(module: nn.Module, args: tuple, kwargs: dict, i: int = i) -> None:
            handle.issue(i)  # stage F i
            engine.begin_layer(i, module, args, kwargs)

        def post(module: nn.Module, args: tuple, kwargs: dict, output: Any, i: int = i) -> None:
            engine.end_layer(i, output)
            if i == L - 1:
                handle.issue(L)  # stage H starts when the last layer's forward ends
            out = output[0] if isinstance(output, tuple | list) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:

                def on_grad(grad: torch.Tensor, i: int = i) -> None:
                    handle.issue(2 * L - i)  # stage B i starts when the gradient of its output arrives
                    engine.begin_backward(i)

                out.register_hook(on_grad)

        handle.handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handle.handles.append(layer.register_forward_hook(post, with_kwargs=True, always_call=True))
    return handle
