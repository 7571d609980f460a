"""The input embedding and the head (final norm + lm_head) as streamed units, when the plan streams them.

Owns the two extra units of the host store (keys `EMBED_KEY` and ``num_layers``) and their hooks: the embedding's
forward begins the step, the head's spans the final norm to the lm_head or the chunked loss. They are fetched,
guarded, completed and their gradients sunk by the same machinery as decoder layers (`scheduler.py`,
`completion.py`, `gradients.py`); only their stage boundaries differ, which is why they have hooks of their own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .. import models
from .binder import _LayerState
from .completion import _Boundary

# Key of the input-embedding unit in `HostStore.layers` when the plan streams embeddings (the head unit's key is the
# number of decoder layers): sorted keys give the optimizer's order, embedding first, head last.
EMBED_KEY = -1


def inputs_to_device(args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
    """Every tensor among ``args`` and ``kwargs`` (and inside plain lists, tuples and dicts there) on ``device``.

    With ``stream_embeddings`` the model's first parameter is the embedding's host copy while unbound, so
    ``model.device`` reads as the host and ``generate()`` builds its inputs there (input ids, attention mask, position
    ids, cache positions): all of them go to the compute device before the forward."""

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(device) if x.device != device else x
        if type(x) in (list, tuple):
            return type(x)(move(v) for v in x)
        if type(x) is dict:
            return {k: move(v) for k, v in x.items()}
        return x

    return move(args), move(kwargs)


class HeadUnits:
    """`StreamHandle`'s embedding and head units (see the module docstring)."""

    def _init_units(self, streamed_ids: set[int]) -> None:
        self.embed_key, self.head_key = EMBED_KEY, self.num_layers
        self._tied = False
        if self.plan.stream_embeddings:
            self._add_units(streamed_ids)

    def _add_units(self, streamed_ids: set[int]) -> None:
        """Put the input embedding and the head (final norm + lm_head) into the host store as two extra units.

        Note: [Streamed embeddings and head]
            With ``plan.stream_embeddings`` the input embedding is the unit ``EMBED_KEY`` (-1) and the final norm
            with the lm_head the unit ``num_layers`` of `HostStore.layers`: fp32 master, compute copy and fp32
            gradient accumulators like a decoder layer, updated by the same layer-wise optimizer (sorted keys: the
            embedding first, the head last) and guarded by the same ``fetch_guard``. They are fetched into
            transient slots (Note: [Transient slots are stream-ordered allocations]) since each is used once or
            twice per step:

            - the embedding is bound by its forward pre-hook (which begins the step) and released by its forward
              hook: the lookup's backward is a scatter-add of the output gradient that does not read the weight,
              so the weight's gradient reaches its post-accumulate-grad hook with the unit released and goes to
              the host accumulator like a layer's (Note: [Squared norms of accumulated gradients]);
            - the head is bound by the final norm's forward pre-hook, which also puts an input boundary on the
              norm's input; it stays bound through the lm_head (plain ``model(...)``) or the chunked loss and is
              released when its backward is complete (every trainable head parameter accumulated and the norm's
              input gradient computed), or right away when no backward goes through it (evaluate, generate);
            - tied embeddings (``lm_head.weight is embed_tokens.weight``): the shared parameter belongs to the
              embedding unit only (one master, one accumulator); the head stage binds that unit again and releases
              it with the head. Between the two uses the weight's data moved to the host and back, which on CUDA
              gives it a second gradient accumulator: the head's part is accumulated into ``.grad`` first and waits
              on the device until the lookup's part is added, and the unit completes on the sum (Note: [A parameter
              may have several gradient accumulators] in completion.py).
        """
        root = self.root
        embed, norm, head = models.embed_tokens(root), models.final_norm(root), models.lm_head(root)
        embed_params = list(embed.parameters())
        embed_ids = {id(p) for p in embed_params}
        self._tied = any(id(p) in embed_ids for p in head.parameters())
        head_params = list(norm.parameters()) + [p for p in head.parameters() if id(p) not in embed_ids]
        self._embed_module, self._norm_module, self._head_module = embed, norm, head
        for key, kind, module, params in (
            (self.embed_key, "embed", embed, embed_params),
            (self.head_key, "head", norm, head_params),
        ):
            for p in params:
                if id(p) in streamed_ids:
                    raise ValueError(
                        f"plan.stream_embeddings=True: parameter {self._names.get(id(p))} is shared with a decoder "
                        "layer; set stream_embeddings=False for this model."
                    )
            ls = (
                self.store.add_layer(
                    key, kind, [(self._names[id(p)], p) for p in params], compute_dtype=self.compute_dtype
                )
                if params
                else None
            )
            st = _LayerState(key, module, kind, ls, False, {id(p): p for p in params if p.requires_grad})
            st.transient = True
            self._all[key] = self._units[key] = st
            streamed_ids.update(id(p) for p in params)

    def _install_unit_hooks(self) -> None:
        # generate() puts its inputs on `model.device`, the embedding's host copy while unbound
        self._hooks.append(self.root.register_forward_pre_hook(self._inputs_pre_forward, with_kwargs=True))
        self._hooks.append(self._embed_module.register_forward_pre_hook(self._embed_pre_forward, with_kwargs=True))
        self._hooks.append(
            self._embed_module.register_forward_hook(self._embed_post_forward, with_kwargs=True, always_call=True)
        )
        self._hooks.append(self._norm_module.register_forward_pre_hook(self._head_pre_forward, with_kwargs=True))
        self._hooks.append(
            self._head_module.register_forward_hook(self._head_post_forward, with_kwargs=True, always_call=True)
        )
        for key, st in self._units.items():
            for p in st.trainable.values():
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(key)))

    def _inputs_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return inputs_to_device(args, kwargs, self.device)

    def _embed_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._begin_step()
        self._embed_began = True
        st = self._all[self.embed_key]
        self._bind(self.embed_key)
        if self._grad_step and torch.is_grad_enabled() and st.trainable:
            st.expected = set(st.trainable)
        # the embedding called on its own (not through the model's forward)
        return inputs_to_device(args, kwargs, self.device)

    def _embed_post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        st = self._all[self.embed_key]
        if st.expected is not None:
            self._note_accumulators(output, st)  # Note: [A parameter may have several gradient accumulators]
        self._account()
        self._release(self.embed_key)

    def _head_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._phase == "idle":
            self._begin_step()
        key = self.head_key
        st = self._all[key]
        self._bind(key)
        if self._tied:
            self._bind(self.embed_key)
        if self._grad_step and torch.is_grad_enabled():
            st.expected = set(st.trainable)
            x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor) and x.requires_grad:
                step = self._step_id
                st.input_rg = True
                x = _Boundary.apply(x, lambda: self._on_input_grad(step, key))
                self._boundary_nodes.add(x.grad_fn)
                if args and isinstance(args[0], torch.Tensor):
                    args = (x, *args[1:])
                else:
                    kwargs = {**kwargs, "hidden_states": x}
        self._account()
        return args, kwargs

    def _head_post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._head_end(output)

    def _head_end(self, output: Any) -> None:
        """The head's forward is over (lm_head or chunked loss): release it unless a backward goes through it."""
        st = self._all[self.head_key]
        needs_bwd = st.expected is not None and isinstance(output, torch.Tensor) and output.requires_grad
        self._account()
        if needs_bwd:
            if self._tied:
                # the lm_head's use of the tied weight: a second accumulator on CUDA (Note: [A parameter may have
                # several gradient accumulators] in completion.py)
                self._note_accumulators(output, self._all[self.embed_key])
            return
        st.expected = None
        st.completed = True
        self._release(self.head_key)
        if self._tied:
            self._release(self.embed_key)
