"""Host store: per-layer contiguous flat buffers holding a streamed layer's weights and gradients in host memory.

Every streamed decoder layer owns one `LayerStore` with three flat buffers:

- ``master``: fp32 master weights of the layer's *trainable* streamed parameters (what the optimizer updates);
- ``compute_bytes``: the compute-dtype copy of *all* its streamed parameters (trainable and frozen), a byte buffer,
  pinned on CUDA: this is the source of every host-to-device fetch and what ``param.data`` points at while the
  layer is not bound to a device slot;
- ``grad``: fp32 gradient accumulators of the trainable streamed parameters.

Parameters are laid out at element offsets aligned to `ALIGN_BYTES`, trainable ones first, so that the master, the
grad and (when every parameter has the same dtype) the compute copy share element offsets: refreshing the compute
copy from the master is then a single ``copy_`` of a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

# Every parameter starts at a multiple of 256 bytes inside the flat buffers and the device slots: enough for any
# dtype view (`Tensor.view(dtype)` needs itemsize alignment), for vectorised CPU kernels (64 B) and for CUDA
# (cudaMalloc gives 256 B alignment; some kernels assume 16 B).
ALIGN_BYTES = 256


def _align(n: int, to: int = ALIGN_BYTES) -> int:
    return (n + to - 1) // to * to


@dataclass
class ParamEntry:
    """Where one parameter lives inside its layer's flat buffers."""

    name: str  # the model's own parameter name (as in `model.named_parameters()`)
    param: nn.Parameter
    shape: torch.Size
    dtype: torch.dtype  # compute dtype (the parameter's dtype at attach)
    trainable: bool
    byte_offset: int  # offset in the compute byte buffer and in the device slot
    elem_offset: int  # offset (elements) in the fp32 master / grad buffers; -1 for frozen parameters
    orig_device: torch.device
    orig_dtype: torch.dtype | None = None  # the parameter's dtype before attach when the compute copy differs

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def view_bytes(self, flat_u8: torch.Tensor) -> torch.Tensor:
        """This parameter's typed view inside a byte buffer laid out like the compute copy (host copy or slot)."""
        return flat_u8.narrow(0, self.byte_offset, self.nbytes).view(self.dtype).view(self.shape)


