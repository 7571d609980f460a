"""`measure()`: fill a `HardwareProfile` on the machine it runs on (copy bandwidths, NVMe through a temp file, the CPU
optimizer rate, compute rates; on the CPU every compute class at layer shapes) in a few seconds, cached as JSON for
`lazytrain plan --hardware`."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from .hwprofile import GB, HardwareProfile
from .layertimes import measure_layer_times
from .memterms import MEMORY_PASSES_BWD, MEMORY_PASSES_FWD, rmsnorm_saved
from .timing import median_time, timed_with


def _measure_copy(device: str, nbytes: int, repeats: int) -> tuple[float, float]:
    import torch

    from .. import pinned

    n = nbytes // 2
    if device == "cpu":
        # The CPU executor copies between host buffers; both directions are memcpy.
        a = torch.empty(n, dtype=torch.bfloat16).fill_(1)
        b = torch.empty_like(a)
        b.copy_(a)
        t = median_time(lambda: b.copy_(a), repeats)
        return nbytes / t / GB, nbytes / t / GB
    # an exact-size registered probe, unregistered and freed when it goes (the caching host allocator would keep a
    # power-of-two block page-locked for the life of the process: Note: [The caching host allocator rounds and keeps])
    probe = pinned.PinnedBlock(n * 2, True, "the host bandwidth probe")
    host = probe.tensor.view(torch.bfloat16).fill_(1)
    dev = torch.empty(n, dtype=torch.bfloat16, device=device)

    def h2d() -> None:
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)

    def d2h() -> None:
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize(device)

    h2d()
    d2h()
    return nbytes / median_time(h2d, repeats) / GB, nbytes / median_time(d2h, repeats) / GB


def measure_nvme(directory: str | None, nbytes: int) -> tuple[float, float, int]:
    """Write ``nbytes`` to a temp file with fsync, drop it from the page cache, read it back."""
    import shutil

    directory = directory or tempfile.gettempdir()
    data = os.urandom(1 << 20) * max(1, nbytes >> 20)
    fd, path = tempfile.mkstemp(dir=directory, prefix="lazytrain_nvme_probe_")
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb", buffering=0) as f:
            f.write(data)
            os.fsync(f.fileno())
        t_write = time.perf_counter() - t0
        with open(path, "rb", buffering=0) as f:
            # Without dropping the pages the read would measure the page cache, not the drive.
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            while f.read(1 << 24):
                pass
            t_read = time.perf_counter() - t0
        free = shutil.disk_usage(directory).free
    finally:
        os.unlink(path)
    return len(data) / t_read / GB, len(data) / t_write / GB, int(free)


def _measure_optimizer(num_params: int, repeats: int, optimizer: str) -> tuple[float, str]:
    import torch

    p = torch.nn.Parameter(torch.zeros(num_params))
    p.grad = torch.randn(num_params) * 1e-3
    opt = None
    used = "torch.optim.AdamW(fused=True), fp32 moments"
    if optimizer in ("auto", "hybrid8bit"):
        try:
            from lazytrain_hf.optim import HybridAdamW8bit  # optional: the package's own CPU optimizer

            opt = HybridAdamW8bit([p], lr=1e-5)
            used = "HybridAdamW8bit"
        except (ImportError, AttributeError, TypeError) as e:
            if optimizer == "hybrid8bit":
                raise ImportError(f"measure(optimizer='hybrid8bit'): HybridAdamW8bit is not available ({e}).") from e
    if opt is None:
        try:
            opt = torch.optim.AdamW([p], lr=1e-5, fused=True)
        except (RuntimeError, TypeError):
            opt = torch.optim.AdamW([p], lr=1e-5, foreach=True)
            used = "torch.optim.AdamW(foreach=True), fp32 moments"
    opt.step()  # first step allocates state (and compiles kernels); not timed
    return num_params / median_time(opt.step, repeats), used


def _measure_matmul(device: str, n: int, repeats: int) -> float:
    import torch

    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)

    def mm() -> None:
        a @ b
        if device != "cpu":
            torch.cuda.synchronize(device)

    mm()
    return 2 * n**3 / median_time(mm, repeats) / 1e12


def _cpu_shapes(config: Any, micro_batch_size: int, seq_len: int) -> dict[str, int]:
    """Layer-like shapes for the CPU probes: the config's when given, else a ~100M-parameter Qwen3 layer."""
    if config is None:
        return dict(rows=1024, d=768, inner=2048, H=12, hd=64, T=256)
    d = int(config.hidden_size)
    H = int(config.num_attention_heads)
    hd = int(getattr(config, "head_dim", None) or d // H)
    inner = int(getattr(config, "intermediate_size", None) or 4 * d)
    rows = max(256, min(4096, micro_batch_size * seq_len))
    return dict(rows=rows, d=d, inner=inner, H=H, hd=hd, T=max(64, min(1024, seq_len)))


def _measure_cpu_compute(shapes: dict[str, int], repeats: int) -> dict[str, float]:
    """Rates of the CPU "device" at layer shapes (fp32, what the CPU executor computes in).

    - ``gemm``: FLOP/s of ``linear`` at a decoder layer's projection shapes (tokens x d -> inner, inner -> d,
      d -> d), total FLOPs over total time (not one square matmul: small-K and skinny shapes run slower);
      ``gemm_bwd``: the input and weight gradients of the up projection;
    - ``attention`` / ``attention_bwd``: SDPA, causal, FLOPs counted as the cost model does (halved by the mask);
    - ``linear_attention`` / ``moe``: batched matmuls of the chunked delta rule ([B*H, 64, 128] x [128, 64]) and of
      grouped experts ([E, rows/E, d] x [E, d, inner/4]);
    - ``memory_bytes_per_s``: an RMSNorm + SiLU * up block forward and backward, bytes counted the cost model's way
      (``MEMORY_PASSES_FWD + MEMORY_PASSES_BWD`` times the bytes it saves for backward);
    - ``kernel_s``: one tiny op with autograd (a chain of scalar multiplies, forward + backward, per kernel).
    """
    import torch

    t = shapes
    rows, d, inner = t["rows"], t["d"], t["inner"]
    x = torch.randn(rows, d)
    w_up, w_down, w_sq = torch.randn(inner, d), torch.randn(d, inner), torch.randn(d, d)
    h = torch.randn(rows, inner)
    F = torch.nn.functional

    def gemms() -> None:
        F.linear(x, w_up)
        F.linear(h, w_down)
        F.linear(x, w_sq)

    gemms()
    gemm = 2 * rows * d * (2 * inner + d) / median_time(gemms, repeats)
    gy = torch.randn(rows, inner)

    def gemms_bwd() -> None:
        # the up projection's input gradient and weight gradient (the weight gradient's transposed operand is what
        # makes backward GEMMs slower than forward ones on CPUs)
        gy @ w_up
        gy.t() @ x

    gemms_bwd()
    gemm_bwd = 2 * 2 * rows * d * inner / median_time(gemms_bwd, repeats)

    B = max(1, rows // t["T"])
    q = torch.randn(B, t["H"], t["T"], t["hd"], requires_grad=True)
    attn_flops = 2 * B * t["H"] * t["T"] ** 2 * t["hd"]

    def sdpa():
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    sdpa()
    attention = attn_flops / median_time(sdpa, repeats)
    out = sdpa()
    go = torch.randn_like(out)

    def sdpa_bwd() -> None:
        sdpa().backward(go)

    sdpa_bwd()
    t_fb = median_time(sdpa_bwd, repeats)
    attention_bwd = 2 * attn_flops / max(t_fb - attn_flops / attention, 1e-9)

    bh = max(1, rows // 64) * 4  # (token chunks) x heads
    a, b = torch.randn(bh, 64, 128), torch.randn(bh, 128, 64)
    linear = 2 * bh * 64 * 128 * 64 / median_time(lambda: torch.bmm(a, b), repeats)
    E = 8
    ea, eb = torch.randn(E, max(1, rows // E), d), torch.randn(E, d, max(1, inner // 4))
    moe = 2 * E * max(1, rows // E) * d * max(1, inner // 4) / median_time(lambda: torch.bmm(ea, eb), repeats)

    xr = torch.randn(rows, inner, requires_grad=True)
    up = torch.randn(rows, inner, requires_grad=True)
    nw = torch.ones(inner, requires_grad=True)
    gz = torch.randn(rows, inner)

    def elementwise() -> None:
        # Qwen3RMSNorm then SiLU(gate) * up: fp32 upcast, pow/mean/rsqrt, weight, silu, product
        h32 = xr.float()
        var = h32.pow(2).mean(-1, keepdim=True)
        normed = nw * (h32 * torch.rsqrt(var + 1e-6))
        (F.silu(normed) * up).backward(gz)

    elementwise()
    # saved: the RMSNorm's (fp32 in, rsqrt, normed), silu input, silu output and up (the product's operands)
    saved = rmsnorm_saved(rows, inner, 4, False) + 3 * rows * inner * 4
    memory = (MEMORY_PASSES_FWD + MEMORY_PASSES_BWD) * saved / median_time(elementwise, repeats)

    z = torch.ones(1, requires_grad=True)
    n_ops = 200

    def tiny() -> None:
        y = z
        for _ in range(n_ops):
            y = y * 1.0
        y.backward()

    tiny()
    kernel = median_time(tiny, repeats) / (3 * n_ops)  # the model counts a forward kernel once, backward twice
    return dict(
        gemm=gemm,
        gemm_bwd=gemm_bwd,
        attention=attention,
        attention_bwd=attention_bwd,
        linear_attention=linear,
        moe=moe,
        memory_bytes_per_s=memory,
        kernel_s=kernel,
    )


def measure(
    cache_path: str | None = None,
    device: str | None = None,
    *,
    nvme_dir: str | None = None,
    copy_bytes: int = 128 * 2**20,
    nvme_bytes: int = 64 * 2**20,
    optimizer_params: int = 4_000_000,
    optimizer: str = "auto",
    matmul_size: int | None = None,
    repeats: int = 3,
    config: Any = None,
    micro_batch_size: int = 1,
    seq_len: int = 128,
    use_cache: bool = True,
    timer: Any = None,
) -> HardwareProfile:
    """Measure this machine and return a `HardwareProfile` (a few seconds on CPU).

    Measures pinned copy bandwidth both ways (host memcpy on CPU), NVMe read/write through a temp file in
    ``nvme_dir`` (fsync, page cache dropped before the read), the CPU optimizer rate (``HybridAdamW8bit`` when the
    package provides it, else torch fused AdamW; named in ``source``), the compute rates and, when ``config`` is
    given, per-kind forward/backward times of one decoder layer at ``micro_batch_size`` x ``seq_len``.

    Compute rates: on CUDA one ``matmul_size``-square bf16 matmul (taken as ``peak_tflops`` with
    ``achievable_fraction`` 1, since it is already what kernels reach). On the CPU (fp32, the CPU executor's dtype)
    every compute class at layer shapes (``config``'s when given, else a ~100M-parameter Qwen3 layer): the GEMM rate
    of a layer's projections is ``peak_tflops`` (``achievable_fraction`` 1), SDPA forward / backward, the delta
    rule's and the experts' batched matmuls become ``efficiency`` relative to it, the memory-bound passes of an
    RMSNorm + SwiGLU block ``memory_gbps`` and one tiny autograd op ``kernel_overhead_s`` (`_measure_cpu_compute`).
    The profile has ``serial_lanes`` (Note: [Serial lanes on the CPU device]).

    Args:
        cache_path: JSON path. When it exists and ``use_cache`` is true it is loaded instead of measuring; otherwise
            the new profile is written there.
        device: ``"cpu"`` or a CUDA device (default: ``"cuda"`` when available, else ``"cpu"``).
        config: an HF config (or zoo config) whose decoder layers are timed, one per layer kind.
        timer: the clock of the compute, copy and optimizer probes (default ``time.perf_counter``); with one torch
            thread on a shared machine ``time.process_time`` counts only this process's work. NVMe is timed by the
            wall clock always (its time is spent waiting).
    """
    if cache_path and use_cache and os.path.isfile(cache_path):
        return HardwareProfile.from_json(cache_path)
    import psutil  # shipped with accelerate
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = str(device)
    if device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"measure(device={device!r}): CUDA is not available here; pass device='cpu'.")
    if repeats < 1:
        raise ValueError(f"measure(repeats={repeats}) must be >= 1.")

    nvme_r, nvme_w, nvme_free = measure_nvme(nvme_dir, nvme_bytes)
    with timed_with(timer):
        h2d, d2h = _measure_copy(device, copy_bytes, repeats)
        opt_rate, opt_used = _measure_optimizer(optimizer_params, repeats, optimizer)
        efficiency: dict[str, float] = {}
        memory_gbps = kernel_s = 0.0
        if device == "cpu":
            # the CPU "device" at layer shapes: every class as a fraction of the layer-shape GEMM rate
            rates = _measure_cpu_compute(_cpu_shapes(config, micro_batch_size, seq_len), repeats)
            tflops = rates["gemm"] / 1e12
            efficiency = {
                k: min(1.0, max(1e-4, rates[k] / rates["gemm"]))
                for k in ("gemm_bwd", "attention", "attention_bwd", "linear_attention", "moe")
            }
            memory_gbps = rates["memory_bytes_per_s"] / GB
            kernel_s = rates["kernel_s"]
        else:
            tflops = _measure_matmul(device, matmul_size or 8192, repeats)
    host = int(psutil.virtual_memory().total)
    if device == "cpu":
        dev_mem = host
        name = "measured-cpu"
    else:
        dev_mem = int(torch.cuda.get_device_properties(device).total_memory)
        name = "measured-" + torch.cuda.get_device_name(device).lower().replace(" ", "-")
    profile = HardwareProfile(
        name=name,
        device_memory_bytes=dev_mem,
        peak_tflops=tflops,
        achievable_fraction=1.0,
        h2d_gbps=h2d,
        d2h_gbps=d2h,
        nvme_read_gbps=nvme_r,
        nvme_write_gbps=nvme_w,
        nvme_capacity_bytes=nvme_free,
        host_memory_bytes=host,
        cpu_optimizer_params_per_s=opt_rate,
        device_type="cpu" if device == "cpu" else "cuda",
        memory_gbps=memory_gbps,
        kernel_overhead_s=kernel_s,
        efficiency=efficiency,
        source=f"measured by lazytrain_hf.planner.hardware.measure() on {device} at {time.strftime('%Y-%m-%d')}; "
        f"optimizer: {opt_used}",
    )
    if config is not None:
        with timed_with(timer):
            profile.layer_times = measure_layer_times(config, device, micro_batch_size, seq_len, repeats)
        profile.layer_times_shape = [micro_batch_size, seq_len]
    if cache_path:
        profile.to_json(cache_path)
    return profile
