"""Data parallel on one node: host memory and CPU optimizer time of 1, 2 and 4 ranks training one model, side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_dp.py                  # ~650M-parameter Qwen3, 1 / 2 / 4 ranks
    PYTHONPATH=. .venv/bin/python benchmarks/bench_dp.py --tiny --procs 1,2   # ~6M parameters, a minute
    PYTHONPATH=. .venv/bin/python benchmarks/bench_dp.py --bf16               # a bf16 compute copy, fp32 masters

Every configuration is a fresh `torch.distributed.run --standalone --nproc_per_node N` launch (gloo, one thread per
rank: ``OMP_NUM_THREADS=1``) of this file's ``--worker``, training the same randomly initialised checkpoint
(`bench_state_nvme.write_random_checkpoint`, loaded with `lazytrain_hf.from_pretrained`: the weights stay on disk
until the host store reads them layer by layer) at the same global batch (``--global-batch`` sequences, split over
the ranks) for ``--steps`` optimizer steps with the fixed ``planner_policy="default"`` plan (every decoder layer
streamed) and ``stream_embeddings=True`` (the embedding and the head are streamed units too, so their training state
is partitioned like a layer's; ``--resident-embeddings`` keeps them resident: every rank then holds and updates
them), so that the configurations differ only in the number of ranks. ``--reps`` repeats the whole sweep,
interleaved (1, 2, 4, 1, 2, 4, ...); the figures are medians over the repetitions.

Per rank, the worker reports:
- peak RSS (``ru_maxrss``) and peak PSS (``/proc/self/smaps_rollup``, sampled every 50 ms): RSS counts a page shared
  by several processes (the node's shared compute copy) in each of them, PSS divides it among them, so the *sum over
  ranks* of peak PSS is what the node really holds; the summed figure is judged on PSS;
- optimizer time per step: wall time of `LayerwiseUpdater.run` (synchronous on the CPU), median over the steps after
  the first, and the CPU time the process spent in it (``time.process_time`` less the PSS sampler's own thread
  time: on a machine where other jobs take cores, the wall time of N ranks on N cores stretches while the CPU time
  is the work each rank did);
- the executor's accounted device peak (``peak_device_bytes`` of the step logs): on the CPU device the "device" is
  this same RAM, so PSS counts the slots, the activations and the chunked loss that a GPU run keeps in GPU memory;
  the *host* columns are PSS less that figure, what a GPU run's host would hold;
- ``train PSS``: the peak PSS up to ``on_train_end``, before `remove()` gives the model back at the end of
  `train()` (as views of the store's buffers or of the node's shared copy), so the training steps' own peak;
  ``train host``: the same less the executor's accounted device peak (what a GPU run's host would hold over the
  training steps);
- step time: median interval between step ends after the first;
- the bytes per lane of its first traced step (the trace's ``bytes_per_step``);
- how many units it updated in that step (the trace's updates: the optimizer's work divided among the ranks).

Printed: one row per rank count with the ratios to one process; ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULT_PREFIX = "BENCH_DP_RESULT "

# ~650M parameters: an untied 32768 x 1536 embedding and head (101M) and 20 layers of hidden 1536 (551M), so that
# what each process carries before it holds any state (torch, transformers, datasets: the "process" column) is small
# beside the training state, as it is for the models the product is for; short sequences (``--seq 16``) keep the
# compute of four ranks on two cores to minutes while the state is that of the whole model
BASE = dict(
    model_type="qwen3", hidden_size=1536, intermediate_size=4608, num_hidden_layers=20, num_attention_heads=12,
    num_key_value_heads=4, head_dim=128, vocab_size=32768, max_position_embeddings=2048, tie_word_embeddings=False,
    rms_norm_eps=1e-6, rope_theta=1e6,
)
TINY = dict(BASE, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=8192)


def _pss_kib() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakPss:
    """The process's peak PSS, sampled on a daemon thread. Reading ``smaps_rollup`` walks the process's page tables
    (kernel time that grows with the resident set), so the thread's own CPU time is kept (``cpu_s``) for the
    optimizer's CPU time to leave it out."""

    def __init__(self, every_s: float = 0.05):
        self.peak_kib = _pss_kib()
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.peak_kib = max(self.peak_kib, _pss_kib())
            self.cpu_s = time.thread_time()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, _pss_kib())
        return self.peak_kib * 1024


