"""The chunked out-of-core optimizer step of the training state on NVMe (Note: [The out-of-core optimizer step is
chunked] in nvmestate.py).

Owns `ChunkedUpdate`, a base class of `lazytrain_hf.streaming.nvmestate.NvmeState` (as the streaming handle is built
of its parts): `update_unit` reads a unit's masters, gradients and 8-bit moments chunk by chunk from generation
``g`` of its file, runs the AdamW kernels on each chunk and writes generation ``1 - g`` and the compute copy back;
`skip_unit` and `check_optimizer` go with it. The file layout, raw I/O and the commit are `NvmeState`'s: this class
uses its ``units``, ``trace``, ``block_size``, ``_pread`` / ``_pwrite`` / ``_read_range`` and reader / writer
threads.
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch

from ..optim.kernels import AdamWScalars, adamw8bit_step, adamw32_step
from ..optim.quant import Quantized8bit, num_blocks
from ..planner.layouts import IO_ALIGN
from .statelayout import aligned_empty


class ChunkedUpdate:
    """The out-of-core optimizer step of `NvmeState` (see the module docstring)."""

    def check_optimizer(self, optimizer, where: dict[int, tuple[int, int]], masters: dict[int, list]) -> None:
        """The optimizer's 8-bit layout must be the one the files were laid out with."""
        for ms in masters.values():
            for m in ms:
                g = optimizer.param_groups[where[id(m)][0]]
                if g["block_size"] != self.block_size or g["min_8bit_size"] != self.min_8bit_size:
                    raise ValueError(
                        f"the optimizer's block_size={g['block_size']}, min_8bit_size={g['min_8bit_size']} differ "
                        f"from the layout of the state on NVMe ({self.block_size}, {self.min_8bit_size}); pass the "
                        "same optim_block_size / optim_min_8bit_size to LazyTrainingArguments."
                    )

    def update_unit(self, key: int, groups: list[dict], backend: str, clip: float, step: int) -> None:
        """One AdamW step of unit ``key`` out of core (Note: [The out-of-core optimizer step is chunked]).

        ``groups``: per trainable parameter in store order, its frozen hyperparameter group.
        """
        u = self.units[key]
        old, new = u.gen, 1 - u.gen
        self._in_pass = True  # compute copies may now be ahead of the committed state until `commit`
        trace = self.trace
        cwin = aligned_empty(u.compute_bytes)
        if u.has_frozen:
            trace.transfer("nvme_read", u.compute_bytes, "uint8", key, "compute")
            self._pread(u, cwin, u.compute_bytes, 0)
        else:
            cwin[: u.compute_bytes].zero_()
        tasks = [(k, p, a, b) for k, p in enumerate(u.params) for a, b in p.chunks()]

        def load(task):
            _, p, a, b = task
            n = b - a
            w = {"master": aligned_empty(4 * n), "grad": aligned_empty(4 * n + 2 * IO_ALIGN)}
            self._pread(u, w["master"], 4 * n, p.master[old] + 4 * a)
            trace.transfer("nvme_read", 4 * n, torch.float32, key, "master", step=step)
            w["g"] = self._read_range(u, w["grad"], u.grad_off + 4 * (p.elem_offset + a), 4 * n).view(torch.float32)
            trace.transfer("nvme_read", 4 * n, torch.float32, key, "grad", step=step)
            if p.q8:
                bs = self.block_size
                ba, bb = a // bs, num_blocks(b, bs)
                for name in ("m_codes", "v_codes"):
                    w[name] = aligned_empty(n)
                    self._pread(u, w[name], n, getattr(p, name)[old] + a)
                for name in ("m_abs", "v_abs"):
                    w[name] = aligned_empty(4 * (bb - ba))
                    self._pread(u, w[name], 4 * (bb - ba), getattr(p, name)[old] + p.abs_at(a))
                trace.transfer("nvme_read", 2 * n + 8 * (bb - ba), torch.uint8, key, "moments", step=step)
            return w

        def store(task, w):
            _, p, a, b = task
            n = b - a
            self._pwrite(u, w["master"], 4 * n, p.master[new] + 4 * a)
            trace.transfer("nvme_write", 4 * n, torch.float32, key, "master", step=step)
            if p.q8:
                bs = self.block_size
                ba, bb = a // bs, num_blocks(b, bs)
                for name in ("m_codes", "v_codes"):
                    self._pwrite(u, w[name], n, getattr(p, name)[new] + a)
                for name in ("m_abs", "v_abs"):
                    self._pwrite(u, w[name], 4 * (bb - ba), getattr(p, name)[new] + p.abs_at(a))
                trace.transfer("nvme_write", 2 * n + 8 * (bb - ba), torch.uint8, key, "moments", step=step)

        steps: dict[str, int] = {}
        reads: deque = deque()
        writes: deque = deque()
        try:
            for t in tasks[:2]:
                reads.append(self._reader.submit(load, t))
            for idx, task in enumerate(tasks):
                k, p, a, b = task
                w = reads.popleft().result()
                if idx + 2 < len(tasks):
                    reads.append(self._reader.submit(load, tasks[idx + 2]))
                n = b - a
                group = groups[k]
                beta1, beta2 = group["betas"]
                pstep = p.step + 1
                steps[p.name] = pstep
                scalars = AdamWScalars.make(
                    group["lr"], beta1, beta2, group["eps"], group["weight_decay"], pstep, clip
                )
                master = w["master"][: 4 * n].view(torch.float32)
                grad = w["g"]
                boff, _, cdt = u.compute_views[k]
                out = None
                if u.fused:
                    out = cwin.narrow(0, boff + 2 * a, 2 * n).view(torch.bfloat16)
                if p.q8:
                    bs = self.block_size
                    nb = num_blocks(b, bs) - a // bs
                    m = Quantized8bit(w["m_codes"][:n], w["m_abs"][: 4 * nb].view(torch.float32), bs, True)
                    v = Quantized8bit(w["v_codes"][:n], w["v_abs"][: 4 * nb].view(torch.float32), bs, False)
                    adamw8bit_step(master, grad, m, v, scalars, out, backend)
                else:
                    adamw32_step(master, grad, p.small[0].narrow(0, a, n), p.small[1].narrow(0, a, n), scalars, out)
                if out is None:  # the compute copy from the master, as `LayerStore.sync` does
                    cwin.narrow(0, boff + cdt.itemsize * a, cdt.itemsize * n).view(cdt).copy_(master)
                while len(writes) >= 2:
                    writes.popleft().result()
                writes.append(self._writer.submit(store, task, w))
            while writes:
                writes.popleft().result()
            trace.transfer("nvme_write", u.compute_bytes, "uint8", key, "compute", step=step)
            self._pwrite(u, cwin, u.compute_bytes, 0)
        except BaseException:
            for f in (*reads, *writes):
                with contextlib.suppress(BaseException):
                    f.result()
            raise
        u.pending = steps

    def skip_unit(self, key: int) -> None:
        """The unit had no gradient this step: its committed generation stays."""
        self.units[key].pending = None
