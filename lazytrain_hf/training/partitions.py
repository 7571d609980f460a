"""Checkpoints and resume of a training state partitioned by unit across data-parallel ranks, and the failures of
the ranks that write them.

Owns the protocol of Note: [A checkpoint of a partitioned state] (the files are named and read in
`training/partition_files.py`): `PartitionCheckpoints` (the staging directory shared by every rank, the fp32 masters
rank 0 receives for the weights file, each rank's partition, the barrier before rank 0 publishes, ``optimizer.pt``
holding the resident parameters only), `load_by_name` (a resume that takes each parameter's optimizer state by name
from ``optimizer.pt`` or whichever partition holds it, at any world size) and `check_partitioned_args`.

Note: [One timeout for the ranks' collectives]
    A Trainer user sets how long ranks wait for each other with ``TrainingArguments.ddp_timeout`` (seconds, 1800 by
    default; Trainer gives it to the default process group). LazyTrainer's own waits of a partitioned run, its gloo
    groups (`group_timeout`: gradient reduces, compute copies, norms, checkpoints) and the node copy's waits for a
    unit's update (`NodeCopy.wait`), take the same value: `configure_timeout` (called at train() by
    `check_partitioned_args`) makes ``ddp_timeout`` the default of `lazytrain_hf.streaming.nodecopy.dp_timeout_s`.
    The environment variable ``LAZYTRAIN_DP_TIMEOUT_S`` overrides it for those waits alone, and only downwards (a
    rank that stopped answering is named sooner): a value above ``ddp_timeout`` is refused, since the default group's
    collectives (a loss gather, the barrier of a save) would give up first. Timeout messages name the setting in
    force (`timeout_setting`). (transformers leaves the default group of a ``use_cpu`` run at torch's own 1800 s
    whatever ``ddp_timeout`` says; LazyTrainer's groups follow ``ddp_timeout`` there too.)
    Tests: ``tests/test_trainer_dp_checkpoints.py`` (``test_timeout_follows_ddp_timeout``, the hung rank).

Note: [A failed rank is named]
    Every gloo group of a partitioned run is created with the run's timeout (`group_timeout`; Note: [One timeout for
    the ranks' collectives]), so a collective blocked on a rank that stopped answering ends. When a collective fails
    (a killed peer closes its sockets at once; a hung one runs into the timeout) `PartitionCheckpoints.named_failure`
    looks at the other ranks of this node by the pids they gave when the group was created (``/proc``: gone or a
    zombie) and raises `RankFailedError` naming them ("rank 1 (pid ...) died"), or, with none dead, naming the
    timeout and the ranks it cannot see (other nodes). The message is also written to stderr at once: a launcher
    that stops the survivors right after a rank died (`torch.distributed.run`) may not leave time for the exception
    to reach the top. A save a rank did not finish leaves the staging directory unpublished
    (Note: [Atomic checkpoints]); the previous checkpoint stays.
    Tests: ``tests/test_trainer_dp_checkpoints.py`` (a rank killed mid-step and mid-save).

This module never imports `transformers.Trainer`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import time
from typing import Any

import torch

from ..streaming.nodecopy import (
    TIMEOUT_ENV,
    NodeCopyError,
    RankFailedError,
    dp_timeout_s,
    set_timeout_default,
    timeout_setting,
)
from .lazytensor import LazyTensor
from .masters import separate_masters
from .optimizer_groups import OptimizerStateMismatch, mapped_load
from .partition_files import (
    LAYOUT_FORMAT,
    PARTITIONED_KEY,
    PartitionIndex,
    is_partitioned,
    layout_name,
    partition_name,
)
from .safetensors_writer import write_safetensors
from .saved_weights import cast_overrides
from .staging import atomic_write_text, publish_checkpoint, remove_stale_staging, staging_dir

__all__ = ["PartitionCheckpoints", "RankFailedError", "check_partitioned_args", "configure_timeout", "group_timeout",
           "is_partitioned", "load_by_name", "save_weights"]  # fmt: skip
_NVME_ARRAYS = {"m_codes": "exp_avg_codes", "m_abs": "exp_avg_absmax", "v_codes": "exp_avg_sq_codes",
                "v_abs": "exp_avg_sq_absmax"}  # fmt: skip


# Note: [A failed rank is named]: how long a failed collective looks for a dead peer before naming none
DEATH_GRACE_S = 2.0


def group_timeout() -> datetime.timedelta:
    """The timeout of every gloo group of a partitioned run (Note: [One timeout for the ranks' collectives])."""
    return datetime.timedelta(seconds=dp_timeout_s())


def configure_timeout(args) -> float:
    """Note: [One timeout for the ranks' collectives]: make ``args.ddp_timeout`` the timeout of this process's
    data-parallel waits unless ``LAZYTRAIN_DP_TIMEOUT_S`` sets a shorter one; refuse a longer one. Returns the
    timeout in force (seconds)."""
    ddp_timeout = args.ddp_timeout
    if isinstance(ddp_timeout, bool) or not isinstance(ddp_timeout, (int, float)) or not ddp_timeout > 0:
        raise ValueError(
            f"ddp_timeout={ddp_timeout!r} must be a positive number of seconds (Trainer's default: 1800): how long a "
            f"data-parallel rank waits for the others."
        )
    set_timeout_default(ddp_timeout, "ddp_timeout")
    timeout = dp_timeout_s()  # LAZYTRAIN_DP_TIMEOUT_S when set (a bad value is refused there)
    if timeout > ddp_timeout:
        raise ValueError(
            f"{TIMEOUT_ENV}={timeout:g} s is longer than ddp_timeout={ddp_timeout:g} s: Trainer's collectives on the "
            "default process group (a loss gather, the barrier of a save) give up after ddp_timeout, so a rank "
            f"would never wait that long. Raise ddp_timeout to at least {timeout:g}, or unset {TIMEOUT_ENV} (then "
            "LazyTrainer's data-parallel waits use ddp_timeout too); a shorter value names a silent rank sooner."
        )
    return timeout


def check_partitioned_args(args, model) -> None:
    """Refuse, before anything is planned, what checkpoints of a partitioned training state do not support, and set
    the run's timeout (`configure_timeout`)."""
    from .weight_files import streams_weights

    configure_timeout(args)

    saving = str(getattr(args.save_strategy, "value", args.save_strategy)) != "no"
    if saving and args.save_on_each_node:
        raise ValueError(
            f"save_on_each_node=True with data parallel over world_size={args.world_size} ranks and the training "
            "state partitioned by unit: rank 0 writes the weights and every rank its own partition into one "
            "checkpoint directory, which all ranks must see; set save_on_each_node=False (a shared output_dir)."
        )
    if saving and not streams_weights(model):
        raise ValueError(
            f"save_strategy={str(getattr(args.save_strategy, 'value', args.save_strategy))!r} with data parallel over "
            f"world_size={args.world_size} ranks on a {type(model).__name__} (not a transformers PreTrainedModel, "
            "e.g. a PEFT wrapper): checkpoints of its partitioned state are not supported; set save_strategy='no' and "
            "save after train(), or train on one process."
        )


def _proc_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``/proc/<pid>/stat``), None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


class PartitionCheckpoints:
    """The checkpoint side of a partitioned run (Note: [A checkpoint of a partitioned state]); built collectively
    on every rank right after `PartitionedDataParallel`, with a gloo group of its own."""

    def __init__(self, handle, dp):
        import torch.distributed as dist

        self.handle = handle
        self.rank = int(dp.rank)
        self.world_size = int(dp.world.world_size)
        self.owners = dict(dp.owners)
        self.unit_keys = sorted(self.owners)
        self.group = dist.new_group(backend="gloo", timeout=group_timeout())
        peers: list = [None] * self.world_size
        with self.guard("the exchange of pids"):
            dist.all_gather_object(peers, (socket.gethostname(), os.getpid()), group=self.group)
        self.peers = peers
        # units whose saved weight is the fp32 master (Note: [A checkpoint holds the model in its own dtype]) and
        # whose master lives on another rank than 0: sent to rank 0 for the weights file, in this order
        self.gathered = [
            k
            for k in self.unit_keys
            if self.owners[k] not in (0, -1)
            and any(e.trainable and e.orig_dtype is not None and e.orig_dtype != e.dtype for e in self._entries(k))
        ]

    def __repr__(self) -> str:
        return f"PartitionCheckpoints(rank={self.rank} of {self.world_size}, masters to rank 0: {self.gathered})"

    def _entries(self, key: int) -> list:
        ls = self.handle.store.layers.get(key)
        return list(ls.entries) if ls is not None else []

    # ------------------------------------------------------------------ failures
    def dead_ranks(self, stopped: bool = False) -> dict[int, str]:
        """The other ranks of this node whose process is gone or a zombie (``stopped``: or stopped, e.g. by
        SIGSTOP or a debugger), with what was seen."""
        host = socket.gethostname()
        out = {}
        for r, (h, pid) in enumerate(self.peers):
            if r == self.rank or h != host:
                continue
            state = _proc_state(pid)
            if state is None or state in ("Z", "X"):
                out[r] = f"died (pid {pid}: {'no such process' if state is None else 'a zombie'})"
            elif stopped and state in ("T", "t"):
                out[r] = f"is stopped (pid {pid}, state {state}: SIGSTOP or a debugger)"
        return out

    def named_failure(self, what: str, error: BaseException) -> RankFailedError:
        """Note: [A failed rank is named]: the error to raise for a collective ``what`` that failed with ``error``."""
        # a killed peer's sockets close before its process becomes a zombie: look again for a moment
        dead, until = self.dead_ranks(), time.monotonic() + DEATH_GRACE_S
        while not dead and time.monotonic() < until:
            time.sleep(0.01)
            dead = self.dead_ranks()
        timeout = dp_timeout_s()
        if dead:
            text = "; ".join(f"rank {r} {why}" for r, why in sorted(dead.items()))
            msg = f"rank {self.rank}: {text} during {what} ({type(error).__name__}: {error})"
        else:
            others = [r for r, (h, _) in enumerate(self.peers) if h != socket.gethostname()]
            stopped = "; ".join(f"rank {r} {why}" for r, why in sorted(self.dead_ranks(stopped=True).items()))
            stopped = f" ({stopped})" if stopped else ""
            msg = (
                f"rank {self.rank}: {what} failed and no other rank of this node died{stopped}; a rank "
                f"{'of ' + str(others) + ' (other nodes) ' if others else ''}died or did not answer within "
                f"{timeout_setting()}={timeout:g} s ({type(error).__name__}: {error}). Look for the cause in the "
                f"other ranks' logs; if a step can take this long, raise {timeout_setting()}."
            )
        print(f"[lazytrain] {msg}", file=sys.stderr, flush=True)
        return RankFailedError(msg, dead)

    @contextlib.contextmanager
    def guard(self, what: str):
        """Collectives inside raise `RankFailedError` naming a dead rank (Note: [A failed rank is named])."""
        try:
            yield
        except NodeCopyError:  # named by the node copy (a failed or silent local rank)
            raise
        except Exception as e:
            if not self.peers or not (isinstance(e, RuntimeError) or "Dist" in type(e).__name__):
                raise
            raise self.named_failure(what, e) from e

    def check_error(self, error: BaseException) -> None:
        """Raise `RankFailedError` from ``error`` (raised by training) when another rank of this node died, or a
        collective failed (a timeout of a silent rank)."""
        if not isinstance(error, Exception):
            return
        chain, e = [], error
        while e is not None and len(chain) < 8:
            chain.append(e)
            e = e.__cause__ or e.__context__
        named = [x for x in chain if isinstance(x, NodeCopyError)]
        if named:  # the node copy named the rank already: say it at once (a launcher may stop this rank soon)
            print(f"[lazytrain] rank {self.rank}: {named[0]}", file=sys.stderr, flush=True)
            return
        collective = any("gloo" in str(x) or "Dist" in type(x).__name__ for x in chain)
        if self.dead_ranks() or collective:
            raise self.named_failure("training", error) from error

    # ------------------------------------------------------------------ the weights file
    def _owned_master(self, key: int) -> torch.Tensor:
        """This rank's fp32 master of unit ``key``, flat (read from its state file when the state is on NVMe)."""
        ls = self.handle.store.layers[key]
        spill = self.handle.nvme_state
        if spill is not None and key in spill.units:
            flat = torch.zeros(ls.layout.train_elems, dtype=torch.float32)
            for e in ls.trainable_entries:
                flat.narrow(0, e.elem_offset, e.numel).copy_(spill.read_param(key, e.name, "master").reshape(-1))
            return flat
        return ls.master

    def send_masters(self) -> None:
        """Every rank but 0: send the masters of its units in `gathered` to rank 0, in unit order."""
        import torch.distributed as dist

        with self.guard("sending fp32 masters to rank 0 for the checkpoint's weights"):
            for key in self.gathered:
                if self.owners[key] == self.rank:
                    dist.send(self._owned_master(key).contiguous(), dst=0, group=self.group)

    @contextlib.contextmanager
    def received_masters(self, overrides: dict):
        """Rank 0: ``overrides`` (`cast_overrides`) with the trainable parameters of the units in `gathered` read
        from their owners: each unit's flat master is received when the writer first reads one of its
        parameters, units in unit order, and dropped once all its parameters were read, so one unit is in memory
        at a time when the writer asks in unit order (as it does: the state dict's order)."""
        import torch.distributed as dist

        out = dict(overrides)
        cache: dict[int, list] = {}  # key -> [flat master, parameters left to read]
        pending = list(self.gathered)

        def fetch(key: int) -> torch.Tensor:
            while key not in cache:
                k = pending.pop(0)
                flat = torch.empty(self.handle.store.layers[k].layout.train_elems, dtype=torch.float32)
                with self.guard(f"receiving unit {k}'s fp32 masters from rank {self.owners[k]}"):
                    dist.recv(flat, src=self.owners[k], group=self.group)
                cache[k] = [flat, sum(1 for e in self._entries(k) if e.trainable)]
            entry = cache[key]
            entry[1] -= 1
            if entry[1] <= 0:
                del cache[key]
            return entry[0]

        for key in self.gathered:
            ls = self.handle.store.layers[key]
            for e in ls.trainable_entries:
                if e.orig_dtype is None or e.orig_dtype == e.dtype:
                    continue

                def read(k=key, e=e):
                    return fetch(k).narrow(0, e.elem_offset, e.numel).view(e.shape)

                out[e.name] = LazyTensor(torch.float32, tuple(e.shape), read)
        yield out
        while pending:  # units the writer did not read (none when it wrote every parameter): keep the pairs
            fetch(pending[0])

    # ------------------------------------------------------------------ a checkpoint
    def shared_staging(self, run_dir: str) -> str:
        """Rank 0's staging directory (stale ones removed first), the same on every rank."""
        import torch.distributed as dist

        box = [None]
        if self.rank == 0:
            remove_stale_staging(run_dir)
            box[0] = staging_dir(run_dir)
        with self.guard("agreeing on the checkpoint's staging directory"):
            dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    @contextlib.contextmanager
    def resident_optimizer_only(self, updater):
        """While inside, the optimizer's ``state_dict()`` (what Trainer saves as ``optimizer.pt``) holds the
        resident parameters only, marked with `PARTITIONED_KEY` (the units' state goes to the partitions)."""
        inner = updater.optimizer if updater is not None else None
        if inner is None:
            yield
            return
        keep = {name for name, _, _ in updater.resident}
        full = inner.state_dict

        def resident_state_dict() -> dict[str, Any]:
            sd = full()
            groups, state = [], {}
            for g in sd["param_groups"]:
                pairs = [(n, i) for n, i in zip(g["param_names"], g["params"]) if n in keep]
                groups.append({**g, "params": [i for _, i in pairs], "param_names": [n for n, _ in pairs]})
                state.update({i: sd["state"][i] for _, i in pairs if i in sd["state"]})
            sd.update(state=state, param_groups=groups)
            sd[PARTITIONED_KEY] = {"world_size": self.world_size, "holds": "resident parameters"}
            return sd

        inner.state_dict = resident_state_dict
        try:
            yield
        finally:
            del inner.state_dict

    def write_partition(self, directory: str, updater) -> None:
        """This rank's partition into ``directory`` (Note: [A checkpoint of a partitioned state]): its units'
        moments, step counts and the masters the weights file does not hold, then its layout record."""
        handle = self.handle
        spill = handle.nvme_state
        skip = set(cast_overrides(handle))
        masters = {n: t for n, t in separate_masters(handle, None, resident=False).items() if n not in skip}
        opt = updater.optimizer if updater is not None else None
        tensors: list[tuple[str, Any]] = []
        units, written_masters, states, steps = {}, [], [], {}
        block = int(opt.param_groups[0]["block_size"]) if opt is not None and opt.param_groups else 256
        for key in self.unit_keys:
            if self.owners[key] != self.rank:
                continue
            ls = handle.store.layers[key]
            units[str(key)] = [e.name for e in ls.trainable_entries]
            master_of = {name: m for name, m, _ in updater.layers.get(key, [])} if updater is not None else {}
            nvme = {p.name: p for p in spill.units[key].params} if spill is not None and key in spill.units else None
            for e in ls.trainable_entries:
                if e.name in masters:
                    tensors.append((f"{e.name}.master", masters[e.name]))
                    written_masters.append(e.name)
                if nvme is not None:
                    p = nvme[e.name]
                    if p.step == 0:
                        continue
                    steps[e.name] = int(p.step)
                    if p.q8:
                        for what, suffix in _NVME_ARRAYS.items():
                            n, dt = (p.numel, torch.uint8) if what.endswith("codes") else (p.nblk, torch.float32)
                            read = lambda k=key, nm=e.name, w=what: spill.read_param(k, nm, w)  # noqa: E731
                            tensors.append((f"{e.name}.{suffix}", LazyTensor(dt, (n,), read)))
                    else:
                        for what in ("exp_avg", "exp_avg_sq"):
                            tensors.append((f"{e.name}.{what}", spill.read_param(key, e.name, what)))
                    states.append(e.name)
                    continue
                st = opt.state.get(master_of[e.name]) if opt is not None and e.name in master_of else None
                if not st:
                    continue
                steps[e.name] = int(st["step"])
                for q in ("exp_avg", "exp_avg_sq"):
                    v = st[q]
                    if hasattr(v, "codes"):
                        tensors += [(f"{e.name}.{q}_codes", v.codes), (f"{e.name}.{q}_absmax", v.absmax)]
                    else:
                        tensors.append((f"{e.name}.{q}", v))
                states.append(e.name)
        os.makedirs(directory, exist_ok=True)
        write_safetensors(
            os.path.join(directory, partition_name(self.rank, self.world_size)),
            tensors,
            {"format": "pt", "rank": str(self.rank), "world_size": str(self.world_size)},
        )
        layout = {
            "format": LAYOUT_FORMAT,
            "world_size": self.world_size,
            "rank": self.rank,
            "unit_order": self.unit_keys,
            "owners": {str(k): r for k, r in self.owners.items()},
            "units": units,
            "masters": written_masters,
            "states": states,
            "steps": steps,
            "block_size": block,
        }
        atomic_write_text(os.path.join(directory, layout_name(self.rank, self.world_size)), json.dumps(layout))

    def complete(self, staging_root: str, final: str, updater) -> None:
        """Every rank: write its partition into the staged checkpoint and flush it; after a barrier rank 0 adds
        the resident masters and renames it into place (Note: [Atomic checkpoints]); a second barrier returns
        once the checkpoint is published."""
        import torch.distributed as dist

        staged = os.path.join(staging_root, os.path.basename(final))
        self.write_partition(staged, updater)
        for name in (partition_name(self.rank, self.world_size), layout_name(self.rank, self.world_size)):
            fd = os.open(os.path.join(staged, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        with self.guard(f"the barrier before {final} is published (every rank's partition written)"):
            dist.barrier(group=self.group)
        if self.rank == 0:
            skip = set(cast_overrides(self.handle))
            resident = {n: m for n, m in separate_masters(None, updater).items() if n not in skip}
            publish_checkpoint(staging_root, final, {n: t.detach() for n, t in resident.items()})
        with self.guard(f"the barrier after {final} was published"):
            dist.barrier(group=self.group)


# ---------------------------------------------------------------------- resume
@contextlib.contextmanager
def load_by_name(optimizer: Any, checkpoint: str | None):
    """While inside, ``optimizer.load_state_dict(sd)`` (``sd``: the checkpoint's ``optimizer.pt``) loads, for each
    parameter of its groups by name, the state ``sd`` holds or else the state a partition of ``checkpoint`` holds
    (Note: [A checkpoint of a partitioned state]): resume at the same or another world size, or of a one-process
    checkpoint on several ranks (names ``sd`` has that this rank does not train are dropped)."""
    with mapped_load(optimizer, checkpoint, lambda sd, gs: _merged(sd, gs, PartitionIndex(checkpoint), checkpoint)):
        yield


def _merged(sd: dict[str, Any], groups: list[dict], index: PartitionIndex, checkpoint: str) -> dict[str, Any]:
    saved: dict[str, tuple[Any, dict]] = {}
    for g in sd["param_groups"]:
        names = g.get("param_names")
        if names is None:
            raise OptimizerStateMismatch(
                f"checkpoint {checkpoint}: its optimizer.pt lists parameters without their names (an earlier "
                "lazytrain_hf); it cannot be resumed with the training state partitioned across ranks. Resume it on "
                "one process, or start without resume_from_checkpoint."
            )
        for n, i in zip(names, g["params"]):
            saved[n] = (sd["state"].get(i), g)
    new_groups, new_state, missing = [], {}, []
    pid = 0
    for group in groups:
        source = None
        ids = []
        for n, p in zip(group["param_names"], group["params"]):
            if n in saved:
                st, source = saved[n][0], source or saved[n][1]
            elif n in index.names:
                st = index.state(n, tuple(p.shape))
            else:
                missing.append(n)
                continue
            if st:
                new_state[pid] = st
            ids.append(pid)
            pid += 1
        if source is None:  # every parameter from partitions: the saved group with the same weight decay
            same = [g for g in sd["param_groups"] if g.get("weight_decay") == group.get("weight_decay")]
            source = same[0] if same else group
        hyper = {k: v for k, v in source.items() if k not in ("params", "param_names")}
        new_groups.append({**hyper, "params": ids, "param_names": list(group["param_names"])})
    if missing:
        raise OptimizerStateMismatch(
            f"checkpoint {checkpoint}: neither its optimizer.pt nor its partition files hold an optimizer state for "
            f"{missing[:3]} ({len(missing)} parameters this run trains). Resume from a checkpoint of this model with "
            "the same trainable parameters, or start without resume_from_checkpoint."
        )
    out = {k: v for k, v in sd.items() if k != PARTITIONED_KEY}
    out.update(state=new_state, param_groups=new_groups)
    return out


# ---------------------------------------------------------------------- the weights of a streamed run
def save_weights(
    model, output_dir: str, args, args_file: str, handle, tokenizer, parts: PartitionCheckpoints | None
) -> None:
    """The weights of a streamed model (Note: [Checkpoints are streamed from the host store] in
    training/weight_files.py), its tokenizer and ``args`` (as ``args_file``) into ``output_dir`` by the rank that
    saves; with ``parts`` (a partitioned run) every rank takes part: the others send rank 0 the masters it writes
    (Note: [A checkpoint of a partitioned state])."""
    from .weight_files import save_streamed

    if parts is not None and parts.rank != 0:
        parts.send_masters()
        return
    if not args.should_save:
        return
    spill = handle.nvme_state if handle is not None else None
    overrides = cast_overrides(handle)
    with parts.received_masters(overrides) if parts is not None else contextlib.nullcontext(overrides) as values:
        # units whose state is on NVMe are read from their state files, one at a time
        save_streamed(model, output_dir, read=spill.read_values if spill is not None else None, overrides=values)
    if tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    torch.save(args, os.path.join(output_dir, args_file))
