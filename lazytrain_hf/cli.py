"""``lazytrain`` console script: ``plan`` and ``simulate`` (no GPU, no Trainer import); ``bench`` plugs in below.

lazytrain plan --model qwen2.5-7b --hardware h800 --seq-len 1024
lazytrain plan --model qwen3-8b --hardware rtx3090 --seq-len 1024 --auto-batch-size --timeline out.png --json
lazytrain plan --model path/to/config.json --hardware my_profile.json --seq-len 2048 --gpu-budget 70GiB
lazytrain plan --model qwen2.5-7b --hardware h800 --seq-len 1024 --world-size 16 --nodes 2
lazytrain simulate --plan plan.json --model qwen2.5-7b --hardware h800 --timeline out.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .units import format_bytes, parse_bytes

_AFTER_SEARCH_S = 10.0  # what `plan` does after an --auto-batch-size search (baselines' batch searches, replay)

if TYPE_CHECKING:
    from .planner.hardware import HardwareProfile


def _budget(option: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            return parse_bytes(text, option)  # type: ignore[return-value]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    return parse


def _output_path(flag: str, example: str) -> Callable[[str], str]:
    """A file the command will write, checked when the arguments are parsed, so a bad path fails before the solve."""

    def check(text: str) -> str:
        path = os.path.abspath(os.path.expanduser(text))
        parent = os.path.dirname(path)
        if os.path.isdir(path):
            problem, fix = "is a directory", f"name a file in it, e.g. {flag} {os.path.join(text, example)}"
        elif not os.path.isdir(parent):
            problem, fix = (
                f"its directory {parent} does not exist",
                f"create it (mkdir -p {parent}) or pick another path",
            )
        elif not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            problem, fix = "is not writable by this process", "pick a path you can write to"
        else:
            return text
        raise argparse.ArgumentTypeError(f"{flag}={text!r}: {problem}; {fix}.")

    return check


def _tiers(text: str) -> tuple[str, ...]:
    from .planner.plan import INPUT_TIERS

    tiers = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in tiers if t not in INPUT_TIERS]
    if bad or not tiers:
        raise argparse.ArgumentTypeError(f"--tiers={text!r}: use a comma list of {', '.join(INPUT_TIERS)}.")
    return tiers


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="zoo name (e.g. qwen2.5-7b) or path to an HF config.json / dir")
    p.add_argument(
        "--hardware", required=True, help="bundled profile (h800, h100, h200, a100-80g, rtx3090, rtx4090, cpu) or JSON"
    )
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--gpu-budget", type=_budget("--gpu-budget"), default=None, help="e.g. 70GiB (default: 90%% of it)")
    p.add_argument(
        "--host-budget", type=_budget("--host-budget"), default=None, help="pinned host bytes for activations"
    )
    p.add_argument("--nvme-budget", type=_budget("--nvme-budget"), default=0, help="NVMe bytes for activations")
    p.add_argument(
        "--tiers", type=_tiers, default=("gpu", "cpu"), help="where activations may live, e.g. gpu,cpu,nvme"
    )
    p.add_argument(
        "--timeline",
        type=_output_path("--timeline", "timeline.png"),
        default=None,
        help="write the simulated timeline PNG here",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lazytrain", description="LazyTrain planner and tools.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="solve the MILP plan for a model on a hardware profile and compare baselines")
    _add_model_args(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--batch-size", type=int, default=None, help="micro-batch size (default 1)")
    g.add_argument("--auto-batch-size", action="store_true", help="search the micro-batch size with the best tokens/s")
    p.add_argument("--max-batch-size", type=int, default=256, help="upper end of batch searches")
    p.add_argument("--time-limit", type=float, default=30.0, help="MILP solver seconds (one solve)")
    p.add_argument(
        "--search-time-limit",
        type=float,
        default=60.0,
        help="wall-clock seconds of a `plan --auto-batch-size` run (the batch search's solves share them)",
    )
    p.add_argument("--gap", type=float, default=0.01, help="relative MIP gap")
    p.add_argument("--solver", default="auto", choices=("auto", "cbc", "highs"))
    p.add_argument("--save", type=_output_path("--save", "plan.json"), default=None, help="write the plan JSON here")
    p.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="data-parallel ranks in all, sharing one copy of the training state (default 1); --host-budget is "
        "then each node's, for all its ranks",
    )
    p.add_argument("--nodes", type=int, default=1, help="machines the --world-size ranks run on (default 1)")
    p.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=1,
        help="micro-batches per optimizer step (default 1); with --world-size the plan decides whether gradients "
        "are reduced every micro-batch or once per step",
    )
    p.add_argument(
        "--stream-embeddings",
        choices=("off", "on", "auto"),
        default="off",
        help="the embedding and head resident on the device (off, the default), streamed like a layer (on), or "
        "planned both ways, keeping the faster plan (auto; each way gets half of --search-time-limit)",
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("simulate", help="replay a saved plan JSON on a hardware profile")
    _add_model_args(p)
    p.add_argument("--plan", required=True, help="plan JSON written by `lazytrain plan --save`")
    p.set_defaults(func=cmd_simulate)

    # `bench` (executor benchmarks) registers here: sub.add_parser("bench", ...) with set_defaults(func=cmd_bench).
    return parser


def _predicted_keys(d: dict[str, Any]) -> dict[str, Any]:
    from .planner.plan import PREDICTION_KEYS

    return {k: d.get(k) for k in PREDICTION_KEYS}


def _validate_common(args: argparse.Namespace) -> None:
    if args.seq_len < 1:
        raise ValueError(f"--seq-len={args.seq_len} must be >= 1 (e.g. 1024).")
    if getattr(args, "batch_size", None) is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size={args.batch_size} must be >= 1.")


def _profile(args: argparse.Namespace) -> HardwareProfile:
    """The ``--hardware`` profile (its numbers checked: positive and finite, so a NaN never reaches the solver) and
    ``--gpu-budget`` checked against its device memory."""
    from .planner.hardware import get_profile

    try:
        hw = get_profile(args.hardware)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--hardware={args.hardware!r}: {e}") from e
    if args.gpu_budget is not None and args.gpu_budget > hw.device_memory_bytes:
        mem = format_bytes(hw.device_memory_bytes)
        raise ValueError(
            f"--gpu-budget={format_bytes(args.gpu_budget)} is more than the device memory of {hw.name} ({mem}); pass "
            f"at most --gpu-budget {mem} (or leave it out: 90% of it), or the --hardware profile of your device."
        )
    return hw


def cmd_plan(args: argparse.Namespace) -> int:
    from .planner import baselines as bl
    from .planner import milp
    from .planner.costmodel import CostModel
    from .planner.memmodel import with_accumulation, with_streamed_embeddings
    from .planner.simulate import draw_timeline, simulate

    t_cmd = time.perf_counter()
    _validate_common(args)
    if args.search_time_limit <= 0:
        raise ValueError(f"--search-time-limit={args.search_time_limit} must be > 0 seconds (e.g. 60).")
    world = _world(args)
    if args.gradient_accumulation_steps < 1:
        raise ValueError(
            f"--gradient-accumulation-steps={args.gradient_accumulation_steps} must be >= 1 (1: no accumulation)."
        )
    hw = _profile(args)
    gpu = args.gpu_budget or hw.default_gpu_budget()
    host = hw.default_host_budget() if args.host_budget is None else args.host_budget
    host //= world.local_world_size  # each rank's share of the node's pinned activation budget
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = milp.plan_for_model(
            args.model,
            hw,
            args.seq_len,
            micro_batch_size=args.batch_size,
            auto_batch_size=args.auto_batch_size,
            gpu_budget=gpu,
            host_budget=host,
            nvme_budget=args.nvme_budget,
            allowed_tiers=args.tiers,
            max_batch_size=args.max_batch_size,
            time_limit=args.time_limit,
            gap=args.gap,
            solver=args.solver,
            # the whole command within --search-time-limit: less what loading the config took, less the baseline
            # comparisons after the search
            search_time_limit=max(1.0, args.search_time_limit - (time.perf_counter() - t_cmd) - _AFTER_SEARCH_S)
            / (2 if args.stream_embeddings == "auto" else 1),
            world=world if world.world_size > 1 else None,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            stream_embeddings={"off": False, "on": True, "auto": None}[args.stream_embeddings],
        )
    cfg, _ = milp._resolve_config(args.model)
    cm = CostModel.from_config(cfg, hw, args.seq_len, plan.micro_batch_size, model_name=plan.model)
    cm = with_accumulation(cm, args.gradient_accumulation_steps)
    baselines: dict[str, Any] = {}
    for name in bl.BASELINES:
        bp = bl.make_baseline(name, cm)
        baselines[name] = _predicted_keys(bp.predicted) if bl.fits(bp, cm, gpu, host, args.nvme_budget) else None
    max_bs: dict[str, int] = {}
    if "max_batch_size" in plan.predicted:
        max_bs["milp"] = int(plan.predicted["max_batch_size"])
    else:
        max_bs["milp"] = milp.max_feasible_batch(
            lambda b: milp.milp_feasible(
                with_streamed_embeddings(cm.with_batch(b), plan.stream_embeddings),
                gpu,
                host,
                args.nvme_budget,
                args.tiers,
            ),
            args.max_batch_size,
        )
    for name in bl.BASELINES:
        max_bs[name] = bl.max_batch_size(name, cm, gpu, host, args.max_batch_size)
    sim = simulate(plan, cm)
    if args.timeline:
        draw_timeline(
            sim, args.timeline, title=f"{plan.model} on {hw.name}, B={plan.micro_batch_size} T={args.seq_len}"
        )
    if args.save:
        plan.to_json(args.save)
    # the fallback / kept / presolve keys say why the plan is not the solver's own, or how presolve went
    keys = ("status", "seconds", "gap", "presolve", "stopped", "fallback", "kept")
    solver = {k: plan.solver.get(k) for k in keys if k in plan.solver or k in ("status", "seconds", "gap")}
    world_out = None
    if world.world_size > 1:
        world_out = _world_summary(plan, cm, simulate(plan, cm, micro_batches=args.gradient_accumulation_steps))
        world_out["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    if args.json:
        out = {
            "plan": plan.to_dict(),
            "predicted": _predicted_keys(plan.predicted),
            "baselines": baselines,
            "max_batch_size": max_bs,
            "solver": solver,
        }
        if world_out is not None:
            out["world"] = world_out
        print(json.dumps(out, indent=2))
    else:
        print(plan.table())
        print(
            f"\nsimulated: step {sim.step_time_s:.4f} s, {sim.tflops:.1f} TFLOPS, {sim.tokens_per_s:.0f} tokens/s, "
            f"peak device {format_bytes(sim.peak_gpu_bytes)}"
        )
        mt = baselines.get("megatrain")
        print(f"\n{'plan':<20} {'step s':>9} {'TFLOPS':>8} {'vs megatrain':>12} {'peak GPU':>10} {'max batch':>9}")
        rows = [("milp", _predicted_keys(plan.predicted)), *baselines.items()]
        for name, p in rows:
            if p is None:
                print(f"{name:<20} {'does not fit':>9} {'':>8} {'':>12} {'':>10} {max_bs.get(name, 0):>9}")
                continue
            ratio = f"{p['tflops'] / mt['tflops']:.2f}x" if mt else "-"
            print(
                f"{name:<20} {p['step_time_s']:>9.4f} {p['tflops']:>8.1f} {ratio:>12} "
                f"{format_bytes(p['peak_gpu_bytes']):>10} {max_bs.get(name, 0):>9}"
            )
        if world_out is not None:
            print("\n" + _world_text(world_out))
        if args.timeline:
            print(f"timeline: {args.timeline}")
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    return 0


def _world(args: argparse.Namespace):
    """The ``--world-size`` / ``--nodes`` world (`World` names the flag and the fix in its errors)."""
    from .planner.world import World

    return World(args.world_size, args.nodes)


def _world_summary(plan, cm, sim) -> dict[str, Any]:
    """Per node and per rank host RAM (`hostmem.counts_world_footprint`: the node's shared compute copy once, each
    rank's state, staging and pinned activations) and the predicted step of ``plan``'s world (the simulator's slowest
    rank) with rank 0's bytes per lane."""
    from .planner.hostmem import counts_world_footprint

    world = plan.world
    wf = counts_world_footprint(
        [lc.params for lc in cm.layers], cm.embed_params, cm.head_params, cm.dtype_bytes, world, plan.dp_reduce_every
    )
    acts = int(plan.predicted.get("pinned_host_bytes", 0) or 0)
    for fp in wf.ranks:
        fp.activations = acts
    per_rank = [max(fp.total, fp.save_peak) for fp in wf.ranks]
    return {
        "world_size": world.world_size,
        "nodes": world.nodes,
        "ranks_per_node": world.local_world_size,
        "host_bytes_per_node": [wf.node_peak(n) for n in range(world.nodes)],
        "shared_compute_bytes": wf.shared,
        "host_bytes_per_rank": per_rank,
        "host_terms_rank0": {k: v for k, v in wf.ranks[0].as_dict().items() if v},
        "host_memory_bytes": cm.hardware.host_memory_bytes,
        "step_time_s": sim.step_time_s,
        "tokens_per_s": sim.tokens_per_s * world.world_size,
        "bytes_per_step_rank0": plan.predicted.get("bytes_per_step"),
        "dp_reduce": plan.dp_reduce,
        "dp_reduce_every": plan.dp_reduce_every,
        "dp_reduce_step_s": plan.predicted.get("dp_reduce_step_s"),
    }


def _world_text(w: dict[str, Any]) -> str:
    node = max(w["host_bytes_per_node"])
    lines = [
        f"world: {w['world_size']} ranks on {w['nodes']} node(s), {w['ranks_per_node']} per node",
        f"  host RAM per node: {format_bytes(node)} (shared compute copy {format_bytes(w['shared_compute_bytes'])} "
        f"+ {w['ranks_per_node']} ranks) of {format_bytes(w['host_memory_bytes'])}"
        + ("" if node <= w["host_memory_bytes"] else "  -- does NOT fit the node's host memory"),
        "  host RAM per rank: "
        + ", ".join(f"rank {r} {format_bytes(b)}" for r, b in enumerate(w["host_bytes_per_rank"][:8]))
        + (" ..." if len(w["host_bytes_per_rank"]) > 8 else ""),
        f"  predicted step (slowest rank, simulated): {w['step_time_s']:.4f} s per optimizer step of "
        f"{w.get('gradient_accumulation_steps', 1)} micro-batch(es), {w['tokens_per_s']:.0f} tokens/s for the world",
    ]
    steps = w.get("dp_reduce_step_s") or {}
    where = {
        "host": "on the host (every rank copies D2H, gloo to the owner)",
        "device": "on the devices (to the owner before its D2H copy; the other ranks copy nothing)",
    }[w["dp_reduce"]]
    every = {"micro_batch": "every micro-batch", "step": "once per optimizer step (each rank accumulates first)"}
    lines.append(
        f"  gradients reduced {where}, {every[w.get('dp_reduce_every', 'micro_batch')]}"
        + (" [simulated step: " + ", ".join(f"{k} {v:.4f} s" for k, v in steps.items()) + "]" if steps else "")
    )
    b = w.get("bytes_per_step_rank0") or {}
    if b:
        lines.append("  rank 0 bytes per step: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in b.items()))
    return "\n".join(lines)


def cmd_simulate(args: argparse.Namespace) -> int:
    from .planner import milp
    from .planner.costmodel import CostModel
    from .planner.plan import Plan
    from .planner.simulate import draw_timeline, simulate

    _validate_common(args)
    hw = _profile(args)
    plan = Plan.from_json(args.plan)
    cfg, name = milp._resolve_config(args.model)
    cm = CostModel.from_config(cfg, hw, args.seq_len, plan.micro_batch_size, model_name=name)
    plan.validate(cm.num_layers)
    sim = simulate(plan, cm)
    ev = milp.evaluate_plan(plan, cm)
    gpu = args.gpu_budget or hw.default_gpu_budget()
    if args.timeline:
        draw_timeline(sim, args.timeline)
    if args.json:
        print(
            json.dumps(
                {"simulated": sim.predictions(), "stage_model": ev.predictions(), "fits": ev.peak_gpu_bytes <= gpu},
                indent=2,
            )
        )
    else:
        print(plan.table())
        print(
            f"simulated: step {sim.step_time_s:.4f} s, {sim.tflops:.1f} TFLOPS, {sim.tokens_per_s:.0f} tokens/s, "
            f"peak device {format_bytes(sim.peak_gpu_bytes)}; stage model: {ev.step_time_s:.4f} s; "
            f"{'fits' if ev.peak_gpu_bytes <= gpu else 'does NOT fit'} {format_bytes(gpu)}"
        )
        for lane in ("compute", "h2d", "d2h", "cpu") + (("net",) if plan.world_size > 1 else ()):
            print(f"  {lane:<8} busy {100 * sim.busy_fraction(lane):5.1f}%")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, ImportError) as e:
        from .planner.milp import PlanInfeasibleError

        if isinstance(e, PlanInfeasibleError):
            print(f"error: {e}", file=sys.stderr)
            return 3
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
