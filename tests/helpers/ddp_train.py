"""Data-parallel body for tests/test_trainer_ddp.py: run under `torchrun --nproc_per_node N` (gloo on CPU) or as a
single process; writes this rank's final weights to <out>/rank<R>.safetensors and, in <out>/rank<R>.stats.json, its
losses, the host bytes of the training state of the streamed units it holds (fp32 masters and gradient accumulators
from the host store, 8-bit moments from the optimizer's state) and the units whose masters the optimizer updated."""

from __future__ import annotations

import json
import os

from dp_common import base_parser, rank, save_rank_weights, trainer_options


def _state_nbytes(value) -> int:
    """Bytes of one optimizer-state entry: a tensor, or an 8-bit state's codes and per-block scales."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    codes, absmax = getattr(value, "codes", None), getattr(value, "absmax", None)
    if codes is None:
        return 0
    return codes.numel() * codes.element_size() + absmax.numel() * absmax.element_size()


def _given_back(params) -> dict[str, int]:
    """Where the parameters given back by train() live: their bytes in the node's shared segment (``node copy``: a
    mapping of a file of /dev/shm named ``lazytrain-...``) and in this process's own memory (``own``), and
    ``node copy written``: bytes of that segment's mappings that became this process's own pages (copy-on-write;
    smaps' ``Anonymous``)."""
    spans, written, current = [], 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                current = len(head) > 5 and os.path.basename(head[5]).startswith("lazytrain-")
                spans.append((lo, hi, current))
            elif head[0] == "Anonymous:" and current:
                written += int(head[1]) * 1024
    out = {"node copy": 0, "own": 0, "node copy written": written}
    for p in params:
        ptr = p.data_ptr()
        shared = any(lo <= ptr < hi and cow for lo, hi, cow in spans)
        out["node copy" if shared else "own"] += p.numel() * p.element_size()
    return out


def main() -> None:
    p = base_parser(max_steps=3)
    p.add_argument("--policy", default="default")
    p.add_argument("--model-type", default="qwen3")
    p.add_argument("--stream-embeddings", action="store_true")
    p.add_argument("--dp-reduce", default=None, help="planner_dp_reduce (auto, host, device)")
    p.add_argument("--hardware", default=None, help="planner_hardware (default: the fixtures' bundled 'cpu')")
    a = p.parse_args()

    from trainer_fixtures import make_trainer
    from transformers import TrainerCallback

    from lazytrain_hf.optim import HybridAdamW8bit
    from lazytrain_hf.streaming.nvmestate import NvmeState
    from lazytrain_hf.training import planning

    me = rank()
    planned = []
    real_make_plan = planning.make_plan

    def counting_make_plan(*args, **kwargs):
        planned.append(me)
        return real_make_plan(*args, **kwargs)

    planning.make_plan = counting_make_plan  # which ranks profile, warm up and solve
    extra = trainer_options(a)
    if a.stream_embeddings:
        extra.update(stream_embeddings=True)
    if a.dp_reduce:
        extra.update(planner_dp_reduce=a.dp_reduce)
    if a.hardware:
        extra.update(planner_hardware=a.hardware)
    trainer = make_trainer(
        os.path.join(a.out, "run"),
        planner_policy=a.policy,
        model_type=a.model_type,
        **extra,
    )

    # the tensors the optimizer updated (by identity), mapped to their units at the end of training
    updated_ids: set[int] = set()
    real_update = HybridAdamW8bit._update

    def recording_update(self, p, *args, **kwargs):
        if p.grad is not None:
            updated_ids.add(id(p))
        return real_update(self, p, *args, **kwargs)

    HybridAdamW8bit._update = recording_update
    updated_nvme: set[int] = set()  # units updated out of core (state on NVMe)
    real_update_unit = NvmeState.update_unit

    def recording_update_unit(self, key, *args, **kwargs):
        updated_nvme.add(key)
        return real_update_unit(self, key, *args, **kwargs)

    NvmeState.update_unit = recording_update_unit
    stats: dict = {}
    streamed_params: list = []

    class Record(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            handle, updater, opt = trainer.stream_handle, trainer._updater, trainer.optimizer
            updater.wait_all()
            streamed = [m for entries in updater.layers.values() for _, m, _ in entries]
            hb = handle.store.host_bytes()
            stats["master_bytes"] = hb["master"]
            stats["grad_bytes"] = hb["grad"]
            stats["compute_bytes"] = hb["compute"]
            stats["moment_bytes"] = sum(_state_nbytes(v) for m in streamed for v in opt.state.get(m, {}).values())
            stats["updated_units"] = sorted(
                i
                for i, entries in updater.layers.items()
                if i in updated_nvme or any(id(m) in updated_ids for _, m, _ in entries)
            )
            stats["units"] = sorted(handle.store.layers)
            streamed_params.extend(e.param for ls in handle.store.layers.values() for e in ls.entries)
            # the compute copies in the node's shared segment (data parallel), or in this process's memory
            nc = handle.store.node_copy
            if nc is not None:
                lo, hi = nc.data.data_ptr(), nc.data.data_ptr() + nc.data_nbytes
                shared = handle.store.shared_compute.values()
                stats["compute_in_node_copy"] = all(lo <= t.data_ptr() < hi for t in shared)
                stats["node_copy_bytes"] = nc.data_nbytes
            # the trace's lane "net" per completed step, by kind (reduce, gather)
            # and the D2H gradient bytes per unit per step (keys: str(unit))
            stats["net"], stats["d2h_grad"] = [], []
            for step in handle.trace.steps:
                kinds: dict[str, int] = {}
                d2h: dict[str, int] = {}
                for t in step.get("transfers", []):
                    if t["lane"] == "net":
                        kinds[t["what"]] = kinds.get(t["what"], 0) + t["bytes"]
                    if t["lane"] == "d2h" and t["what"] == "grad":
                        d2h[str(t["layer"])] = d2h.get(str(t["layer"]), 0) + t["bytes"]
                stats["net"].append(kinds)
                stats["d2h_grad"].append(d2h)
            # Note: [The trace is the planner's referee]: every lane of every traced step, this rank's
            stats["trace_bytes"] = [dict(step["bytes"]) for step in handle.trace.steps]
            # the NVMe reads per step by kind and unit ("fetch_fwd 0", "grad -1", ...)
            stats["nvme_read"] = []
            for step in handle.trace.steps:
                by: dict[str, int] = {}
                for t in step.get("transfers", []):
                    if t["lane"] == "nvme_read":
                        key = f"{t['what']} {t['layer']}"
                        by[key] = by.get(key, 0) + t["bytes"]
                stats["nvme_read"].append(by)
            if handle.nvme_state is not None:
                stats["nvme_units"] = sorted(handle.nvme_state.units)
            # gradient reduces each unit took part in over the run (data parallel; keys: str(unit))
            dp = trainer._dp
            # Note: [Masters live in the node's segment] (training/dataparallel.py): where each owned unit's fp32
            # masters of a compute copy in another dtype lie while training (True: in the node's segment of masters)
            seg = getattr(dp, "masters_copy", None)
            span = (seg.data.data_ptr(), seg.data.data_ptr() + seg.data_nbytes) if seg is not None else (0, 0)
            stats["masters_in_segment"] = {
                str(i): span[0] <= ls.master.data_ptr() < span[1]
                for i, ls in handle.store.layers.items()
                if ls.master is not None and any(e.trainable and e.orig_dtype is not None for e in ls.entries)
            }
            stats["reductions"] = {str(k): v for k, v in dp.reductions.items()} if dp is not None else {}

    trainer.add_callback(Record())
    trainer.train()
    save_rank_weights(trainer, a.out)
    # Note: [Parameters given back share the node copy]: after train() (and after reading them all to save them)
    stats["given_back"] = _given_back(streamed_params)
    losses = ",".join(f"{x:.8f}" for x in trainer.loss_recorder.losses)
    with open(os.path.join(a.out, f"rank{me}.losses"), "w") as f:
        f.write(losses)
    with open(os.path.join(a.out, f"rank{me}.plan.json"), "w") as f:
        f.write(trainer.lazy_plan.to_json())
    with open(os.path.join(a.out, f"rank{me}.planned"), "w") as f:
        f.write(str(len(planned)))
    stats["losses"] = trainer.loss_recorder.losses
    # Note: [The world's links are measured]: what every rank measured, and the figures rank 0 planned with
    stats["world_links"] = trainer.lazy_world_links
    if trainer.lazy_cost_model is not None:
        hw = trainer.lazy_cost_model.hardware
        stats["planned_links"] = {k: getattr(hw, k) for k in ("shm_gbps", "device_net_gbps", "net_gbps")}
    with open(os.path.join(a.out, f"rank{me}.stats.json"), "w") as f:
        json.dump(stats, f)


if __name__ == "__main__":
    main()