def worker(a) -> None:
    """One rank: train, then print this rank's figures as one JSON line after `RESULT_PREFIX`."""
    sampler = PeakPss()
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    import lazytrain_hf
    from lazytrain_hf import LazyTrainer, LazyTrainingArguments
    from lazytrain_hf.training import updater as updater_mod

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if a.global_batch % world:
        raise SystemExit(f"--global-batch {a.global_batch} is not a multiple of the {world} ranks")
    opt_times: list[float] = []
    opt_cpu: list[float] = []
    real_run = updater_mod.LayerwiseUpdater.run

    def timed_run(self, clip_coef):
        t0, c0 = time.perf_counter(), time.process_time() - sampler.cpu_s
        real_run(self, clip_coef)
        self.wait_all()
        opt_times.append(time.perf_counter() - t0)
        opt_cpu.append(time.process_time() - sampler.cpu_s - c0)

    updater_mod.LayerwiseUpdater.run = timed_run
    step_ends: list[float] = []
    lanes: dict[str, int] = {}
    box: dict = {}

    device_peak = [0]

    class Probe(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            device_peak[0] = max(device_peak[0], int((logs or {}).get("peak_device_bytes", 0)))

        def on_train_end(self, args, state, control, **kw):
            # the peak over the training steps: before `remove()` gives the model back at the end of `train()`
            box["train_pss"] = max(sampler.peak_kib, _pss_kib()) * 1024

        def on_step_end(self, args, state, control, **kw):
            step_ends.append(time.perf_counter())
            handle = box["trainer"].stream_handle
            if handle is not None and not lanes:
                done = handle.trace.steps
                if done:
                    lanes.update(done[0]["bytes"])
                    box["units"] = sum(1 for u in done[0]["updates"] if u["layer"] != "resident")

    g = torch.Generator().manual_seed(0)
    n_rows = a.global_batch * a.steps
    ids = torch.randint(0, a.vocab, (n_rows, a.seq), generator=g)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    model = lazytrain_hf.from_pretrained(a.checkpoint, dtype=torch.float32)
    args = LazyTrainingArguments(
        output_dir=os.path.join(a.out, f"run{world}"), per_device_train_batch_size=a.global_batch // world,
        max_steps=a.steps, learning_rate=1e-4, logging_steps=1, report_to=[], seed=0, data_seed=0, use_cpu=True,
        save_strategy="no", planner_hardware="cpu", planner_policy="default", planner_warmup_steps=1,
        dataloader_drop_last=True, stream_trace_steps=2, stream_embeddings=not a.resident_embeddings,
        planner_dp_reduce=a.dp_reduce, bf16=a.bf16,
    )
    trainer = LazyTrainer(model=model, args=args, train_dataset=data, callbacks=[Probe()])
    box["trainer"] = trainer
    trainer.train()
    pss = sampler.stop()
    later = opt_times[1:] or opt_times
    later_cpu = opt_cpu[1:] or opt_cpu
    gaps = [b - a_ for a_, b in zip(step_ends, step_ends[1:])]
    out = dict(
        rank=rank, world=world, peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, peak_pss=pss,
        optimizer_s=statistics.median(later) if later else None, step_s=statistics.median(gaps) if gaps else None,
        optimizer_cpu_s=statistics.median(later_cpu) if later_cpu else None, device_peak=device_peak[0],
        train_pss=box.get("train_pss", pss),
        lanes=lanes, units_updated=box.get("units"), losses=trainer.state.log_history and
        [h["loss"] for h in trainer.state.log_history if "loss" in h],
    )
    print(RESULT_PREFIX + json.dumps(out), flush=True)


def baseline_worker() -> None:
    """A process that imports what a rank imports and holds nothing else: its PSS is what every rank carries before
    any training state (printed after `RESULT_PREFIX`)."""
    import datasets  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from lazytrain_hf import LazyTrainer, LazyTrainingArguments  # noqa: F401

    print(RESULT_PREFIX + json.dumps(dict(peak_pss=_pss_kib() * 1024)), flush=True)


def process_baseline(a) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--baseline"], capture_output=True, text=True,
                          env=env, timeout=a.timeout, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX))
    return json.loads(line[len(RESULT_PREFIX):])["peak_pss"]


