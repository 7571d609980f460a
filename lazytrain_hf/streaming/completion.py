"""Completion tracking of the streaming executor: the step's phases and when each layer's backward is done.

Owns the step bookkeeping (``_step_id``, ``_phase``, ``_grad_step``, begin / abort of a step), the autograd
boundaries around each layer (`Boundary`: start of stage ``B i`` on the output, "every input gradient computed" on
the input), the expected vs accumulated parameters of each layer, and the end-of-backward callback that completes
anything left. Completing a layer hands it to the gradient sink (`gradients.py`); it moves no data itself.

Note: [When a layer's backward is complete]
    At the end of a layer's forward the autograd graph between its output and its input boundary is walked once
    to find the trainable parameters that will receive a gradient in this backward (MoE experts that got no
    tokens in a non-fused implementation, or unused parameters, are simply absent). The layer is complete when the
    input boundary's backward ran (every node that reads the layer's weights to produce an input gradient has run)
    and each of those parameters has accumulated. A callback queued on the autograd engine completes anything left
    when backward ends, so a missing gradient can never leave a slot held or a gradient on the device.

Note: [A parameter may have several gradient accumulators]
    A parameter released and bound again between two uses in one forward (a tied embedding: the lookup, then the
    lm_head) has one ``AccumulateGrad`` node per binding on CUDA, since moving its data to another device resets its
    accumulator (Note: [Moving a parameter's data drops its gradient accumulator] in lazytrain_hf/streams.py).
    Autograd then no longer sums the two uses before accumulation: each node adds its part into ``.grad`` and fires
    the post-accumulate-grad hook. The graph walks of the forward (`_expected_params`, and `_note_accumulators` for
    the embedding and the head) record every distinct accumulator node of each trainable parameter, and a parameter
    counts as accumulated only once each of them fired, so its unit completes with the sum of both uses. Test:
    ``tests/test_cuda_semantics_grad.py::test_tied_stream_embeddings_grads_sum_both_uses``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .binder import LayerState


class Boundary(torch.autograd.Function):
    """Identity whose backward calls ``fire``. On a layer output its backward is the start of stage ``B i``; on a
    layer input it means every gradient through the layer has been computed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fire: Callable[[], None]) -> torch.Tensor:
        ctx.fire = fire
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.fire()
        return grad, None


class CompletionTracker:
    """`StreamHandle`'s step phases and per-layer completion (see the module docstring)."""

    def _begin_step(self) -> None:
        self._wait_resident_params()
        if self._phase != "idle":
            self._abort_step()
        self._step_id += 1
        self._forward_t0 = time.perf_counter()  # the simulation's long stalls last a forward (`note_forward`)
        self._embed_began = False
        self._phase = "forward"
        self._grad_step = torch.is_grad_enabled()
        self._stage = -1
        self._deferred.clear()
        self._boundary_nodes.clear()
        for st in self._all.values():
            st.reset_step()

    def _abort_step(self) -> None:
        """End a step that will get no backward (eval forward, exception, discarded graph)."""
        self._deferred.clear()  # first: releasing a slot below must not issue fetches for a step that is over
        for st in self._all.values():
            st.forget_accumulators()
            if st.in_engine:
                st.in_engine = False
                self.activations.end_layer(st.index)
            if not st.completed:
                self._drop_device_grads(st)
            self._release(st.index)
        self._boundary_nodes.clear()
        self.activations.end_step()
        self._phase = "idle"

    def _expected_params(self, root: Any, st: LayerState) -> set[int]:
        """Ids of the layer's trainable parameters reachable from its output. See Note: [When a layer's backward
        is complete]."""
        if not st.trainable:
            return set()
        found: set[int] = set()
        seen: set[int] = set()
        stack = [root]
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in seen or fn in self._boundary_nodes:
                continue
            seen.add(id(fn))
            var = getattr(fn, "variable", None)
            if var is not None:
                if id(var) in st.trainable:
                    found.add(id(var))
                    # Note: [A parameter may have several gradient accumulators]
                    st.acc_nodes.setdefault(id(var), {})[id(fn)] = fn
                continue
            stack.extend(nxt for nxt, _ in fn.next_functions)
        return found

    def _note_accumulators(self, output: Any, st: LayerState) -> None:
        """Record the accumulator nodes of ``st``'s parameters that ``output``'s graph reaches (down to the layer
        boundaries). Note: [A parameter may have several gradient accumulators]."""
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            self._expected_params(output.grad_fn, st)

    def _check_step(self, step: int) -> None:
        if step != self._step_id:
            raise RuntimeError(
                "lazytrain_hf streaming: backward of a forward pass older than the latest one. The executor runs one "
                "forward then its backward (as Trainer does); run backward before the next forward."
            )

    def _on_backward_stage(self, step: int, i: int) -> None:
        self._check_step(step)
        self._enter_backward()
        st = self._all[i]
        st.bwd_started = True
        self._run_stages(2 * self.num_layers - i)
        self._bind(i)
        self.engine.wait_grads_down(i + 2)  # Note: [Two stages of copies in flight] in engine.py
        if i == self.num_layers - 1:
            self.activations.wait_offloaded(i)  # the last forward's offloads (stage L + 1 waits for stage L - 1's)
        if self.plan.checkpoint_every > 1:
            # the top layer of a checkpointed block: the block is recomputed now, before its backward
            self.activations.begin_backward(i)
        self._account()
        self._span_start[("backward", i)] = self.trace.mark()

    def _enter_backward(self) -> None:
        if self._phase != "backward":
            self._phase = "backward"
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_input_grad(self, step: int, i: int) -> None:
        self._check_step(step)
        if i in self._units and self._phase == "forward":  # the head's backward runs before any layer's
            self._enter_backward()
        self._all[i].input_done = True
        self._maybe_complete(i)

    def _make_grad_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def grad_hook(p: torch.Tensor) -> None:
            st = self._all[i]
            if i in self._units and self._phase == "forward" and st.expected is not None:
                self._enter_backward()  # the head's gradients arrive before any layer's backward stage
            if self._phase != "backward" or st.completed:
                return  # e.g. torch.autograd.backward on a graph this executor did not record
            pid = id(p)
            hits = st.acc_hits[pid] = st.acc_hits.get(pid, 0) + 1
            if hits == 1 and pid in self._streamed_ids and p.grad is not None:
                n = p.grad.numel() * p.grad.element_size()
                st.device_grad_bytes += n
                self._device_grad_bytes += n
            if hits < len(st.acc_nodes.get(pid, ())):
                return  # another accumulator of this parameter is still to add its part (Note: [A parameter may ...])
            st.accumulated.add(pid)
            self._maybe_complete(i)

        return grad_hook

    def _maybe_complete(self, i: int) -> None:
        st = self._all[i]
        if st.completed or st.expected is None:
            return
        if (st.input_done or not st.input_rg) and st.expected <= st.accumulated:
            start = self._span_start.pop(("backward", i), None)
            if start is not None:
                self.trace.span("backward", i, start, self.trace.mark())
            self._complete(i)

    def _on_backward_end(self) -> None:
        self._deferred.clear()  # first: releasing a slot below must not issue fetches for a step that is over
        for st in self._all.values():
            if st.expected is not None and not st.completed:
                self._complete(st.index)
            st.forget_accumulators()  # Note: [A parameter may have several gradient accumulators]
            self._release(st.index)
        self._boundary_nodes.clear()
        self.activations.end_step()
        self._phase = "idle"
        self._account()
