"""Discrete-event replay of a plan: the executor's own transfer schedule on lanes, the referee of the stage model.

The transfers are `lazytrain_hf.planner.schedule.step_transfers` (the list the executor's trace is checked against,
byte for byte), not a reading of the MILP's constraints; this module only adds time. Five FIFO lanes (``compute``,
``h2d``, ``d2h``, ``nvme``, ``cpu`` optimizer) run tasks in program order; a task starts when its lane is free and
what it depends on has finished:

- a stage begins when the previous compute ends (the executor's pre-forward / backward-stage hook) and issues the
  transfers the schedule puts there, in order;
- a forward fetch of layer ``i`` waits for the previous step's update of layer ``i`` (Note: [Update before fetch]
  in training/updater.py), the first forward for the update of the parameters that are not streamed;
- a layer's compute waits for its weights (the fetch issued for that stage, or the one it kept bound), its
  reloads and, for a block's top layer, the block's recomputation fetches (and forwards, `memmodel.
  block_recompute_terms`: with ``block_graphs="layer"`` the lower layers' ``no_grad`` pass, each layer's own
  forward again at its backward); offloads (D2H, then the NVMe write) start
  when the forward that produced them ends, gradients when the backward ends; a reload waits for its offload
  (and NVMe read); ``F_i`` waits for the offload of ``F_{i-2}`` and ``B_i`` for the gradients of ``B_{i+2}``
  (Note: [Two stages of copies in flight] in streaming/engine.py);
- the CPU optimizer starts once backward ended and every gradient is on the host (the global norm), updates the
  parameters that are not streamed first, then the units in order, each followed by its upload (resident slots);
  with ``optimizer_overlap`` the next step starts at once, else after the last update and upload.
- a data-parallel world (``plan.world_size`` > 1, `lazytrain_hf.planner.worldcost`): one rank is replayed with
  its own transfers (`step_transfers` of that rank); its ``reduce`` of a unit follows the unit's D2H gradient on the
  ``net`` lane; the optimizer starts once every unit's gradients have reached its owner (`NetTimes.reduce_arrival`)
  and updates the rank's own units at its share of the node's rate; a unit another rank owns is ready when its owner
  has updated it (`NetTimes.finish_times`), after the ``gather`` of its compute copy when the owner is on another
  node (on this rank's ``net`` lane when this rank receives it). The step of the world is its slowest rank's.
  With ``plan.dp_reduce == "device"`` a unit's gradient is instead reduced on the devices on the ``net`` lane as
  soon as its backward ends (`NetTimes.device_reduce_s`, on every rank), the owner's D2H copy follows it, the other
  ranks copy nothing, and the next backward waits for it (the reduce is ordered on the compute stream,
  Note: [Gradients reduced on the device skip the other ranks' D2H] in streaming/gradients.py). With gradient
  accumulation (``micro_batches`` > 1) the optimizer runs after every ``micro_batches``-th backward; a ``reduce`` is
  sent every micro-batch, or with ``plan.dp_reduce_every == "step"`` after the last one only (Note: [Gradients
  reduced once per step] in streaming/gradients.py).
- On a profile with ``serial_lanes`` (the CPU device: copies are memcpy on the cores that compute) every transfer
  and the optimizer run on the compute lane, and the next step starts after the optimizer step.

Device memory is allocated when a transfer is issued or a compute starts and released when the last reader ends.
Three optimizer steps are replayed; the step time is the period of the last one (end of its last micro-batch's
``B_0`` to the next).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .costmodel import CostModel
from .memmodel import copies_inline, held_grad_bytes, resident_norm_bytes, slot_pools, streamed_head_terms
from .plan import Plan
from .schedule import sizes_from_cost_model, step_transfers, unit_owners_of
from .world import optimizer_rate_per_rank
from .worldcost import NetTimes

LANES = ("compute", "h2d", "d2h", "nvme", "cpu", "net")
_LANE_OF = {"h2d": "h2d", "d2h": "d2h", "nvme_read": "nvme", "nvme_write": "nvme", "net": "net"}


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
    """Lanes that run each task in the first gap at or after the time it is ready.

    Tasks are added in the replay's program order, which is not the order they are issued in: the optimizer's
    uploads of a step are replayed before the next step's fetches although most of them are issued later. A copy
    lane runs copies in the order they are issued (a CUDA stream is FIFO), and a task is issued when it is ready, so
    placing each task in the earliest free gap from its ready time is that order."""

    def __init__(self) -> None:
        self.busy: dict[str, list[tuple[float, float]]] = {lane: [] for lane in LANES}
        self.log: list[tuple[str, float, float, str]] = []

    def run(self, lane: str, ready: float, duration: float, label: str) -> tuple[float, float]:
        import bisect

        iv = self.busy[lane]
        start = ready
        k = bisect.bisect_left(iv, (ready, ready))
        if k > 0 and iv[k - 1][1] > start:
            start = iv[k - 1][1]
        while k < len(iv) and iv[k][0] < start + duration:
            start = max(start, iv[k][1])
            k += 1
        end = start + duration
        if duration > 0:
            iv.insert(k, (start, end))
            self.log.append((lane, start, end, label))
        return start, end


def _label(what: str, layer: int | None, L: int) -> str:
    name = {None: "resident", -1: "emb", L: "head"}.get(layer, str(layer))
    return {
        "fetch_fwd": f"fetch F{name}",
        "fetch_bwd": f"fetch B{name}",
        "fetch_rec": f"refetch {name}",
        "offload": f"offload {name}",
        "spill": f"write {name}",
        "unspill": f"read {name}",
        "reload": f"reload {name}",
        "grad": f"grad {name}",
        "upload": f"upload {name}",
        "state": f"state {name}",
        "reduce": f"reduce {name}",
        "reduce_device": f"reduce dev {name}",
        "gather": f"gather {name}",
    }[what]


def simulate(
    plan: Plan, cost_model: CostModel, steps: int = 3, rank: int | None = None, micro_batches: int = 1
) -> SimResult:
    """Replay ``plan`` on ``cost_model``'s hardware for ``steps`` optimizer steps (>= 2) of ``micro_batches``
    micro-batches each (gradient accumulation) and measure the steady state, on rank ``rank`` of the plan's world
    (None: every rank, the slowest one's result)."""
    world = plan.world
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be >= 1 (gradient accumulation steps).")
    if rank is None:
        if world.world_size == 1:
            return simulate(plan, cost_model, steps, 0, micro_batches)
        return max(
            (simulate(plan, cost_model, steps, r, micro_batches) for r in range(world.world_size)),
            key=lambda x: x.step_time_s,
        )
    if not 0 <= rank < world.world_size:
        raise ValueError(f"rank={rank} is not a rank of the plan's world (0..{world.world_size - 1}).")
    cm = cost_model
    L = cm.num_layers
    plan.validate(L)
    if set(plan.state_nvme) & set(range(L)) != set(cm.state_nvme):
        cm = cm.with_state_nvme(plan.state_nvme)
    if steps < 2:
        raise ValueError(f"steps={steps} must be >= 2 (the step time is a period between two steps).")
    serial = bool(getattr(cm, "serial_lanes", False))
    inline = copies_inline(cm)
    bw = {"h2d": cm.h2d, "d2h": cm.d2h, "nvme_read": cm.nvme_r, "nvme_write": cm.nvme_w}
    sizes = sizes_from_cost_model(cm, plan.stream_embeddings)
    transfers = step_transfers(plan, sizes, world=world, rank=rank)
    # ---- the data-parallel world (worldcost.py): reduces leave after their unit's D2H gradient, owners update
    multi = world.world_size > 1
    owners = unit_owners_of(plan, sizes, world) if multi else {}
    units = {i: u for i, u in enumerate(sizes.layers)}
    if plan.stream_embeddings:
        units.update({-1: sizes.embed, L: sizes.head})
    net = NetTimes(
        cm,
        world,
        rank,
        owners,
        {k: u.train_elems for k, u in units.items()},
        {k: u.weight for k, u in units.items()},
        plan.stream_embeddings,
    )
    reduces = {t.layer: t for t in transfers if t.what == "reduce"}
    reduces_dev = {t.layer: t for t in transfers if t.what == "reduce_device"}
    on_device = multi and plan.dp_reduce == "device"
    once = multi and plan.dp_reduce_every == "step"  # Note: [Gradients reduced once per step]
    gathers = {t.layer: t for t in transfers if t.what == "gather"}
    transfers = [t for t in transfers if t.lane != "net"]
    issued: dict[int, list] = {}
    after_compute: dict[tuple[int, str], list] = {}  # transfers that start when a compute ends
    per_step = [t for t in transfers if t.per_step]
    for t in transfers:
        if t.per_step:
            continue
        if t.what in ("offload", "spill"):
            after_compute.setdefault((t.layer, "F"), []).append(t)
        elif t.what == "grad":
            key = ("H" if t.layer == L else "emb") if t.layer in (-1, L) else "B"
            after_compute.setdefault((t.layer, key), []).append(t)
        else:
            issued.setdefault(t.stage, []).append(t)
    K = plan.checkpoint_every
    lanes = _Lanes()
    mem: list[tuple[float, int]] = []
    host: list[tuple[float, int]] = []

    def alloc(tm: float, n: float) -> None:
        if n:
            mem.append((tm, int(n)))

    def free(tm: float, n: float) -> None:
        if n:
            mem.append((tm, -int(n)))

    def move(t, ready: float) -> tuple[float, float]:
        lane = "compute" if serial else _LANE_OF[t.lane]
        if t.what == "reduce_device":
            return lanes.run(lane, ready, net.device_reduce_s(t.nbytes), _label(t.what, t.layer, L))
        rate = net.bandwidth(t.peer) if t.lane == "net" else bw[t.lane]
        return lanes.run(lane, ready, t.nbytes / rate, _label(t.what, t.layer, L))

    arrived: dict[int, float] = {}  # per unit: its gradients from every rank are at its owner

    def reduce_after(key: int, ready: float) -> None:
        """Send this rank's gradient of unit ``key`` to its owner once it is on the host (``ready``); once per step
        after the last micro-batch with ``dp_reduce_every == "step"``."""
        if not multi or on_device or owners.get(key, -1) < 0 or (once and not last_mb):
            return
        if key in reduces:
            start, _ = move(reduces[key], ready)
        else:  # this rank owns it: its peers send it when their earlier reduces are out, as this rank would
            start = max([ready] + [e for _, e in lanes.busy["net"]])
        arrived[key] = net.reduce_arrival(key, start)

    def reduce_on_device(key: int, ready: float) -> float:
        """``plan.dp_reduce == "device"``: the reduce of unit ``key``'s gradient on the devices, from ``ready`` (its
        backward's end); returns when the owner's device gradient is complete (``ready`` when nothing is reduced)."""
        if not on_device or owners.get(key, -1) < 0:
            return ready
        if key in reduces_dev:
            _, e = move(reduces_dev[key], ready)
        else:  # this rank owns it: the same reduce, received
            n = units[key].grad
            _, e = lanes.run(
                "compute" if serial else "net", ready, net.device_reduce_s(n), _label("reduce_device", key, L)
            )
        arrived[key] = e + units[key].grad / bw["d2h"]  # on the owner's host after its D2H copy (ranks symmetric)
        return e

    def held(i: int) -> int:
        """Device bytes layer i leaves after its forward until its backward (or its offload)."""
        lp, lc = plan.layers[i], cm.layers[i]
        if K > 1:
            return lc.input_bytes if i % K == 0 else 0
        if inline and lp.tier != "gpu":
            return lc.input_bytes  # memmodel: the synchronous CPU engine copies each saved tensor out as it is saved
        return lc.saved_bytes if lp.policy != "recompute" else lc.input_bytes

    # the memory terms of `memmodel`: slot pools held the whole run (a layer's fetch uses a slot of its kind's pool)
    pools = slot_pools(plan, [lc.weight_bytes for lc in cm.layers], [lc.kind for lc in cm.layers])
    # streamed embedding and head (memmodel.streamed_head_terms): transient slots, gradients leave as a layer's
    ht = streamed_head_terms(cm) if plan.stream_embeddings else None
    tied = not cm.head_params
    alloc(0.0, (0 if ht else cm.fixed_device_bytes) + sum(pools.values()))
    head_held, embed_held = (0, 0) if ht else held_grad_bytes(cm)
    norm_copy = 0 if ht else resident_norm_bytes(cm)

    def slotted(tr) -> bool:  # a layer's weights, into a slot of its pool (a streamed unit's: charged below)
        return tr.what.startswith("fetch") and tr.layer is not None and (0 <= tr.layer < L or ht is not None)

    def ws_fwd(i: int) -> int:  # a forward that saves its tensors, or one that keeps only its input
        lp, lc = plan.layers[i], cm.layers[i]
        saves = K == 1 and (lp.policy == "keep" or (lp.policy.startswith("offload") and not inline))
        return lc.ws_fwd_bytes if saves else lc.ws_nosave_bytes

    for lp in plan.layers:
        if lp.resident:
            alloc(0.0, cm.layers[lp.index].weight_bytes)
    prev_opt: dict[Any, float] = {}
    b0_end: list[float] = []
    step_begin = 0.0
    last_mb = True
    for mb in range(steps * micro_batches):
        last_mb = mb % micro_batches == micro_batches - 1  # the optimizer step follows this micro-batch
        first_mb = mb % micro_batches == 0  # resident gradients are allocated here, accumulated into after
        land: dict[tuple[str, int | None], float] = {}
        done: dict[tuple[str, int | None], float] = {}
        t = step_begin
        grads_down = hold = t
        for s in range(2 * L + 1):
            begin = t
            for tr in issued.get(s, []):
                dep = begin
                if tr.what == "fetch_fwd":
                    dep = max(dep, prev_opt.get(tr.layer, 0.0))
                elif tr.what == "unspill":
                    dep = max(dep, done.get(("spill", tr.layer), 0.0))
                elif tr.what == "reload":
                    src = "unspill" if plan.layers[tr.layer].tier == "nvme" else "offload"
                    dep = max(dep, land.get((src, tr.layer), done.get(("offload", tr.layer), 0.0)))
                _, e = move(tr, dep)
                land[(tr.what, tr.layer)] = e
                if tr.lane == "h2d" and not slotted(tr):
                    alloc(begin, tr.nbytes)
                if tr.what == "reload" and plan.layers[tr.layer].tier == "cpu":
                    host.append((e, -tr.nbytes))
            if s < L:  # ---- forward of layer s
                i, lc, lp = s, cm.layers[s], plan.layers[s]
                # Note: [Two stages of copies in flight] (streaming/engine.py): F_i waits for the offload of F_{i-2}
                need = [land.get(("fetch_fwd", i), 0.0), done.get(("offload", i - 2), 0.0)]
                if i == 0:
                    need += [prev_opt.get("resident", 0.0), land.get(("fetch_fwd", -1), 0.0)]
                if lp.resident:
                    need.append(prev_opt.get(("upload", i), 0.0))
                start, end = lanes.run("compute", max(begin, *need), lc.fwd_s, f"F{i}")
                if ht and i == 0:  # the embedding's slot and output until the lookup ran
                    alloc(begin, ht["embed_fwd"])
                    free(start, ht["embed_fwd"])
                alloc(start, ws_fwd(i) + held(i))
                free(end, ws_fwd(i))
                d_end = end
                for tr in after_compute.get((i, "F"), []):
                    if tr.what == "offload":
                        _, d_end = move(tr, end)
                        done[("offload", i)] = d_end
                        free(d_end, held(i))
                        if lp.tier == "cpu":
                            host.append((d_end, tr.nbytes))
                    else:
                        _, we = move(tr, d_end)
                        done[("spill", i)] = we
                t = end
                continue
            if s == L:  # ---- head: final norm, lm_head, chunked loss forward and backward
                start, end = lanes.run("compute", max(begin, land.get(("fetch_fwd", L), 0.0)), cm.head_s, "head")
                ws_h = max(cm.head_ws_bytes, ht["head_done"]) + ht["head_slots"] if ht else cm.head_ws_bytes
                alloc(begin if ht else start, ws_h)
                alloc(start, ht["head_grad"] if ht else head_held)
                free(end, ws_h)
                if not (ht or first_mb):  # accumulation: the new lm_head gradient, added into the held one
                    free(end, head_held)
                reduced = hold = reduce_on_device(L, end)
                ge = reduced
                for tr in after_compute.get((L, "H"), []):
                    _, ge = move(tr, reduced)
                    done[("grad", L)] = ge
                    grads_down = max(grads_down, ge)
                    reduce_after(L, ge)
                if ht and not tied:
                    free(ge, ht["head_grad"])
                t = end
                continue
            i = 2 * L - s  # ---- backward of layer i (recomputation included)
            lc, lp = cm.layers[i], plan.layers[i]
            # ... and B_i for the gradients of B_{i+2} (the head's for B_{L-2})
            need = [land.get(("fetch_bwd", i), 0.0), land.get(("reload", i), 0.0), done.get(("grad", i + 2), 0.0)]
            need.append(hold)  # the previous unit's reduce on the devices (dp_reduce "device")
            dur = lc.bwd_s
            per_layer = K == 1 or plan.layer_graphs  # this layer alone is recomputed with grad at B_i
            if per_layer and lp.policy == "recompute":
                dur += lc.fwd_s
            extra = 0
            if K > 1 and plan.block_top(i) == i:  # memmodel.block_recompute_terms
                block = [k for k in range(L) if plan.block_top(k) == i]
                ran = block[:-1] if plan.layer_graphs else block
                dur += sum(cm.layers[k].fwd_s for k in ran)
                need += [land.get(("fetch_rec", k), 0.0) for k in block]
                if plan.layer_graphs:  # the kept inputs of the block's layers above its first
                    extra = sum(cm.layers[k].input_bytes for k in block[1:])
                else:  # each freed by its layer's backward
                    extra = sum(cm.layers[k].saved_bytes for k in block)
            recomputes = lp.policy == "recompute"
            ws_b = lc.ws_bwd_bytes + (max(0, lc.ws_fwd_bytes - lc.grad_bytes) if recomputes or K > 1 else 0)
            start, end = lanes.run("compute", max(begin, *need), dur, f"B{i}")
            alloc(start, ws_b + lc.grad_bytes + extra + (lc.saved_bytes if recomputes and per_layer else 0))
            free(end, ws_b + (lc.saved_bytes if recomputes else 0))
            if K == 1 and lp.tier == "gpu":
                free(end, held(i))
            elif K == 1:
                free(end, _reloaded(cm, lp, i))
            elif i % K == 0 or plan.layer_graphs:
                free(end, lc.input_bytes)
            g_end = hold = reduce_on_device(i, end)
            for tr in after_compute.get((i, "B"), []):
                _, g_end = move(tr, hold)
                done[("grad", i)] = g_end
                reduce_after(i, g_end)
            free(g_end, lc.grad_bytes)
            grads_down = max(grads_down, g_end)
            t = end
        reduced = reduce_on_device(-1, t)
        grads_down = max(grads_down, reduced)
        alloc(t, embed_held)  # the embedding's gradient, held until the optimizer step (memmodel.held_grad_bytes)
        after_t = math.nextafter(t, math.inf)
        if not first_mb:  # accumulation: the new one, added into the held one (memmodel.carried_grad_bytes)
            free(after_t, embed_held)
        if ht:  # the embedding completes: its gradient (with the tied lm_head's part) and the norm's fp32 copy
            alloc(t, ht["embed_done"] - (ht["head_grad"] if tied else 0))
        ge = reduced
        for tr in after_compute.get((-1, "emb"), []):
            _, ge = move(tr, reduced)
            grads_down = max(grads_down, ge)
            reduce_after(-1, ge)
        if ht:
            free(ge, ht["embed_done"])
        # ---- optimizer step: once every gradient is on the host (the global norm), in the updater's order
        b_end = t
        if not last_mb:  # gradient accumulation: the next micro-batch starts at once
            step_begin = b_end
            continue
        # the global norm's fp32 copy of a piece of a resident gradient (memmodel.resident_norm_bytes), beside them all
        alloc(after_t, norm_copy)
        free(math.nextafter(after_t, math.inf), norm_copy + head_held + embed_held)  # the held gradients, to the step
        b0_end.append(b_end)
        opt: dict[Any, float] = {}
        res_grad = [tr for tr in per_step if tr.what == "grad"]
        for tr in res_grad:
            _, ge = move(tr, b_end)
            grads_down = max(grads_down, ge)
        tc = max(b_end, grads_down, *arrived.values())  # the global norm needs every unit's reduced gradient
        rate = optimizer_rate_per_rank(cm.hardware.cpu_optimizer_params_per_s, world)
        opt_lane = "compute" if serial else "cpu"  # serial lanes: the optimizer runs on the cores that compute
        res_params = 0 if plan.stream_embeddings else cm.embed_params + cm.head_params
        _, tc = lanes.run(opt_lane, tc, res_params / rate, "opt resident")
        opt["resident"] = tc
        for tr in per_step:
            if tr.what == "upload" and tr.layer is None:
                _, ue = move(tr, tc)
                opt["resident"] = ue
        order = ([-1] if plan.stream_embeddings else []) + list(range(L)) + ([L] if plan.stream_embeddings else [])
        last = tc
        finish = net.finish_times(tc) if multi else {}
        for key in order:
            n = cm.embed_params if key == -1 else cm.head_params if key == L else cm.layers[key].params
            if multi and owners.get(key, -1) not in (-1, rank):  # another rank updates it (worldcost.py)
                ready = finish[key]
                if key in gathers:
                    _, ready = move(gathers[key], ready)
                elif world.node_of(owners[key]) != world.node_of(rank):
                    ready += net.gather_s(key)  # another rank of this node receives it
                opt[key] = ready
                last = max(last, ready)
                for tr in per_step:
                    if tr.what == "upload" and tr.layer == key:
                        _, ue = move(tr, ready)
                        opt[("upload", key)] = ue
                        last = max(last, ue)
                continue
            start = tc
            _, tc = lanes.run(opt_lane, tc, n / rate, f"opt {key}")
            for tr in per_step:
                if tr.what == "state" and tr.layer == key:
                    _, se = move(tr, start)  # the state on NVMe streams in and out while the chunks are updated
                    tc = max(tc, se)
            opt[key] = tc
            last = tc
            for tr in per_step:
                if tr.what == "upload" and tr.layer == key:
                    _, ue = move(tr, tc)
                    opt[("upload", key)] = ue
                    last = max(last, ue)
        prev_opt = opt
        arrived.clear()
        step_begin = b_end if plan.optimizer_overlap and not serial else max(last, opt["resident"])

    # ---- measurements on the last step
    t0, t1 = b0_end[-2], b0_end[-1]
    period = t1 - t0
    mem.sort(key=lambda ev: (ev[0], ev[1]))  # releases before allocations at equal times
    level = peak = 0
    samples: list[tuple[float, int]] = []
    for tm, delta in mem:
        level += delta
        peak = max(peak, level)
        if t0 <= tm <= t1:
            samples.append((tm, level))
    host.sort(key=lambda ev: (ev[0], ev[1]))
    h = host_peak = 0
    for _, delta in host:
        h += delta
        host_peak = max(host_peak, h)
    window_lanes: dict[str, list[tuple[float, float, str]]] = {lane: [] for lane in LANES}
    for lane, s, e, label in lanes.log:
        if e > t0 and s < t1:
            window_lanes[lane].append((s, e, label))
    return SimResult(
        step_time_s=period,
        tflops=cm.model_flops * micro_batches / period / 1e12,
        tokens_per_s=cm.tokens * micro_batches / period,
        peak_gpu_bytes=int(peak),
        peak_host_bytes=int(cm.host_state_bytes + host_peak),
        lanes=window_lanes,
        memory=samples,
        window=(t0, t1),
    )


def _reloaded(cm: CostModel, lp, i: int) -> int:
    lc = cm.layers[i]
    return lc.saved_bytes if lp.policy.startswith("offload") else lc.input_bytes


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
    colors["net"] = "tab:brown"
    shown = [lane for lane in LANES if lane != "net" or result.lanes.get("net")]  # net: a data-parallel world
    fig, (ax, axm) = plt.subplots(2, 1, figsize=(12, 5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for row, lane in enumerate(shown):
        bars = [(max(s, t0) - t0, min(e, t1) - max(s, t0)) for s, e, _ in result.lanes.get(lane, [])]
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colors[lane], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(shown)), shown)
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