@dataclass
class LayerStore:
    """Host buffers of one streamed decoder layer.

    Attributes:
        index: decoder layer index.
        kind: layer kind (from `lazytrain_hf.models.layer_kinds`); slots are pooled per kind.
        entries: one `ParamEntry` per streamed parameter, trainable ones first.
        master: fp32 flat master weights of the trainable streamed parameters (``None`` when there are none).
        compute_bytes: uint8 flat compute-dtype copy of every streamed parameter (the fetch source).
        compute: the same buffer as a typed flat tensor when all streamed parameters share one dtype, else ``None``.
        grad: fp32 flat gradient accumulators of the trainable streamed parameters (``None`` when there are none).
        master_views / compute_views / grad_views: name-keyed views into the flat buffers (model parameter names).
        params: name-keyed streamed `nn.Parameter` objects.
        resident_trainable: names of trainable parameters of this layer kept resident on the device (small
            adapters among frozen weights); they have ordinary ``.grad``.
        has_grad: the grad accumulators hold gradients accumulated since the last `zero_grad` (when ``False``
            the grad buffer content is stale and must not be read).

    Note: [Compute copy aliases the fp32 master]
        When every streamed parameter of the layer is fp32, ``compute`` *is* the master storage (``master`` is a
        prefix view of it): the optimizer writing the master also writes the compute copy, and `sync` has
        nothing to copy. Frozen parameters then sit after the master prefix in the same buffer.
    """

    index: int
    kind: str
    entries: list[ParamEntry]
    master: torch.Tensor | None
    compute_bytes: torch.Tensor
    compute: torch.Tensor | None
    grad: torch.Tensor | None
    master_views: dict[str, torch.Tensor] = field(default_factory=dict)
    compute_views: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_views: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    resident_trainable: list[str] = field(default_factory=list)
    has_grad: bool = False
    aliased: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes a device slot needs for this layer (the compute copy, alignment padding included)."""
        return self.compute_bytes.numel()

    @property
    def trainable_entries(self) -> list[ParamEntry]:
        return [e for e in self.entries if e.trainable]

    @property
    def host_bytes(self) -> dict[str, int]:
        master = 0 if self.master is None or self.aliased else self.master.numel() * 4
        grad = 0 if self.grad is None else self.grad.numel() * 4
        return {"master": master, "compute": self.compute_bytes.numel(), "grad": grad}

    def sync(self) -> None:
        """Refresh the compute copy from the fp32 master (after the optimizer changed the master).

        See Note: [Compute copy aliases the fp32 master] for the fp32 case, where there is nothing to copy.
        """
        if self.master is None or self.aliased:
            return
        if self.compute is not None:
            # Trainable parameters come first and share element offsets with the master: one copy of a prefix.
            self.compute.narrow(0, 0, self.master.numel()).copy_(self.master)
            return
        for e in self.trainable_entries:
            self.compute_views[e.name].copy_(self.master_views[e.name])


class HostStore:
    """The host store of every streamed layer: `layers[i]` is the `LayerStore` of decoder layer ``i`` (or ``None``
    when that layer has no streamed parameters).

    Args:
        pin_memory: allocate the compute copy, the master and the gradient buffers in pinned (page-locked) host
            memory; needed for asynchronous copies on CUDA, meaningless on CPU.
    """

    def __init__(self, pin_memory: bool = False):
        self.pin_memory = pin_memory
        self.layers: dict[int, LayerStore] = {}

    def __repr__(self) -> str:
        hb = self.host_bytes()
        return (
            f"HostStore(layers={len(self.layers)}, pin_memory={self.pin_memory}, master={hb['master']}B, "
            f"compute={hb['compute']}B, grad={hb['grad']}B)"
        )

    def _empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        # zeros, not empty: alignment padding is copied along with the data and must be defined.
        t = torch.zeros(n, dtype=dtype, pin_memory=self.pin_memory)
        return t

    def add_layer(
        self,
        index: int,
        kind: str,
        streamed: list[tuple[str, nn.Parameter]],
        resident_trainable: list[str] | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> LayerStore:
        """Copy the given parameters of one layer into new flat host buffers.

        The parameters themselves are not modified here (the executor rebinds ``param.data`` afterwards).
        Trainable parameters are placed first so that master, grad and compute copy share element offsets.
        ``compute_dtype``: the compute copy of fp32 parameters in this dtype (bf16 training of an fp32 model: the
        fp32 master keeps the parameter's own values).
        """
        ordered = [(n, p) for n, p in streamed if p.requires_grad] + [
            (n, p) for n, p in streamed if not p.requires_grad
        ]

        def dtype_of(p: nn.Parameter) -> torch.dtype:
            return compute_dtype if compute_dtype is not None and p.dtype == torch.float32 else p.dtype

        dtypes = {dtype_of(p) for _, p in ordered}
        single = next(iter(dtypes)) if len(dtypes) == 1 else None
        entries: list[ParamEntry] = []
        elem = 0  # next free element in the fp32 master / grad buffers (and, for one dtype, the compute copy)
        byte = 0  # next free byte in the compute copy (mixed dtypes only)
        for name, p in ordered:
            if single is not None:
                # One dtype: element offsets aligned so that byte offsets (elem * itemsize) are aligned too, and
                # every parameter (frozen ones included) shares its element offset with the compute copy.
                elem = _align(elem, max(1, ALIGN_BYTES // single.itemsize))
                b_off, e_off = elem * single.itemsize, elem
                elem += p.numel()
            else:
                b_off = byte = _align(byte)
                byte += p.numel() * dtype_of(p).itemsize
                e_off = -1
                if p.requires_grad:
                    e_off = elem = _align(elem, ALIGN_BYTES // 4)
                    elem += p.numel()
            dt = dtype_of(p)
            entries.append(
                ParamEntry(
                    name,
                    p,
                    p.shape,
                    dt,
                    p.requires_grad,
                    b_off,
                    e_off if p.requires_grad else -1,
                    p.device,
                    p.dtype if dt != p.dtype else None,
                )
            )
        if single is not None:
            byte = elem * single.itemsize
        n_train = max((e.elem_offset + e.numel for e in entries if e.trainable), default=0)
        total_bytes = _align(byte)
        aliased = single == torch.float32
        if aliased:
            compute = self._empty(total_bytes // 4, torch.float32)
            compute_bytes = compute.view(torch.uint8)
            master = compute.narrow(0, 0, n_train) if n_train else None
        else:
            compute_bytes = self._empty(total_bytes, torch.uint8)
            compute = compute_bytes.view(single) if single is not None else None
            master = self._empty(n_train, torch.float32) if n_train else None
        grad = self._empty(n_train, torch.float32) if n_train else None
        ls = LayerStore(
            index=index,
            kind=kind,
            entries=entries,
            master=master,
            compute_bytes=compute_bytes,
            compute=compute,
            grad=grad,
            resident_trainable=list(resident_trainable or []),
            aliased=aliased,
        )
        with torch.no_grad():
            for e in entries:
                cv = e.view_bytes(compute_bytes)
                cv.copy_(e.param.data)
                ls.compute_views[e.name] = cv
                ls.params[e.name] = e.param
                if e.trainable:
                    mv = master.narrow(0, e.elem_offset, e.numel).view(e.shape)
                    if not aliased:
                        mv.copy_(e.param.data)
                    ls.master_views[e.name] = mv
                    ls.grad_views[e.name] = grad.narrow(0, e.elem_offset, e.numel).view(e.shape)
        self.layers[index] = ls
        return ls

    def host_bytes(self) -> dict[str, int]:
        out = {"master": 0, "compute": 0, "grad": 0}
        for ls in self.layers.values():
            for k, v in ls.host_bytes.items():
                out[k] += v
        return out
