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

Memory: the fp32 masters are pageable (only the optimizer on the host reads and writes them); the compute copy and
the gradient accumulators (what host<->device copies read and write) are pinned on CUDA, each allocated at its exact
size (Note: [Pinned blocks are registered, not cached]). A layer is laid out by `layer_layout`
(`lazytrain_hf.planner.layouts`, re-exported here with `ALIGN_BYTES`, `align_up` and `LayerLayout`), the same
function the host-memory accounting (`lazytrain_hf.planner.hostmem`) sizes it with, so the accounting is the store's
byte count.
Parameters left on disk (`lazytrain_hf.from_pretrained`, meta tensors with a `DiskSource`) are read one layer at a
time straight into the layer's buffers (Note: [A layer is read from disk into its buffers]).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .. import pinned
from ..planner.layouts import ALIGN_BYTES, LayerLayout, align_up, layer_layout  # noqa: F401 (re-exported)


# Note: [Pinned blocks are registered, not cached]
#     PyTorch's caching host allocator (`pin_memory=True`) rounds every block up to a power of two
#     (`CachingHostAllocator.h`): a 300 MiB layer would take 512 MiB of page-locked memory. The store instead
#     allocates each pinned buffer at its exact size and page-locks it in place with ``cudaHostRegister``
#     (`lazytrain_hf.pinned.PinnedBlock`), unregistered before the buffer is freed (Note: [Unregister before free] in
#     lazytrain_hf/pinned.py), so the pinned bytes are exactly the layout's. `torch.Tensor.is_pinned()` is True for
#     such memory and asynchronous copies treat it as pinned.
def pinned_zeros(n: int, dtype: torch.dtype, pin: bool, keep: list) -> torch.Tensor:
    """A zero-filled host tensor of exactly ``n`` elements (zeros: alignment padding is copied along with the data
    and must be defined), page-locked when ``pin``; its `PinnedBlock` is appended to ``keep``, whose owner releases
    it (Note: [Pinned blocks are registered, not cached])."""
    return pinned.pinned_empty(n, dtype, pin, keep, "a host store buffer")


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None)
    except OSError:
        return None


def _load_malloc_trim():
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:  # not glibc (macOS, musl): nothing to give back this way
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def trim_heap() -> bool:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim(0)``); False where there is no such call or
    nothing was given back.

    Note: [Freed host memory goes back to the OS after each layer is built]
        Building the host store frees host memory as it goes: a layer read from disk (`DiskSource`) is dropped once
        copied into its buffers, and a parameter's own storage once it points at the store. glibc keeps freed
        blocks below its mmap threshold (which rises up to 32 MiB as blocks are freed: a decoder layer's matrices)
        in the heap, where a page stays resident after its block is freed unless the whole heap top is free. A
        partly reused heap then keeps one or more layers' worth of freed pages resident for the life of the
        process, and in a data-parallel run every rank does (up to 1.2 GB per rank measured: the 651M model of
        BENCHMARKS.md "Data parallel", where every rank reads every layer to write the node's compute copy). The
        store therefore calls `trim_heap` after each layer it builds (``malloc_trim`` walks the free blocks and
        returns their whole pages, a few ms). Test: tests/test_given_back.py (``test_store_build_leaves_no_freed_
        heap_resident``).
    """
    return bool(_MALLOC_TRIM(0)) if _MALLOC_TRIM is not None else False


# glibc's mallopt parameter, and the threshold a partitioned run fixes (Note: [A rank's large blocks are mapped])
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve host blocks of ``nbytes`` and more from mappings of their own (glibc ``mallopt(M_MMAP_THRESHOLD)``),
    unless the user set the threshold (``MALLOC_MMAP_THRESHOLD_``, or ``mmap_threshold`` in ``GLIBC_TUNABLES``);
    False where not done (not glibc, or the user's setting stands).

    Note: [A rank's large blocks are mapped]
        glibc serves a block from its own mapping (returned to the OS when freed) when it is above the mmap
        threshold, else from the heap, where freed pages stay resident. The threshold starts at 128 KiB and
        rises, up to 32 MiB, to the size of each mapped block freed: once a process freed one 28 MB matrix, every
        block up to that size goes to the heap. Whether that happened depends on the order of the frees before
        training (transformers building the model, the store build), so ranks of one data-parallel run differed:
        measured on the 651M model of BENCHMARKS.md "Data parallel", 4 ranks, ranks with a raised threshold held a
        heap of 1.5-1.7 GB during the steps with 0.8 GB of it in use (the rest: freed activations and staging
        touched once), the others 0.7 GB; training PSS summed over the ranks 12.1 GB, 10.5 GB with the threshold
        fixed at 1 MiB from the start (``MALLOC_MMAP_THRESHOLD_``). A partitioned run (`HostStore.owned` set:
        `StreamHandle` with ``unit_owners``) therefore fixes it, which also turns the dynamic adjustment off, and so
        does `lazytrain_hf.from_pretrained` under a launcher of several ranks (``WORLD_SIZE`` > 1) before it builds
        the model: fixed only at the store build it comes too late, after building the model left a 1.6 GB free
        heap region that the steps then touch (measured: 12.8 GB summed). A one-process run keeps glibc's
        behaviour (measured: its heap in use at its peak, no waste). The setting stays for the process. Test:
        tests/test_given_back.py (``test_a_rank_maps_its_large_blocks``).
    """
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(int(nbytes))))


