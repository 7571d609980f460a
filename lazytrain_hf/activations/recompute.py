"""Recomputation: a layer (or a checkpointed block of layers) re-run in backward to serve its saved tensors.

Owns the recompute frames of one engine (`RecomputeFrame` per layer call, `BlockFrame` per checkpointed block,
`Slot` per saved tensor autograd holds) and the replay: the layer's forward re-run with the RNG and autocast state
of the original call under recording hooks, its saved tensors served by index, once per backward. The layer input
a frame keeps is stored through the engine's `EntryStore` (`entries.py`); weights are bound for a block's
recomputation by the executor (`RecomputeWeights`). Does not decide which layers are recomputed (the plan, read by
the router) and never copies activations between tiers itself.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .entries import EntryStore
from .layout import ParamRef, fingerprint, plain_strided, storage_key
from .tiers import Entry

if TYPE_CHECKING:
    from ..planner.plan import Plan

# Keyword arguments that must not be replayed by a recomputation: a KV cache would be extended a second time.
# In training the cache HF creates is empty before the layer runs, so the layer computes the same tensors without it.
_NO_REPLAY_KWARGS: dict[str, Any] = {"cache": None, "past_key_values": None, "layer_past": None, "use_cache": False}


def _unpacked(_: Any) -> None:
    """Unpack hook of a recomputation's recording hooks: what it records is served by `Recomputer.unpack_slot`."""
    return None


class RecomputeFrame:
    """Everything needed to re-run one layer's forward in backward (one per layer call)."""

    def __init__(self, layer: int, module: nn.Module) -> None:
        self.layer = layer
        self.module = module
        self.meta: list[tuple[torch.Size, torch.dtype]] = []  # per saved tensor of the original forward
        self.input: Entry | None = None
        self.input_requires_grad = False
        self.input_pos: int | None = None  # index in args, or None for kwargs["hidden_states"]
        self.args: tuple = ()
        self.kwargs: dict[str, Any] = {}
        self.shared: set[int] = set()
        self.cpu_rng: torch.Tensor | None = None
        self.dev_rng: torch.Tensor | None = None
        self.autocast: list[tuple[str, dict[str, Any]]] = []
        # gid -> idx -> (tensor or weight reference, acct key)
        self.recomputed: dict[int, dict[int, tuple[torch.Tensor | ParamRef, int | None]]] = {}
        self.done_gids: set[int] = set()
        self.holders = 0
        self.released = False
        self.lock = threading.RLock()
        self.block: BlockFrame | None = None  # block checkpointing: the block this layer call belongs to


class BlockFrame:
    """One checkpointed block: consecutive layer calls recomputed together from the first one's saved input.

    Holds the input entry until every frame of the block is released; the frames share its lock, so a block is
    recomputed once per backward however its tensors are unpacked.
    """

    def __init__(self, start: int) -> None:
        self.start = start
        self.frames: list[RecomputeFrame] = []
        self.input: Entry | None = None
        self.last_out: tuple | None = None  # fingerprint of the last layer's output (forward), see fingerprint
        self.live = 0  # frames not released yet
        self.done_gids: set[int] = set()
        self.released = False
        self.lock = threading.RLock()

    @property
    def layers(self) -> list[int]:
        return [f.layer for f in self.frames]


class Slot:
    """What autograd holds for a tensor of a recomputed layer: an index into the recomputation."""

    __slots__ = ("frame", "idx", "recomputer", "__weakref__")

    def __init__(self, frame: RecomputeFrame, idx: int, recomputer: weakref.ReferenceType) -> None:
        self.frame, self.idx, self.recomputer = frame, idx, recomputer
        frame.holders += 1

    def __del__(self) -> None:
        recomputer = self.recomputer()
        if recomputer is not None:
            with contextlib.suppress(Exception):
                recomputer.drop_slot(self.frame)