def launch(a, procs: int) -> list[dict]:
    """One `torch.distributed.run` launch of ``procs`` ranks; each rank's figures."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs),
           os.path.abspath(__file__), "--worker", "--checkpoint", a.checkpoint, "--out", a.out,
           "--global-batch", str(a.global_batch), "--steps", str(a.steps), "--seq", str(a.seq),
           "--vocab", str(a.vocab), "--dp-reduce", a.dp_reduce] + (
               ["--resident-embeddings"] if a.resident_embeddings else []) + (["--bf16"] if a.bf16 else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{procs} ranks failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    rows = [json.loads(line[len(RESULT_PREFIX):]) for line in proc.stdout.splitlines()
            if line.startswith(RESULT_PREFIX)]
    if len(rows) != procs:
        raise SystemExit(f"{procs} ranks reported {len(rows)} results:\n{proc.stdout[-3000:]}")
    return sorted(rows, key=lambda r: r["rank"])


def summarise(runs: list[list[dict]]) -> dict:
    """Medians over repetitions of one rank count's per-rank maxima and sums."""

    def med(f):
        vals = [f(r) for r in runs]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    return dict(
        procs=len(runs[0]),
        rss_max=med(lambda r: max(x["peak_rss"] for x in r)),
        rss_sum=med(lambda r: sum(x["peak_rss"] for x in r)),
        pss_max=med(lambda r: max(x["peak_pss"] for x in r)),
        pss_sum=med(lambda r: sum(x["peak_pss"] for x in r)),
        host_sum=med(lambda r: sum(x["peak_pss"] - x["device_peak"] for x in r)),
        train_pss_sum=med(lambda r: sum(x["train_pss"] for x in r)),
        train_host_sum=med(lambda r: sum(x["train_pss"] - x["device_peak"] for x in r)),
        opt_max=med(lambda r: max(x["optimizer_s"] for x in r)),
        opt_cpu_max=med(lambda r: max(x["optimizer_cpu_s"] for x in r)),
        step=med(lambda r: max(x["step_s"] for x in r)),
        lanes=runs[0][0]["lanes"],
        units=[x["units_updated"] for x in runs[0]],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--procs", default="1,2,4", help="rank counts, comma separated (default 1,2,4)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--dp-reduce", default="device", choices=["auto", "host", "device"],
                   help="planner_dp_reduce: where gradients are reduced to their owner (default device: before D2H, "
                        "so a rank stages only its own units' gradients)")
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--resident-embeddings", action="store_true",
                   help="keep the embedding and head resident (replicated on every rank) instead of streamed units")
    p.add_argument("--tiny", action="store_true", help="a ~6M-parameter model of the same family")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default 20: ~650M parameters; 40: ~1.2B), the rest of the shape unchanged")
    p.add_argument("--bf16", action="store_true",
                   help="bf16=True on the fp32 model (as the recipe trains): a bf16 compute copy, fp32 masters")
    p.add_argument("--work", default=None, help="where the checkpoint and runs go (default: a temporary dir)")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--json", default=None, help="write every figure to this file")
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    if a.baseline:
        baseline_worker()
        return 0
    sys.path.insert(0, HERE)
    import torch
    from bench_state_nvme import ensure_checkpoint, make_config

    spec = dict(TINY if a.tiny else BASE)
    if a.layers:
        spec["num_hidden_layers"] = a.layers
    a.vocab = a.vocab or spec["vocab_size"]
    work = a.work or tempfile.mkdtemp(prefix="bench_dp_")
    a.checkpoint = os.path.join(work, f"{'tiny' if a.tiny else 'base'}{spec['num_hidden_layers']}")
    a.out = os.path.join(work, "runs")
    config = make_config(spec)
    info, _, _ = ensure_checkpoint(config, a.checkpoint, torch.float32)
    procs = [int(x) for x in a.procs.split(",")]
    print(f"# bench_dp {datetime.date.today()} {platform.node()} {os.cpu_count()} cpus; "
          f"{info.get('params', 0) / 1e6:.1f}M parameters, global batch {a.global_batch} x {a.seq} tokens, "
          f"{a.steps} steps, {a.reps} rep(s); command: {' '.join(sys.argv)}", flush=True)
    runs: dict[int, list[list[dict]]] = {n: [] for n in procs}
    for _ in range(a.reps):
        for n in procs:
            runs[n].append(launch(a, n))
    rows = [summarise(runs[n]) for n in procs]
    base = rows[0]
    mib = 1 << 20
    floor = process_baseline(a)
    for r in rows:
        r["process_pss"] = floor
        r["state_sum"] = r["host_sum"] - r["procs"] * floor
    print(f"# process: {floor / mib:.0f} MiB PSS in a process that only imports what a rank imports; 'host' is PSS "
          f"less the executor's accounted device bytes (the CPU device's memory is this RAM); 'state' is host less "
          f"one process figure per rank")
    print(f"{'ranks':>5} {'RSS/rank':>9} {'RSS sum':>9} {'PSS/rank':>9} {'PSS sum':>9} {'x1':>6} {'host sum':>9} "
          f"{'x1':>6} {'state sum':>9} {'x1':>6} {'train PSS':>9} {'x1':>6} {'train host':>10} {'x1':>6} {'opt/rank s':>10} {'x1':>6} {'opt cpu s':>9} {'x1':>6} {'step s':>7} {'units/rank':>12}  "
          f"bytes per lane (rank 0)")
    for r in rows:
        print(f"{r['procs']:>5} {r['rss_max'] / mib:>8.0f}M {r['rss_sum'] / mib:>8.0f}M {r['pss_max'] / mib:>8.0f}M "
              f"{r['pss_sum'] / mib:>8.0f}M {r['pss_sum'] / base['pss_sum']:>6.2f} {r['host_sum'] / mib:>8.0f}M "
              f"{r['host_sum'] / base['host_sum']:>6.2f} {r['state_sum'] / mib:>8.0f}M "
              f"{r['state_sum'] / base['state_sum']:>6.2f} {r['train_pss_sum'] / mib:>8.0f}M "
              f"{r['train_pss_sum'] / base['train_pss_sum']:>6.2f} {r['train_host_sum'] / mib:>9.0f}M "
              f"{r['train_host_sum'] / base['train_host_sum']:>6.2f} {r['opt_max']:>10.3f} {r['opt_max'] / base['opt_max']:>6.2f} "
              f"{r['opt_cpu_max']:>9.3f} {r['opt_cpu_max'] / base['opt_cpu_max']:>6.2f} {r['step']:>7.2f} "
              f"{str(r['units']):>12}  { {k: v for k, v in r['lanes'].items() if v} }")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, runs={str(k): v for k, v in runs.items()}), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