class PinnedArena:
    """One host block of exactly ``nbytes`` (page-locked when ``pin``: Note: [Pinned blocks are registered, not
    cached]), carved into aligned views: the compute copies and gradient accumulators of every layer (and, through
    `carve`, any other pinned buffer such as the activation tier's) come out of a single registration with no
    rounding waste. Sized by the plan before the store is built (`lazytrain_hf.planner.hostmem`:
    ``HostFootprint.pinned_bytes``)."""

    def __init__(self, nbytes: int, pin: bool):
        self._pins: list = []
        self.block = pinned_zeros(int(nbytes), torch.uint8, pin, self._pins)
        self.used = 0

    def __repr__(self) -> str:
        return f"PinnedArena(nbytes={self.block.numel()}, used={self.used}, pinned={self._pins[0].pinned})"

    def carve(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed view of ``n`` elements of ``dtype`` at the next `ALIGN_BYTES` boundary."""
        start = align_up(self.used)
        nbytes = n * dtype.itemsize
        if start + nbytes > self.block.numel():
            raise ValueError(
                f"PinnedArena of {self.block.numel()} bytes cannot hold {nbytes} more bytes at offset {start}: it was "
                "sized for another model or plan; size it with hostmem.HostFootprint.pinned_bytes for this one."
            )
        self.used = start + nbytes
        return self.block.narrow(0, start, nbytes).view(dtype).zero_()


def poisoned(shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` with no memory of its own: every element is one NaN (0 for integer dtypes),
    zero strides; no view of anything (a view would keep its base's buffer alive). Stands for data that is not in
    RAM (`lazytrain_hf.streaming.nvmestate`), so a read that should not happen sees garbage, not stale values."""
    out = torch.empty(0, dtype=dtype)
    one = torch.full((1,), float("nan") if dtype.is_floating_point else 0, dtype=dtype)
    out.set_(one.untyped_storage(), 0, tuple(shape), (0,) * len(tuple(shape)))
    return out


class DiskSource:
    """Where the weights of parameters left on disk are read from (`lazytrain_hf.from_pretrained`).

    ``read(names)`` returns ``{name: tensor}`` for the given canonical parameter names (as in the
    ``*ForCausalLM`` model's ``named_parameters()``), read (and converted to the model's layout) from the files,
    nothing else. A parameter left on disk is a meta tensor with attribute ``_lazytrain_disk = (source, name)``.
    """

    def __init__(self, read: Callable[[list[str]], dict[str, torch.Tensor]], description: str = ""):
        self.read = read
        self.description = description

    def __repr__(self) -> str:
        return f"DiskSource({self.description})"


DISK_ATTR = "_lazytrain_disk"


def disk_source(p: torch.Tensor) -> tuple[DiskSource, str] | None:
    """``(source, name)`` of a parameter left on disk, or None."""
    return getattr(p, DISK_ATTR, None) if p.device.type == "meta" else None


def _swap_in(p: nn.Parameter, data: torch.Tensor) -> None:
    """Make the meta parameter ``p`` (same Python object: modules, optimizers and hooks keep it) a host parameter
    over ``data``: ``param.data = ...`` cannot change a meta tensor's type, `torch.utils.swap_tensors` can."""
    torch.utils.swap_tensors(p, nn.Parameter(data, requires_grad=p.requires_grad))


def has_disk_source(p: torch.Tensor) -> bool:
    """The parameter is a meta tensor whose weights the host store reads from disk (`add_layer`)."""
    return disk_source(p) is not None


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
    from_disk: bool = False  # the parameter was left on disk (a `DiskSource`) before attach

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
    # Note: [The training state is partitioned by unit] (planner/world.py): another rank owns this unit's master,
    # moments and gradient accumulator; this rank holds only its compute copy (``master`` and ``grad`` are None)
    remote: bool = False
    # Note: [Masters live in the node's segment] (training/dataparallel.py): ``master`` is a view of the
    # node's segment of fp32 masters (copy-on-write), given to the parameters as it is by `remove()`
    masters_shared: bool = False
    layout: LayerLayout | None = None
    # Note: [A frozen parameter keeps its own values]: name -> the original tensor, or (DiskSource, key) when on disk
    frozen_originals: dict[str, object] = field(default_factory=dict, repr=False)
    _pins: list = field(default_factory=list, repr=False)  # Note: [Pinned blocks are registered, not cached]

    def frozen_values(self) -> dict[str, torch.Tensor]:
        """The original values of the frozen parameters whose compute copy is in another dtype, by name.

        Note: [A frozen parameter keeps its own values]
            With a compute copy in another dtype (``bf16=True`` on an fp32 model) the store holds a frozen
            parameter only rounded (it has no fp32 master: nothing updates it). `remove()` must not give the
            parameter that rounded copy back: frozen weights (a frozen layer, a PEFT base) are bit-identical after
            `train()` and `evaluate()`. The store therefore keeps the parameter's original tensor (the resident
            parameters' `resident_fp32` does the same), or, for a parameter left on disk, where to read it again.
        """
        out: dict[str, torch.Tensor] = {}
        by_source: dict[int, tuple[DiskSource, dict[str, str]]] = {}
        for name, orig in self.frozen_originals.items():
            if isinstance(orig, torch.Tensor):
                out[name] = orig
            else:
                source, key = orig
                by_source.setdefault(id(source), (source, {}))[1][key] = name
        dtypes = {e.name: e.orig_dtype for e in self.entries}
        for source, names in by_source.values():
            for key, value in source.read(list(names)).items():
                out[names[key]] = value.to(dtypes[names[key]])  # as `add_layer` cast it on the way in
        return out

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

    def release_pinned(self) -> None:
        """Unregister and drop this layer's pinned blocks (Note: [Unregister before free] in lazytrain_hf/pinned.py);
        what still views them stays valid, as pageable memory."""
        for block in self._pins:
            block.release()
        self._pins.clear()

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
        pin_memory: page-lock the compute copy and the gradient buffers (the fp32 masters stay pageable), each at
            its exact size (Note: [Pinned blocks are registered, not cached]); needed for asynchronous copies on
            CUDA, meaningless on CPU.
    """

    def __init__(self, pin_memory: bool = False):
        self.pin_memory = pin_memory
        self.layers: dict[int, LayerStore] = {}
        self.arena: PinnedArena | None = None
        # called as on_add(index, layer_store) once a layer is built (the state on NVMe takes it over right away, so
        # building the store never holds more than one such layer in RAM: lazytrain_hf.streaming.nvmestate)
        self.on_add: Callable[[int, LayerStore], None] | None = None
        # layers whose gradient accumulator lives elsewhere (their state file): no grad buffer is allocated for them
        self.no_grad_buffer: set[int] = set()
        # Note: [The training state is partitioned by unit] (planner/world.py): the units whose training state this
        # process holds (None: every unit); the others get a compute copy only (`LayerStore.remote`)
        self.owned: set[int] | None = None
        # Note: [The node's compute copy is shared by its ranks] (training/dataparallel.py): a `NodeCopy` every
        # unit's compute copy is carved from (the same sequence on every local rank); ``shared_compute[i]``: unit i's
        # bytes there (kept when the state on NVMe takes ``compute_bytes`` away)
        self.node_copy = None
        self.shared_compute: dict[int, torch.Tensor] = {}
        # Note: [Masters live in the node's segment] (training/dataparallel.py): an owned unit's fp32 masters of a
        # compute copy in another dtype, in the node's segment of masters ({unit key: buffer}); else its own memory
        self.node_masters: dict[int, torch.Tensor] = {}

    def reserve(self, nbytes: int) -> PinnedArena:
        """Allocate the pinned arena the layers added next carve their compute copy and gradient accumulators from
        (one registration for the whole store instead of one per buffer); ``nbytes`` from
        ``hostmem.HostFootprint.pinned_bytes``. Without it each buffer is its own exact-size block."""
        self.arena = PinnedArena(nbytes, self.pin_memory)
        return self.arena

    def _compute_buffer(self, n: int, dtype: torch.dtype, pins: list, pin: bool) -> torch.Tensor:
        if self.node_copy is not None:  # every local rank writes the same initial values
            return self.node_copy.carve(n, dtype)
        return self._pinned(n, dtype, pins, pin)

    def _pinned(self, n: int, dtype: torch.dtype, pins: list, pin: bool = True) -> torch.Tensor:
        if self.arena is not None and pin:
            return self.arena.carve(n, dtype)
        return pinned_zeros(n, dtype, self.pin_memory and pin, pins)

    def __repr__(self) -> str:
        hb = self.host_bytes()
        return (
            f"HostStore(layers={len(self.layers)}, pin_memory={self.pin_memory}, master={hb['master']}B, "
            f"compute={hb['compute']}B, grad={hb['grad']}B)"
        )

    def add_layer(
        self,
        index: int,
        kind: str,
        streamed: list[tuple[str, nn.Parameter]],
        resident_trainable: list[str] | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> LayerStore:
        """Copy the given parameters of one layer into new flat host buffers (laid out by `layer_layout`).

        Trainable parameters are placed first so that master, grad and compute copy share element offsets.
        ``compute_dtype``: the compute copy of fp32 parameters in this dtype (bf16 training of an fp32 model: the
        fp32 master keeps the parameter's own values).

        Each parameter's ``data`` is pointed at the store as soon as its values are there: at its compute view, or,
        when the compute copy is in another dtype, at its fp32 master view (same values), so that the parameter's
        own storage is freed layer by layer while the store is built instead of once the whole model has a second
        copy. The executor rebinds ``param.data`` to the compute view afterwards.

        Note: [A layer is read from disk into its buffers]
            A meta parameter with a `DiskSource` (`lazytrain_hf.from_pretrained`) is read here, together with the
            other such parameters of this layer only (one ``read`` per layer), copied into the buffers and
            dropped: reading the whole model never holds more than one layer's tensors besides the store. Its
            ``orig_device`` is the CPU, so `remove()` gives it its trained values on the host.
        """
        layout = layer_layout([(p.numel(), p.dtype, p.requires_grad) for _, p in streamed], compute_dtype)
        ordered = [streamed[i] for i in layout.order]
        entries: list[ParamEntry] = []
        for (name, p), (b_off, e_off, dt) in zip(ordered, layout.offsets):
            on_disk = has_disk_source(p)
            entries.append(
                ParamEntry(
                    name,
                    p,
                    p.shape,
                    dt,
                    p.requires_grad,
                    b_off,
                    e_off,
                    torch.device("cpu") if on_disk else p.device,
                    p.dtype if dt != p.dtype else None,
                    on_disk,
                )
            )
        pins: list = []
        # a unit whose state moves to NVMe (`on_add`) leaves RAM at once: pinning its buffers would buy nothing
        pin = index not in self.no_grad_buffer
        n_train, aliased = layout.train_elems, layout.aliased
        remote = bool(n_train) and self.owned is not None and index not in self.owned
        own = n_train and not remote  # the unit's master and accumulator live here
        if aliased:
            compute = self._compute_buffer(layout.compute_bytes // 4, torch.float32, pins, pin)
            compute_bytes = compute.view(torch.uint8)
            master = compute.narrow(0, 0, n_train) if own else None
        else:
            single = {e.dtype for e in entries}
            compute_bytes = self._compute_buffer(layout.compute_bytes, torch.uint8, pins, pin)
            compute = compute_bytes.view(next(iter(single))) if len(single) == 1 else None
            # the masters are read and written by the host optimizer only: pageable
            master = None
            if own:
                # a unit whose state moves to NVMe leaves RAM at once (its masters would stay in the segment)
                master = None if index in self.no_grad_buffer else self.node_masters.get(index)
                if master is None:
                    master = torch.zeros(n_train, dtype=torch.float32)
                elif master.numel() != n_train or master.dtype != torch.float32:
                    raise ValueError(
                        f"unit {index}: the node's masters segment holds {master.numel()} {master.dtype} elements, "
                        f"the unit has {n_train} fp32 masters; the segment was laid out for another model or plan."
                    )
        grad = None
        if own:
            if index in self.no_grad_buffer:
                grad = poisoned((n_train,), torch.float32)  # a placeholder: the unit's state file holds it
            else:
                grad = self._pinned(n_train, torch.float32, pins)
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
            remote=remote,
            layout=layout,
            _pins=pins,
        )
        # Note: [A layer is read from disk into its buffers]
        from_disk: dict[int, list[str]] = {}
        sources: dict[int, DiskSource] = {}
        for e in entries:
            ds = disk_source(e.param)
            if ds is not None:
                from_disk.setdefault(id(ds[0]), []).append(ds[1])
                sources[id(ds[0])] = ds[0]
        loaded: dict[str, torch.Tensor] = {}
        for key, names in from_disk.items():
            loaded.update(sources[key].read(names))
        with torch.no_grad():
            for e in entries:
                cv = e.view_bytes(compute_bytes)
                ds = disk_source(e.param)
                src = e.param.data
                if ds is not None:
                    src = loaded.pop(ds[1], None)
                    if src is None or tuple(src.shape) != tuple(e.shape):
                        raise ValueError(
                            f"the weights of {e.name!r} ({ds[0]!r}) have shape "
                            f"{None if src is None else tuple(src.shape)}, the model expects {tuple(e.shape)}; "
                            "the checkpoint was written for another model configuration."
                        )
                    if src.dtype != (e.orig_dtype or e.dtype):
                        src = src.to(e.orig_dtype or e.dtype)  # as from_pretrained(dtype=...) casts
                cv.copy_(src)
                ls.compute_views[e.name] = cv
                ls.params[e.name] = e.param
                if e.trainable and own:
                    mv = master.narrow(0, e.elem_offset, e.numel).view(e.shape)
                    if not aliased:
                        mv.copy_(src)
                    ls.master_views[e.name] = mv
                    ls.grad_views[e.name] = (
                        poisoned(e.shape, torch.float32)
                        if index in self.no_grad_buffer
                        else grad.narrow(0, e.elem_offset, e.numel).view(e.shape)
                    )
                if not e.trainable and e.orig_dtype is not None:
                    # Note: [A frozen parameter keeps its own values]
                    ls.frozen_originals[e.name] = ds if ds is not None else e.param.data
                # the parameter's own storage is released now (same values); a meta parameter becomes a host one
                target = cv if e.orig_dtype is None else ls.master_views.get(e.name)
                if ds is not None:
                    _swap_in(e.param, cv if target is None else target)
                elif target is not None:
                    e.param.data = target
                del src
        loaded.clear()
        trim_heap()  # Note: [Freed host memory goes back to the OS after each layer is built]
        self.layers[index] = ls
        if self.node_copy is not None:
            self.shared_compute[index] = compute_bytes
        if self.on_add is not None:
            self.on_add(index, ls)
        return ls

    def host_bytes(self) -> dict[str, int]:
        out = {"master": 0, "compute": 0, "grad": 0}
        for ls in self.layers.values():
            for k, v in ls.host_bytes.items():
                out[k] += v
        return out