class Recomputer:
    """The recompute frames of one `ActivationEngine` and their replay (see the module docstring).

    Args:
        store: the engine's entries; a frame's (or block's) input is stored and released through it.
        plan: the engine's plan (``checkpoint_every``).
        device: the compute device.
        param_packer: the executor's `ParamPacker` (weights recorded as its references), or None.
        weights: the executor's `RecomputeWeights` (binds a layer's weights for a block's recomputation), or None.
    """

    def __init__(
        self,
        store: EntryStore,
        plan: Plan,
        device: torch.device,
        param_packer: Any | None,
        weights: Any | None,
    ) -> None:
        self.store = store
        self.plan, self.device = plan, device
        self.param_packer, self.weights = param_packer, weights
        self.acct = store.tiers.acct
        self.ref = weakref.ref(self)  # what a `Slot` holds
        self._frames: dict[int, list[weakref.ReferenceType]] = {}  # layer -> recompute frames of the current step
        # block checkpointing: the block the forward is building, and each layer's block of the latest forward
        self._open_block: BlockFrame | None = None
        self._block_of: dict[int, weakref.ReferenceType] = {}

    def release_all(self) -> None:
        """End of step: release every frame and block of the step."""
        for refs in self._frames.values():
            for ref in refs:
                frame = ref()
                if frame is not None:
                    self._release_frame(frame)
        for ref in self._block_of.values():
            block = ref()
            if block is not None:
                self._release_block(block)
        self._block_of.clear()
        self._open_block = None
        self._frames.clear()

    @staticmethod
    def _layer_input(layer: int, args: tuple, kwargs: dict) -> tuple[torch.Tensor, int | None]:
        """The hidden-states input of a layer call and where it is: ``(x, 0)`` for args[0], ``(x, None)`` for
        kwargs["hidden_states"]."""
        if args and isinstance(args[0], torch.Tensor):
            return args[0], 0
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return kwargs["hidden_states"], None
        raise ValueError(
            f"layer {layer} uses policy='recompute' but its input is neither args[0] nor kwargs['hidden_states'] "
            "as a tensor; plan another policy for this layer."
        )

    def block_frame(
        self, layer: int, module: nn.Module, args: tuple, kwargs: dict, shared: set[int]
    ) -> RecomputeFrame:
        """The frame of a layer call under block checkpointing: the first layer of a block saves its input on the
        device; a later layer of the block saves nothing and is recomputed from the previous layer's output."""
        K = self.plan.checkpoint_every
        x, _ = self._layer_input(layer, args, kwargs)
        block = self._open_block
        cont = (
            layer % K != 0
            and block is not None
            and not block.released
            and block.frames[-1].layer == layer - 1
            and block.start <= layer < block.start + K
        )
        if cont and (block.last_out is None or block.last_out != fingerprint(x)):
            # the previous layer's output was not passed to end_layer, or this input is not that output (a
            # modified or different tensor): the recomputation could not chain, so this layer starts a block
            cont = False
            warnings.warn(
                f"block checkpointing (checkpoint_every={K}): the input of layer {layer} is not the output of layer "
                f"{layer - 1} as passed to end_layer(); layer {layer} starts a new block and saves its input.",
                stacklevel=3,
            )
        if cont:
            frame = self.new_frame(layer, module, args, kwargs, "gpu", shared, save_input=False)
        else:
            frame = self.new_frame(layer, module, args, kwargs, "gpu", shared)
            block = BlockFrame(layer)
            block.input, frame.input = frame.input, None  # the block holds the input (its holder count moves)
            self._open_block = block
        frame.block = block
        frame.lock = block.lock
        block.frames.append(frame)
        block.live += 1
        block.last_out = None
        self._block_of[layer] = weakref.ref(block)
        return frame

    def new_frame(
        self,
        layer: int,
        module: nn.Module,
        args: tuple,
        kwargs: dict,
        tier: str,
        shared: set[int],
        save_input: bool = True,
    ) -> RecomputeFrame:
        frame = RecomputeFrame(layer, module)
        x, frame.input_pos = self._layer_input(layer, args, kwargs)
        frame.args = tuple(args)
        frame.kwargs = {k: (_NO_REPLAY_KWARGS[k] if k in _NO_REPLAY_KWARGS else v) for k, v in kwargs.items()}
        if frame.input_pos is None:
            frame.kwargs["hidden_states"] = None
        else:
            frame.args = (None,) + frame.args[1:]
        frame.shared = shared
        frame.input_requires_grad = x.requires_grad
        # the input goes to the layer's input tier, like any saved tensor of that tier
        if save_input:
            if tier == "gpu" or not plain_strided(x) or x.device != self.device:
                frame.input = self.store.keep(layer, x.detach())
            else:
                frame.input = self.store.offload(layer, tier, x.detach())
            frame.input.holders += 1  # held by the frame (or its block) until it is released
        # Note: [Recompute replays RNG and autocast state]
        # Captured before the layer's forward draws any random number, restored (inside fork_rng, so the training
        # RNG stream is untouched) before the recomputation: dropout masks come out identical.
        frame.cpu_rng = torch.get_rng_state()
        if self.device.type == "cuda":
            frame.dev_rng = torch.cuda.get_rng_state(self.device)
            frame.autocast.append(
                (
                    "cuda",
                    {
                        "enabled": torch.is_autocast_enabled("cuda"),
                        "dtype": torch.get_autocast_dtype("cuda"),
                        "cache_enabled": torch.is_autocast_cache_enabled(),
                    },
                )
            )
        frame.autocast.append(
            (
                "cpu",
                {
                    "enabled": torch.is_autocast_enabled("cpu"),
                    "dtype": torch.get_autocast_dtype("cpu"),
                    "cache_enabled": torch.is_autocast_cache_enabled(),
                },
            )
        )
        self._frames.setdefault(layer, []).append(weakref.ref(frame))
        return frame

    def unpack_slot(self, slot: Slot) -> torch.Tensor:
        frame = slot.frame
        gid = torch._C._current_graph_task_id()
        with frame.lock:
            if frame.released:
                raise RuntimeError(
                    f"the recomputation state of layer {frame.layer} was released by end_step() before backward "
                    "used it; call end_step() only after backward."
                )
            layer_mode = frame.block is not None and self.plan.block_graphs == "layer"
            if gid == -1:
                # unpacked outside backward (e.g. reading grad_fn._saved_*): recompute and keep nothing
                if layer_mode:
                    x = self._block_layer_input(frame.block, frame, keep=False)
                    tensors = self._run_forward(frame, x, False, weight_refs=True)[0]
                elif frame.block is not None:
                    tensors = self._recompute_block(frame.block, count=False, upto=frame)[frame]
                else:
                    tensors = self._recompute(frame, count=False)
                return self._resolve(tensors[slot.idx][0])
            # Note: [Recompute serves tensors by index, per backward]
            # One recomputation per backward (graph task) serves every saved tensor of the layer once, like
            # torch.utils.checkpoint(use_reentrant=False); a second backward over a retained graph recomputes again.
            if gid not in frame.recomputed:
                if gid in frame.done_gids:
                    raise RuntimeError(f"a saved tensor of recomputed layer {frame.layer} was unpacked twice.")
                if layer_mode:
                    # Note: [A block's layers are recomputed one graph at a time]
                    x = self._block_layer_input(frame.block, frame, keep=True)
                    frame.recomputed[gid] = self._run_forward(frame, x, True, weight_refs=True)[0]
                    frame.done_gids.add(gid)
                elif frame.block is not None:
                    self._recompute_block_for(frame.block, gid)
                else:
                    frame.recomputed[gid] = self._recompute(frame, count=True)
                    frame.done_gids.add(gid)
            served = frame.recomputed[gid]
            if slot.idx not in served:
                raise RuntimeError(f"a saved tensor of recomputed layer {frame.layer} was unpacked twice.")
            t, key = served.pop(slot.idx)
            if not served:
                del frame.recomputed[gid]
        if key is not None:
            self.acct.remove_storage(key)
        return self._resolve(t)

    def _resolve(self, t: torch.Tensor | ParamRef) -> torch.Tensor:
        """A recorded tensor, or the weight view a recorded reference names (rebuilt on the layer's current slot)."""
        return self.param_packer.unpack(t.ref) if isinstance(t, ParamRef) else t

    def begin_backward(self, layer: int) -> None:
        """Stage ``B layer`` starts (the executor's backward pre-hook, inside backward).

        Under block checkpointing the first backward stage of a block (its top layer) recomputes the whole block
        now, before any of its tensors is unpacked (See Note: [Block recomputation]). A no-op for per-layer
        policies, outside a backward, and for a block already recomputed in this backward.
        """
        if self.plan.checkpoint_every == 1:
            return
        ref = self._block_of.get(layer)
        block = ref() if ref is not None else None
        gid = torch._C._current_graph_task_id()
        if block is None or gid == -1:
            return
        with block.lock:
            if block.released:
                return
            if self.plan.block_graphs == "layer":
                # once per backward, and not when a retained graph's backward still holds the kept inputs
                if gid not in block.done_gids and block.frames[-1].input is None and len(block.frames) > 1:
                    self._block_layer_input(block, block.frames[-1], keep=True)
                block.done_gids.add(gid)
            elif gid not in block.done_gids:
                self._recompute_block_for(block, gid)

    def _block_layer_input(self, block: BlockFrame, frame: RecomputeFrame, keep: bool) -> torch.Tensor:
        """The input of ``frame``'s layer inside ``block`` under ``block_graphs="layer"`` (under ``block.lock``).

        Note: [A block's layers are recomputed one graph at a time]
        With ``Plan.block_graphs == "layer"`` (MegaTrain's executor) the first backward stage of a block (its top
        layer, `begin_backward`) runs the block's layers below the top forward under ``no_grad`` from the block
        input, each with its weights bound by the executor (`RecomputeWeights.recompute_weights`) and its own
        captured RNG / autocast state, so each output is bit-identical to the forward's; with ``keep`` each output
        is kept on the device as the next frame's input (``frame.input``, one holder, dropped when that frame is
        released after its backward). Each layer's backward then recomputes only that layer with grad from its
        kept input (`unpack_slot`), like a per-layer recomputation: one layer's saved tensors live at a time beside
        at most K - 1 kept hidden states and the block input. The pass starts from the nearest frame below
        ``frame`` whose input is at hand; without ``keep`` (an unpack outside backward) it keeps nothing.
        """
        frames = block.frames
        n = frames.index(frame)
        start = n
        while start > 0 and frames[start].input is None:
            start -= 1
        src = block.input if start == 0 else frames[start].input
        x = self.store.materialize(src)
        for m in range(start, n):
            prev = frames[m]
            nxt = frames[m + 1].layer if m + 1 < n else None
            bind = self.weights.recompute_weights(prev.layer, nxt) if self.weights else contextlib.nullcontext()
            with bind:
                y = self._run_nograd(prev, x)
            if not isinstance(y, torch.Tensor):
                raise RuntimeError(
                    f"recomputing block {block.layers}: layer {prev.layer} returned {type(y).__name__}, not the "
                    "hidden states; use checkpoint_every=1 for this model."
                )
            x = y.detach()
            target = frames[m + 1]
            if keep and target.input is None and not target.released:
                target.input = self.store.keep(target.layer, x)
                target.input.holders += 1  # held by the frame until it is released
        return x

    def _recompute_block_for(self, block: BlockFrame, gid: int) -> None:
        """Recompute ``block`` for backward ``gid`` and hand every live frame its tensors (under ``block.lock``)."""
        outs = self._recompute_block(block, count=True)
        block.done_gids.add(gid)
        for frame, out in outs.items():
            frame.recomputed[gid] = out
            frame.done_gids.add(gid)

    def _recompute_block(
        self, block: BlockFrame, count: bool, upto: RecomputeFrame | None = None
    ) -> dict[RecomputeFrame, dict[int, tuple[torch.Tensor | ParamRef, int | None]]]:
        """Re-run the block's layers in order from its saved input; saved tensors per frame (frames released
        already run, to feed the next layer, but record nothing). ``upto``: stop after that frame.

        Note: [Block recomputation]
        Layer ``k`` of the block runs on the output of layer ``k - 1``'s recomputation (the forward checked that
        its input was that output, `_block_frame`), with its own captured RNG / autocast state and keyword
        arguments, so it saves bit-identical tensors. Its weights are bound by the executor for the duration
        (`RecomputeWeights.recompute_weights`) and may be released right after: saved weights are recorded as the
        executor's references (`ParamPacker.pack`) and rebuilt on the layer's slot of the backward when unpacked,
        never as views of the slot used for the recomputation. Recorded activations count as device bytes until
        autograd unpacks them.
        """
        frames = block.frames
        if upto is not None:
            frames = frames[: frames.index(upto) + 1]
        outs: dict[RecomputeFrame, dict[int, tuple[torch.Tensor | ParamRef, int | None]]] = {}
        x = self.store.materialize(block.input)
        try:
            for n, frame in enumerate(frames):
                nxt = frames[n + 1].layer if n + 1 < len(frames) else None
                bind = self.weights.recompute_weights(frame.layer, nxt) if self.weights else contextlib.nullcontext()
                with bind:
                    out, y = self._run_forward(frame, x, count and not frame.released, weight_refs=True)
                if not frame.released:
                    outs[frame] = out
                if not isinstance(y, torch.Tensor):
                    raise RuntimeError(
                        f"recomputing block {block.layers}: layer {frame.layer} returned {type(y).__name__}, not the "
                        "hidden states; use checkpoint_every=1 for this model."
                    )
                x = y.detach()
        except BaseException:
            for out in outs.values():
                for _, key in out.values():
                    if key is not None:
                        self.acct.remove_storage(key)
            raise
        return outs

    def _recompute(self, frame: RecomputeFrame, count: bool) -> dict[int, tuple[torch.Tensor, int | None]]:
        """Re-run the layer's forward under recording hooks; saved tensors by index (with accounting keys)."""
        return self._run_forward(frame, self.store.materialize(frame.input), count)[0]

    def _run_forward(
        self, frame: RecomputeFrame, x: torch.Tensor, count: bool, weight_refs: bool = False
    ) -> tuple[dict[int, tuple[torch.Tensor | ParamRef, int | None]], Any]:
        """Run ``frame``'s layer forward on input ``x`` with its RNG / autocast state under recording hooks.

        Returns the saved tensors by index (with accounting keys when ``count``) and the hidden states it returned.
        ``weight_refs``: weights the executor's packer recognises are recorded as its references.
        """
        x = x.detach().requires_grad_(frame.input_requires_grad)
        args, kwargs = frame.args, dict(frame.kwargs)
        if frame.input_pos is None:
            kwargs["hidden_states"] = x
        else:
            args = (x,) + args[1:]
        module = frame.module
        # weights are bound again (the executor's backward pre-hook): never count them as activations
        skip = {storage_key(p) for p in module.parameters()} | {storage_key(b) for b in module.buffers()}
        skip |= frame.shared
        expected = frame.meta
        out: dict[int, tuple[torch.Tensor | ParamRef, int | None]] = {}
        acct = self.acct
        packer = self.param_packer if weight_refs else None

        def pack(t: torch.Tensor) -> None:
            i = len(out)
            if i >= len(expected) or expected[i] != (t.shape, t.dtype):
                want = expected[i] if i < len(expected) else "nothing"
                raise RuntimeError(
                    f"recomputing layer {frame.layer}: saved tensor {i} is {tuple(t.shape)} {t.dtype}, the original "
                    f"forward saved {want}. The layer's forward is not deterministic in what it saves; plan another "
                    "policy than recompute for it."
                )
            ref = packer.pack(t) if packer is not None else None
            if ref is not None:
                out[i] = (ParamRef(ref), None)
                return None
            t = t.detach() if t.requires_grad else t
            key = None
            if count and plain_strided(t) and t.device == self.device and storage_key(t) not in skip:
                key, _ = acct.add_storage(t)
            out[i] = (t, key)
            return None

        try:
            with self._replay(frame), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _unpacked):
                # `module.forward`, not `module(...)`: the executor's hooks on this layer must not fire again
                result = module.forward(*args, **kwargs)
            if len(out) != len(expected):
                raise RuntimeError(
                    f"recomputing layer {frame.layer} saved {len(out)} tensors, the original forward saved "
                    f"{len(expected)}; plan another policy than recompute for it."
                )
        except BaseException:
            for _, key in out.values():
                if key is not None:
                    acct.remove_storage(key)
            raise
        hidden = result[0] if isinstance(result, tuple | list) and result else result
        return out, hidden

    @contextlib.contextmanager
    def _replay(self, frame: RecomputeFrame) -> Iterator[None]:
        """The RNG (forked, so the training stream is untouched) and autocast state of ``frame``'s original call."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=True, device_type=self.device.type):
            torch.set_rng_state(frame.cpu_rng)
            if frame.dev_rng is not None:
                torch.cuda.set_rng_state(frame.dev_rng, self.device)
            with contextlib.ExitStack() as stack:
                for device_type, kw in frame.autocast:
                    stack.enter_context(torch.amp.autocast(device_type, **kw))
                yield

    def _run_nograd(self, frame: RecomputeFrame, x: torch.Tensor) -> Any:
        """``frame``'s layer forward on input ``x`` under ``no_grad`` with its RNG / autocast state; the hidden
        states it returned (Note: [A block's layers are recomputed one graph at a time])."""
        args, kwargs = frame.args, dict(frame.kwargs)
        if frame.input_pos is None:
            kwargs["hidden_states"] = x
        else:
            args = (x,) + args[1:]
        with self._replay(frame), torch.no_grad():
            result = frame.module.forward(*args, **kwargs)
        return result[0] if isinstance(result, tuple | list) and result else result

    # ------------------------------------------------------------------ release
    def drop_slot(self, frame: RecomputeFrame) -> None:
        with frame.lock:
            frame.holders -= 1
            if frame.holders <= 0:
                self._release_frame(frame)

    def _release_frame(self, frame: RecomputeFrame) -> None:
        with frame.lock:
            if frame.released:
                return
            frame.released = True
            for served in frame.recomputed.values():
                for _, key in served.values():
                    if key is not None:
                        self.acct.remove_storage(key)
            frame.recomputed.clear()
            if frame.input is not None:
                entry, frame.input = frame.input, None
                self.store.drop_holder(entry)
            block = frame.block
            if block is None:
                frame.args, frame.kwargs = (), {}
                return
            # a block keeps its frames' call arguments (the recomputation replays every layer) and its input until
            # the last of its frames is released
            block.live -= 1
            if block.live <= 0:
                self._release_block(block)

    def _release_block(self, block: BlockFrame) -> None:
        with block.lock:
            if block.released:
                return
            block.released = True
            for frame in block.frames:
                frame.args, frame.kwargs = (), {}
            if block.input is not None:
                entry, block.input = block.input, None
                self.store.drop_holder(entry)
