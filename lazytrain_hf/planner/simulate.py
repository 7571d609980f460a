"""Discrete-event replay of a plan: the referee for the MILP's predictions.

Written from the executor's behaviour, not from the MILP's constraints: five FIFO lanes (``compute``, ``h2d``,
``d2h``, ``nvme``, ``cpu`` optimizer) run tasks in program order; a task starts when its lane is free, when it has
been issued and when the tasks it depends on have finished. Stages do not synchronise the copy lanes: a transfer
issued early simply runs while compute proceeds, and a compute task waits only for the data it reads.

- A stage begins when the previous compute ends (the executor's pre-forward / pre-backward hook); it then issues
  the transfers the plan slots there, in the order of the stage that needs them.
- Device memory is allocated when a transfer is issued (its slot is reserved) or a compute starts (activations,
  working set, gradients) and released when the last reader ends: a weight slot after the compute that used it,
  an offloaded tensor after its D2H copy, a gradient after its D2H copy. At equal times, releases go first.
- Offloads (D2H) start when the forward that produced them ends; an NVMe write follows its D2H, an NVMe read is
  issued one stage before the reload that needs it.
- Note: [Bounded staging buffers] the executor drains gradients and offloaded activations through two buffers
  each: ``B_i`` starts only when the gradients of ``B_{i+2}`` (or of the head, for ``B_{L-2}``) have left the
  device, and ``F_i`` only when the offload of ``F_{i-2}`` has, so a slow copy lane throttles compute instead of
  piling tensors up on the device.
- The CPU optimizer updates layers in order (embedding, layers, lm_head) once the global gradient norm is known
  (end of backward) and each layer's gradients are on the host. The next step's fetch of layer ``i`` waits for the
  update of layer ``i``; with ``optimizer_overlap=False`` the next step starts only after the whole update.

Three steps are replayed; the step time is the period of the middle one (end of ``B_0`` to end of ``B_0``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .costmodel import CostModel
from .plan import Plan

LANES = ("compute", "h2d", "d2h", "nvme", "cpu")


@dataclass
class SimResult:
    """What the replay measured.

    Args:
        lanes: per lane, ``(start_s, end_s, label)`` of every task inside the measured step window.
        memory: ``(time_s, device_bytes)`` after every change inside the window.
        window: ``(start_s, end_s)`` of the measured step.
    """

    step_time_s: float
    tflops: float
    tokens_per_s: float
    peak_gpu_bytes: int
    peak_host_bytes: int
    lanes: dict[str, list[tuple[float, float, str]]] = field(default_factory=dict)
    memory: list[tuple[float, int]] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)

    def predictions(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "tflops": self.tflops,
            "tokens_per_s": self.tokens_per_s,
            "peak_gpu_bytes": self.peak_gpu_bytes,
            "peak_host_bytes": self.peak_host_bytes,
        }

    def busy_fraction(self, lane: str) -> float:
        t0, t1 = self.window
        busy = sum(min(e, t1) - max(s, t0) for s, e, _ in self.lanes.get(lane, []) if e > t0 and s < t1)
        return busy / max(t1 - t0, 1e-12)


class _Lanes:
    def __init__(self) -> None:
        self.free = {lane: 0.0 for lane in LANES}
        self.log: list[tuple[str, float, float, str]] = []

    def run(self, lane: str, ready: float, duration: float, label: str) -> tuple[float, float]:
        start = max(ready, self.free[lane])
        end = start + duration
        self.free[lane] = end
        if duration > 0:
            self.log.append((lane, start, end, label))
        return start, end


def simulate(plan: Plan, cost_model: CostModel, steps: int = 3) -> SimResult:
    """Replay ``plan`` on ``cost_model``'s hardware for ``steps`` steps (>= 2) and measure the steady state."""
    cm = cost_model
    L = cm.num_layers
    plan.validate(L)
    if steps < 2:
        raise ValueError(f"steps={steps} must be >= 2 (the step time is a period between two steps).")
    Bh, Bd, Bnr, Bnw = cm.h2d, cm.d2h, cm.nvme_r, cm.nvme_w
    lanes = _Lanes()
    mem_events: list[tuple[float, int]] = []
    host_events: list[tuple[float, int]] = []
    fixed = cm.fixed_device_bytes
    K = plan.checkpoint_every

    def alloc(t: float, nbytes: float) -> None:
        if nbytes:
            mem_events.append((t, int(nbytes)))

    def free(t: float, nbytes: float) -> None:
        if nbytes:
            mem_events.append((t, -int(nbytes)))

    # ---- what each stage issues (the executor's reading of the plan)
    sF = list(range(L))
    sB = [2 * L - i for i in range(L)]
    issue: dict[int, list[tuple[int, str, int]]] = {}
    prestep: list[int] = []
    reload_stage: dict[int, int] = {}
    for lp in plan.layers:
        i = lp.index
        off_tier = lp.tier
        if lp.fetch_fwd_ahead > i:
            prestep.append(i)
        else:
            issue.setdefault(i - lp.fetch_fwd_ahead, []).append((sF[i], "fetch_fwd", i))
        if not lp.resident:
            issue.setdefault(max(0, sB[i] - lp.fetch_bwd_ahead), []).append((sB[i], "fetch_bwd", i))
        if off_tier != "gpu" and K == 1:
            earliest = i + 2 if off_tier == "cpu" else i + 4  # after the D2H (and the NVMe write)
            s = min(sB[i], max(sB[i] - lp.reload_ahead, earliest))
            reload_stage[i] = s
            issue.setdefault(s, []).append((sB[i], "reload", i))
    if cm.head_bytes and L:
        issue.setdefault(L - 1, []).append((L, "head_upload", -1))
    for s in issue:
        issue[s].sort()

    def offloaded(i: int) -> float:
        lp = plan.layers[i]
        if K > 1:
            return 0
        if lp.policy in ("offload_cpu", "offload_nvme"):
            return cm.layers[i].saved_bytes
        if lp.policy == "recompute" and lp.input_tier != "gpu":
            return cm.layers[i].input_bytes
        return 0

    prev_opt: dict[Any, float] = {}  # the previous step's optimizer end per layer ("emb", "head", i)
    b0_end: list[float] = []
    step_begin = 0.0
    pre_done: dict[int, float] = {}  # pre-step fetch completion (issued in the previous tail)
    for i in prestep:  # the first step has no previous tail: issue at time 0
        _, e = lanes.run("h2d", 0.0, cm.layers[i].weight_bytes / Bh, f"fetch F{i}")
        pre_done[i] = e
        if not plan.layers[i].resident:
            alloc(0.0, cm.layers[i].weight_bytes)
    alloc(0.0, fixed)
    for lp in plan.layers:
        if lp.resident:
            alloc(0.0, cm.layers[lp.index].weight_bytes)

    for _ in range(steps):
        w_ready: dict[tuple[str, int], float] = {}  # ("F"/"B", i) -> weights on the device
        reload_ready: dict[int, float] = {}
        d2h_done: dict[int, float] = {}
        nvme_write_done: dict[int, float] = {}
        nvme_read_done: dict[int, float] = {}
        grad_on_host: dict[Any, float] = {}
        head_ready = 0.0
        for i in prestep:
            w_ready[("F", i)] = pre_done.get(i, 0.0)
        t = step_begin  # compute end of the previous stage
        stage_names = [f"F{i}" for i in range(L)] + ["H"] + [f"B{i}" for i in reversed(range(L))]
        for s in range(2 * L + 1):
            begin = t
            # NVMe reads one stage ahead of the reloads issued in the next stage
            for _need, what, i in issue.get(s + 1, []):
                if what == "reload" and plan.layers[i].tier == "nvme":
                    _, e = lanes.run("nvme", max(begin, nvme_write_done.get(i, 0.0)), offloaded(i) / Bnr, f"read {i}")
                    nvme_read_done[i] = e
            for _need, what, i in issue.get(s, []):
                if what in ("fetch_fwd", "fetch_bwd"):
                    lc = cm.layers[i]
                    dep = prev_opt.get(i, 0.0) if what == "fetch_fwd" else 0.0
                    _, e = lanes.run("h2d", max(begin, dep), lc.weight_bytes / Bh, f"fetch {what[6].upper()}{i}")
                    w_ready[("F" if what == "fetch_fwd" else "B", i)] = e
                    if not plan.layers[i].resident:
                        alloc(begin, lc.weight_bytes)
                elif what == "reload":
                    dep = nvme_read_done.get(i, 0.0) if plan.layers[i].tier == "nvme" else d2h_done.get(i, 0.0)
                    _, e = lanes.run("h2d", max(begin, dep), offloaded(i) / Bh, f"reload {i}")
                    reload_ready[i] = e
                    alloc(begin, offloaded(i))
                    if plan.layers[i].tier == "cpu":
                        host_events.append((e, -int(offloaded(i))))
                else:  # head upload after its update
                    _, e = lanes.run("h2d", max(begin, prev_opt.get("head", 0.0)), cm.head_bytes / Bh, "upload head")
                    head_ready = e
            name = stage_names[s]
            if name == "H":
                start, end = lanes.run("compute", max(begin, head_ready), cm.head_s, "head")
                alloc(start, cm.head_ws_bytes + cm.head_grad_bytes)
                free(end, cm.head_ws_bytes)
                _, e = lanes.run("d2h", end, cm.head_grad_bytes / Bd, "grad head")
                free(e, cm.head_grad_bytes)
                grad_on_host["head"] = e
                t = end
                continue
            i = int(name[1:])
            lc = cm.layers[i]
            lp = plan.layers[i]
            if name[0] == "F":
                # Note: [Bounded staging buffers]
                ready = max(w_ready.get(("F", i), 0.0), d2h_done.get(i - 2, 0.0))
                start, end = lanes.run("compute", max(begin, ready), lc.fwd_s, f"F{i}")
                alloc(start, lc.ws_fwd_bytes)
                free(end, lc.ws_fwd_bytes)
                if not lp.resident:
                    free(end, lc.weight_bytes)
                if K > 1:
                    if i % K == 0:
                        alloc(start, lc.input_bytes)
                elif lp.policy == "keep":
                    alloc(start, lc.saved_bytes)
                elif lp.policy == "recompute" and lp.input_tier == "gpu":
                    alloc(start, lc.input_bytes)
                else:
                    nbytes = offloaded(i)
                    alloc(start, nbytes)
                    d_start, d_end = lanes.run("d2h", end, nbytes / Bd, f"offload {i}")
                    free(d_end, nbytes)
                    d2h_done[i] = d_end
                    if lp.tier == "cpu":
                        host_events.append((d_start, int(nbytes)))
                    else:
                        _, w_end = lanes.run("nvme", d_end, nbytes / Bnw, f"write {i}")
                        nvme_write_done[i] = w_end
                t = end
                continue
            # ---- backward of layer i
            rec_start = begin
            if K > 1 and (i == L - 1 or (i + 1) % K == 0):
                # MegaTrain block recompute: fetch and re-run layers j..i (prefetch depth 1 among them)
                j = i - (i % K)
                block = list(range(j, i + 1))
                _, fe = lanes.run("h2d", begin, cm.layers[j].weight_bytes / Bh, f"refetch {j}")
                alloc(begin, cm.layers[j].weight_bytes)
                tc = begin
                for n, k in enumerate(block):
                    cs, ce = lanes.run("compute", max(tc, fe), cm.layers[k].fwd_s, f"R{k}")
                    if n + 1 < len(block):
                        nk = block[n + 1]
                        _, fe = lanes.run("h2d", cs, cm.layers[nk].weight_bytes / Bh, f"refetch {nk}")
                        alloc(cs, cm.layers[nk].weight_bytes)
                    alloc(cs, cm.layers[k].saved_bytes)
                    free(ce, cm.layers[k].weight_bytes)
                    tc = ce
                rec_start = tc
            needs = [w_ready.get(("B", i), 0.0) if not lp.resident else 0.0, reload_ready.get(i, 0.0)]
            needs.append(grad_on_host.get(i + 2 if i + 2 < L else "head", 0.0) if i <= L - 2 else 0.0)
            dur = lc.bwd_s + (lc.fwd_s if (K == 1 and lp.policy == "recompute") else 0.0)
            start, end = lanes.run("compute", max([rec_start, *needs]), dur, f"B{i}")
            alloc(start, lc.ws_bwd_bytes + lc.grad_bytes)
            free(end, lc.ws_bwd_bytes)
            if not lp.resident:
                free(end, lc.weight_bytes)
            # the layer's saved state is released at the end of its backward
            if K > 1:
                free(end, lc.saved_bytes + (lc.input_bytes if i % K == 0 else 0))
            elif lp.policy == "keep":
                free(end, lc.saved_bytes)
            elif lp.policy == "recompute":
                alloc(start, lc.saved_bytes)
                free(end, lc.saved_bytes + (lc.input_bytes if lp.input_tier == "gpu" else offloaded(i)))
            else:
                free(end, offloaded(i))
            _, e = lanes.run("d2h", end, lc.grad_bytes / Bd, f"grad {i}")
            free(e, lc.grad_bytes)
            grad_on_host[i] = e
            t = end
        # ---- tail: embedding backward result down, optimizer on the CPU, uploads for the next step
        b_end = t
        b0_end.append(b_end)
        alloc(b_end, cm.embed_grad_bytes)
        _, e = lanes.run("d2h", b_end, cm.embed_grad_bytes / Bd, "grad emb")
        free(e, cm.embed_grad_bytes)
        grad_on_host["emb"] = e
        opt_end: dict[Any, float] = {}
        order: list[Any] = ["emb", *range(L), "head"] if cm.head_params else ["emb", *range(L)]
        for key in order:
            params = cm.embed_params if key == "emb" else cm.head_params if key == "head" else cm.layers[key].params
            _, oe = lanes.run(
                "cpu",
                max(b_end, grad_on_host.get(key, b_end)),
                params / cm.hardware.cpu_optimizer_params_per_s,
                f"opt {key}",
            )
            opt_end[key] = oe
        _, emb_up = lanes.run("h2d", max(b_end, opt_end["emb"]), cm.embed_bytes / Bh, "upload emb")
        pre_done = {}
        for i in prestep:
            _, e = lanes.run("h2d", max(b_end, opt_end[i]), cm.layers[i].weight_bytes / Bh, f"fetch F{i}")
            pre_done[i] = e
            if not plan.layers[i].resident:
                alloc(b_end, cm.layers[i].weight_bytes)
        prev_opt = opt_end
        step_begin = max(b_end, emb_up) if plan.optimizer_overlap else max(emb_up, max(opt_end.values()))

    # ---- measurements on the middle step(s)
    t0, t1 = b0_end[-2], b0_end[-1]
    period = t1 - t0
    mem_events.sort(key=lambda ev: (ev[0], ev[1]))  # releases before allocations at equal times
    level = 0
    peak = 0
    samples: list[tuple[float, int]] = []
    for tm, delta in mem_events:
        level += delta
        peak = max(peak, level)
        if t0 <= tm <= t1:
            samples.append((tm, level))
    host_events.sort(key=lambda ev: (ev[0], ev[1]))
    h = 0
    host_peak = 0
    for _, delta in host_events:
        h += delta
        host_peak = max(host_peak, h)
    window_lanes: dict[str, list[tuple[float, float, str]]] = {lane: [] for lane in LANES}
    for lane, s, e, label in lanes.log:
        if e > t0 and s < t1:
            window_lanes[lane].append((s, e, label))
    return SimResult(
        step_time_s=period,
        tflops=cm.model_flops / period / 1e12,
        tokens_per_s=cm.tokens / period,
        peak_gpu_bytes=int(peak),
        peak_host_bytes=int(cm.host_state_bytes + host_peak),
        lanes=window_lanes,
        memory=samples,
        window=(t0, t1),
    )


