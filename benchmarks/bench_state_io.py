"""The out-of-core optimizer step of one unit whose state is on NVMe, against the disk's raw bandwidth and the same
step in RAM, in one run.

For a unit of ``--params`` parameters (default 77M: one Qwen2.5-3B decoder layer, as one tensor) in
``--dir``:

- raw: sequential ``O_DIRECT`` writes then reads of 16 MiB aligned blocks, as many bytes as one update moves (the
  disk's bandwidth for this access size, page cache bypassed);
- nvme: `NvmeState.update_unit` (Note: [The out-of-core optimizer step is chunked]): reads master, gradient and
  8-bit moments chunk by chunk, updates, writes them back with the compute copy;
- ram: the same 8-bit AdamW step on tensors in RAM (`adamw8bit_step`, whole tensor), the compute the chunks hide
  their I/O behind.

Prints medians of ``--reps`` repetitions and the ratios: the update's I/O rate as a fraction of the raw bandwidth,
and the update's time against max(raw I/O time, RAM compute time), the bound a perfect overlap would reach.

    python benchmarks/bench_state_io.py --dir /scratch --params 77000000 --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from lazytrain_hf.optim.kernels import AdamWScalars, adamw8bit_step
from lazytrain_hf.optim.quant import Quantized8bit
from lazytrain_hf.streaming import nvmestate as ns
from lazytrain_hf.streaming.store import HostStore
from lazytrain_hf.streaming.trace import Trace

BLOCK = 16 << 20


def raw_io(path: str, nbytes: int) -> tuple[float, float]:
    """Seconds to write then read ``nbytes`` sequentially with O_DIRECT in 16 MiB aligned blocks."""
    buf = ns.aligned_empty(BLOCK)
    buf.random_(0, 255)
    view = memoryview(buf.numpy()).cast("B")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        n = -(-nbytes // BLOCK)
        t0 = time.perf_counter()
        for k in range(n):
            os.pwrite(fd, view, k * BLOCK)
        os.fdatasync(fd)
        t1 = time.perf_counter()
        for k in range(n):
            os.preadv(fd, [view], k * BLOCK)
        t2 = time.perf_counter()
    finally:
        os.close(fd)
        os.unlink(path)
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--params", type=int, default=77_000_000)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    n = a.params
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(n) * 0.02, requires_grad=True)
    store = HostStore()
    ls = store.add_layer(0, "full_attention", [("w", w)], compute_dtype=torch.bfloat16)
    grad = torch.randn(n) * 1e-3
    trace = Trace(device="cpu")
    state = ns.NvmeState(a.dir, trace)
    try:
        state.add_unit(0, ls)
        state.open_grad(0, ls, accumulate=False)
        ls.grad.copy_(grad)
        state.close_grad(0, ls)
        group = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
        r_bytes, w_bytes = ns.update_bytes([(n, torch.float32, True)], ls.layout.compute_bytes)
        t_nvme = []
        for k in range(a.reps):
            t0 = time.perf_counter()
            state.update_unit(0, [group], "numba", 1.0, k)
            state.commit(k + 1)
            t_nvme.append(time.perf_counter() - t0)
        # the same step in RAM
        p = torch.randn(n) * 0.02
        m = Quantized8bit.zeros(n, 256, True)
        v = Quantized8bit.zeros(n, 256, False)
        out = torch.empty(n, dtype=torch.bfloat16)
        adamw8bit_step(p, grad, m, v, AdamWScalars.make(1e-4, 0.9, 0.999, 1e-8, 0.0, 1, 1.0), out, "numba")  # warm
        t_ram = []
        for k in range(a.reps):
            sc = AdamWScalars.make(1e-4, 0.9, 0.999, 1e-8, 0.0, k + 2, 1.0)
            t0 = time.perf_counter()
            adamw8bit_step(p, grad, m, v, sc, out, "numba")
            t_ram.append(time.perf_counter() - t0)
        raws = [raw_io(os.path.join(state.path, "raw.bin"), max(r_bytes, w_bytes)) for _ in range(a.reps)]
        mode = "O_DIRECT" if state.direct else f"fadvise ({state.io_reason})"
    finally:
        state.close()
    wr = statistics.median(x[0] for x in raws)
    rd = statistics.median(x[1] for x in raws)
    bw_w = max(r_bytes, w_bytes) / wr
    bw_r = max(r_bytes, w_bytes) / rd
    raw_time = r_bytes / bw_r + w_bytes / bw_w
    tn, tr = statistics.median(t_nvme), statistics.median(t_ram)
    io_rate = (r_bytes + w_bytes) / tn
    print(f"unit: {n} parameters, I/O mode {mode}, {a.reps} reps (medians), dir {a.dir}")
    print(f"bytes per update: read {r_bytes / 1e9:.3f} GB, written {w_bytes / 1e9:.3f} GB")
    print(f"raw O_DIRECT 16 MiB blocks: write {bw_w / 1e9:.2f} GB/s, read {bw_r / 1e9:.2f} GB/s")
    print(f"{'':24}{'seconds':>10}")
    print(f"{'raw I/O of those bytes':24}{raw_time:>10.3f}")
    print(f"{'RAM 8-bit AdamW step':24}{tr:>10.3f}")
    print(f"{'NVMe update_unit':24}{tn:>10.3f}")
    print(f"update I/O rate {io_rate / 1e9:.2f} GB/s = {raw_time / tn:.2f} of the raw bandwidth")
    print(f"update / max(raw I/O, RAM step) = {tn / max(raw_time, tr):.2f} (1.00: compute fully hidden)")


if __name__ == "__main__":
    main()