def draw_timeline(result: SimResult, path: str, title: str = "") -> str:
    """Draw lanes over time and device memory over time for the measured step into a PNG at ``path``."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("draw_timeline needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0, t1 = result.window
    colors = {"compute": "tab:blue", "h2d": "tab:green", "d2h": "tab:orange", "nvme": "tab:purple", "cpu": "tab:red"}
    fig, (ax, axm) = plt.subplots(2, 1, figsize=(12, 5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for row, lane in enumerate(LANES):
        bars = [(max(s, t0) - t0, min(e, t1) - max(s, t0)) for s, e, _ in result.lanes.get(lane, [])]
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colors[lane], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(LANES)), LANES)
    ax.invert_yaxis()
    ax.set_title(
        title
        or f"step {result.step_time_s * 1e3:.1f} ms, {result.tflops:.1f} TFLOPS, {result.tokens_per_s:.0f} tokens/s"
    )
    if result.memory:
        ts = [t - t0 for t, _ in result.memory]
        ys = [b / 2**30 for _, b in result.memory]
        axm.step(ts, ys, where="post", color="black")
    axm.axhline(result.peak_gpu_bytes / 2**30, color="gray", linestyle="--", linewidth=0.8)
    axm.set_ylabel("device GiB")
    axm.set_xlabel("seconds into the step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
