"""Training state on NVMe: bytes moved per step against the plan's prediction, step time, peak RSS, and bit-exactness
of a run whose state lives on NVMe against the same run with the state in RAM.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_state_nvme.py --headline --work /scratch/nvme_bench
    PYTHONPATH=. .venv/bin/python benchmarks/bench_state_nvme.py --bitexact --work /scratch/nvme_bench --steps 4 --ga 2
    PYTHONPATH=. .venv/bin/python benchmarks/bench_state_nvme.py --headline --tiny     # ~6M parameters, < 1 minute

Both modes train on a checkpoint of a randomly initialised model written by `write_random_checkpoint`, which never
materialises the model: the model is built on the meta device for its names and shapes, and each tensor is generated
(HF's initialisation for Qwen) and written block by block straight into its safetensors shard, so the writer's peak
memory is one block, whatever the model size. Every training run is a fresh subprocess (its peak RSS is its own),
loading the checkpoint with `lazytrain_hf.from_pretrained` (weights stay on disk until the host store reads them
layer by layer) in float32 and training with ``bf16=True``: fp32 masters on the host with a bf16 compute copy (see
`LazyTrainer._compute_dtype`); the trained model is then fp32 again, holding the masters, which is what
``save_model`` writes and ``--bitexact`` compares. ``--model-dtype bfloat16`` loads bf16 parameters instead (the
store still keeps fp32 masters; ``save_model`` then writes the bf16 weights).

``--headline``: a Qwen2.5-3B-shaped model (bf16 checkpoint, config below, no Hub access) trains ``--steps`` (3)
optimizer steps with its state on NVMe where it does not fit ``--host-budget`` (6GiB), embeddings and head streamed
too. Printed: the state size, free disk, peak RSS, per-step wall time and loss, and per step the trace's NVMe read and
write bytes against the plan's ``predicted["bytes_per_step"]`` (they must be equal).

``--bitexact``: a ~306M-parameter Qwen3-shaped model trains ``--steps`` (4) steps twice with identical seeds, once
with the state in RAM and once with every streamed unit's state on NVMe (``state_nvme_layers="all"``); the per
micro-batch losses (float bits) and every tensor of the saved final weights must be equal, else the exit status is 1.

``--bitexact`` runs the fixed ``planner_policy="default"`` plan (every decoder layer streamed) unless ``--policy``
says otherwise, so that the two runs differ only in where the state lives; the script prints which units the plan put
on NVMe and which layers it keeps resident on the device (a resident layer's state stays in RAM).

``--tiny`` swaps either model for a ~6M-parameter one of the same family, to check the whole path in under a minute;
with ``--headline`` it also sets ``planner_gpu_budget`` to `TINY_GPU_BUDGET` (every layer streamed) and
``state_nvme_layers="all"`` with the default host budget (see `TINY_GPU_BUDGET`).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from lazytrain_hf.planner.zoo import get_config as get_zoo_config

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Qwen2.5-3B's config.json: the planner zoo's architecture fields (3.09B parameters, tied embeddings) and the rest
QWEN25_3B = dict(
    **get_zoo_config("qwen2.5-3b").to_dict(),
    rope_theta=1_000_000.0,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    initializer_range=0.02,
    attention_dropout=0.0,
    use_sliding_window=False,
    sliding_window=32768,
    max_window_layers=36,
    bos_token_id=151643,
    eos_token_id=151643,
)
# Qwen3 family (Qwen3-0.6B's vocabulary and width, fewer layers, narrower MLP and heads): 306M parameters, of which
# 156M are the tied embedding.
QWEN3_300M = dict(
    model_type="qwen3",
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=151936,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    initializer_range=0.02,
    bos_token_id=151643,
    eos_token_id=151645,
)
# ~6M-parameter stand-ins of the same families for --tiny.
_TINY = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=4096,
    max_position_embeddings=4096,
    bos_token_id=None,
    eos_token_id=None,
)
TINY_QWEN2 = {**QWEN25_3B, **_TINY, "max_window_layers": 6}
TINY_QWEN3 = {**QWEN3_300M, **_TINY}
# --tiny --headline: a device budget near the smallest feasible (12.9 MiB on the CPU device at 1 x 256 tokens), so
# that the MILP streams every decoder layer as it would the large model's; and state_nvme_layers="all" (default host
# budget), because the small model's whole state (~66 MiB) is about the size of the fixed host windows that units on
# NVMe need (~63 MiB), so no host budget puts only part of it on NVMe.
TINY_GPU_BUDGET = "16MiB"

# Elements generated and written at once: the writer's working memory is one block (fp32 draw + its cast).
BLOCK_ELEMS = 1 << 19
# Largest shard, in parameters (about 4 GB in bf16): Qwen2.5-3B gets 2 shards, as on the Hub.
DEFAULT_MAX_SHARD_PARAMS = 2_000_000_000
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
RESULT_PREFIX = "BENCH_STATE_NVME_RESULT "
COMPLETE_FILE = ".random_checkpoint.json"  # written last: the checkpoint is complete and what it was written from


def make_config(spec: dict[str, Any]):
    """A transformers config from one of the dicts above (``model_type`` plus attributes)."""
    from transformers import AutoConfig

    spec = dict(spec)
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


# ---------------------------------------------------------------------------------------------------------------------
# Random checkpoint writer
# ---------------------------------------------------------------------------------------------------------------------


def _tensor_seed(seed: int, name: str) -> int:
    """A seed for one tensor from the run seed and the tensor's name (stable across processes and Python versions)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_rule(module: torch.nn.Module, pname: str) -> tuple[str, int | None]:
    """How HF initialises parameter ``pname`` of ``module`` (`PreTrainedModel._init_weights`, which Qwen2 and Qwen3
    use): ``("normal", padding_idx)`` for Linear and Embedding weights (std ``config.initializer_range``, the
    embedding's padding row zero), ``("ones", None)`` for norm weights, ``("zeros", None)`` for biases."""
    kind = type(module).__name__
    if isinstance(module, torch.nn.Linear):
        return ("normal", None) if pname == "weight" else ("zeros", None)
    if isinstance(module, torch.nn.Embedding) and pname == "weight":
        return "normal", module.padding_idx
    if "RMSNorm" in kind or "LayerNorm" in kind:
        return ("ones", None) if pname == "weight" else ("zeros", None)
    raise ValueError(
        f"write_random_checkpoint has no initialisation rule for parameter {pname!r} of {kind}; it covers Linear, "
        "Embedding and RMSNorm/LayerNorm modules (Qwen2 and Qwen3 decoder models)."
    )


def _meta_model(config, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)


def checkpoint_tensors(config, dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """The tensors `save_pretrained` would write for ``AutoModelForCausalLM.from_config(config)``, in state-dict order,
    from a model built on the meta device (nothing allocated): ``[{"name", "shape", "init", "padding_idx"}]``.

    Tied weights appear once, under their first name (``model.embed_tokens.weight``; ``lm_head.weight`` is dropped, as
    `save_pretrained` drops it).

    Raises:
        ValueError: the model has persistent buffers (their values cannot be drawn) or a parameter of a module kind
            without an initialisation rule.
    """
    model = _meta_model(config, dtype)
    rules: dict[int, tuple[str, int | None]] = {}
    for _, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            rules[id(p)] = _init_rule(module, pname)
    out, seen = [], set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:  # a tied weight, written once
            continue
        seen.add(id(t))
        if id(t) not in rules:
            raise ValueError(
                f"{name!r} is a persistent buffer of {type(model).__name__}; write_random_checkpoint only draws "
                "parameters."
            )
        init, padding_idx = rules[id(t)]
        out.append({"name": name, "shape": tuple(t.shape), "init": init, "padding_idx": padding_idx})
    return out


def _shard(tensors: list[dict[str, Any]], max_shard_params: int) -> list[list[dict[str, Any]]]:
    """Consecutive tensors packed greedily into shards of at most ``max_shard_params`` parameters (a larger tensor
    gets a shard of its own), as `save_pretrained` packs by bytes."""
    shards: list[list[dict[str, Any]]] = [[]]
    size = 0
    for t in tensors:
        n = math.prod(t["shape"])
        if shards[-1] and size + n > max_shard_params:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def _write_tensor(f, t: dict[str, Any], dtype: torch.dtype, std: float, seed: int) -> None:
    """Draw tensor ``t`` block by block (`BLOCK_ELEMS` elements, from its own generator) and write its bytes."""
    n = math.prod(t["shape"])
    gen = torch.Generator().manual_seed(_tensor_seed(seed, t["name"]))
    pad = t["padding_idx"]
    row = t["shape"][-1] if t["shape"] else 1
    for start in range(0, n, BLOCK_ELEMS):
        stop = min(n, start + BLOCK_ELEMS)
        if t["init"] == "normal":
            block = torch.empty(stop - start, dtype=torch.float32).normal_(0.0, std, generator=gen).to(dtype)
            if pad is not None:  # the embedding's padding row is zero (HF's init)
                lo, hi = max(start, pad * row), min(stop, (pad + 1) * row)
                if lo < hi:
                    block[lo - start : hi - start] = 0
        elif t["init"] == "ones":
            block = torch.ones(stop - start, dtype=dtype)
        else:
            block = torch.zeros(stop - start, dtype=dtype)
        f.write(memoryview(block.view(torch.uint8).numpy()))


def write_random_checkpoint(
    config,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    max_shard_params: int = DEFAULT_MAX_SHARD_PARAMS,
) -> dict[str, Any]:
    """Write a HF safetensors checkpoint of a randomly initialised ``AutoModelForCausalLM.from_config(config)``
    without materialising the model.

    The names and shapes come from the model built on the meta device (`checkpoint_tensors`); each tensor is drawn
    with HF's initialisation (normal(0, ``config.initializer_range``) for Linear and Embedding weights, ones for norm
    weights, zeros for biases) from a generator seeded by ``seed`` and the tensor's name, and written to its shard
    `BLOCK_ELEMS` elements at a time, so peak memory is one block (a few MiB) for any model size, and the same
    ``seed`` gives bit-identical files. Files: ``config.json`` (``config.save_pretrained``, with ``dtype`` and
    ``architectures`` set), and ``model.safetensors`` when everything fits one shard, else
    ``model-0000k-of-0000N.safetensors`` shards with ``model.safetensors.index.json``, as `save_pretrained` names
    them. Safetensors layout: an 8-byte little-endian header length, the JSON header (``__metadata__`` format
    ``pt``; dtype, shape and byte offsets per tensor; padded with spaces to 8 bytes), then the tensors' bytes.

    Args:
        config: a transformers config of a Qwen2 or Qwen3 causal LM (any model made of Linear, Embedding and RMSNorm
            parameters).
        out_dir: the checkpoint directory (created; weight files already there are replaced).
        dtype: dtype of the stored tensors (``torch.bfloat16``, ``torch.float16`` or ``torch.float32``).
        seed: the run seed.
        max_shard_params: most parameters in one shard.

    Returns:
        ``{"files": [file names], "params": parameters written, "bytes": tensor bytes written}``.

    Raises:
        ValueError: an unsupported ``dtype``, or a model `checkpoint_tensors` cannot describe.
    """
    if dtype not in _ST_DTYPES:
        raise ValueError(f"dtype={dtype} is not supported; use torch.bfloat16, torch.float16 or torch.float32.")
    if max_shard_params < 1:
        raise ValueError(f"max_shard_params={max_shard_params} must be >= 1.")
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    for old in os.listdir(out_dir):
        if old.startswith("model") and (old.endswith(".safetensors") or old.endswith(".safetensors.index.json")):
            os.remove(os.path.join(out_dir, old))
    tensors = checkpoint_tensors(config, dtype)
    std = float(getattr(config, "initializer_range", None) or 0.02)
    shards = _shard(tensors, max_shard_params)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    itemsize = torch.empty((), dtype=dtype).element_size()
    weight_map: dict[str, str] = {}
    total_params = 0
    for fname, shard in zip(names, shards):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in shard:
            nbytes = math.prod(t["shape"]) * itemsize
            header[t["name"]] = {
                "dtype": _ST_DTYPES[dtype],
                "shape": list(t["shape"]),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            weight_map[t["name"]] = fname
            total_params += math.prod(t["shape"])
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        tmp = os.path.join(out_dir, fname + ".tmp")
        with open(tmp, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for t in shard:
                _write_tensor(f, t, dtype, std, seed)
        os.replace(tmp, os.path.join(out_dir, fname))
    if len(shards) > 1:
        index = {
            "metadata": {"total_parameters": total_params, "total_size": total_params * itemsize},
            "weight_map": weight_map,
        }
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.architectures = [type(_meta_model(config, dtype)).__name__]
    config.save_pretrained(out_dir)
    return {"files": names, "params": total_params, "bytes": total_params * itemsize}


def ensure_checkpoint(config, path: str, dtype: torch.dtype, seed: int = 0) -> tuple[dict[str, Any], float, bool]:
    """The checkpoint at ``path``, written by `write_random_checkpoint` unless a complete one of the same config,
    dtype and seed is already there. Returns ``(summary, seconds spent writing, reused)``."""
    key = {"config": config.to_diff_dict(), "dtype": str(dtype), "seed": seed, "block": BLOCK_ELEMS}
    marker = os.path.join(path, COMPLETE_FILE)
    if os.path.exists(marker):
        with open(marker) as f:
            done = json.load(f)
        if done.get("key") == json.loads(json.dumps(key, default=str)):
            return done["summary"], 0.0, True
        os.remove(marker)
    t0 = time.perf_counter()
    summary = write_random_checkpoint(config, path, dtype=dtype, seed=seed)
    seconds = time.perf_counter() - t0
    with open(marker, "w") as f:
        json.dump({"key": key, "summary": summary}, f, default=str)
    return summary, seconds, False


# ---------------------------------------------------------------------------------------------------------------------
# Sizes and machine
# ---------------------------------------------------------------------------------------------------------------------


def state_bytes(config) -> dict[str, int]:
    """Training-state bytes of the model (every parameter trainable, a bf16 compute copy of fp32 masters): fp32 master
    4 B, compute copy 2 B, fp32 gradient 4 B per parameter, and HybridAdamW8bit's moments as
    `lazytrain_hf.planner.hostmem.optimizer_state_bytes` counts them (1 B each per element plus one fp32 absmax per
    256-element block; fp32 moments under 4096 elements). Store alignment padding is not counted."""
    from lazytrain_hf.planner.hostmem import optimizer_state_bytes

    numels = [math.prod(t["shape"]) for t in checkpoint_tensors(config)]
    n = sum(numels)
    out = {"params": n, "master": 4 * n, "compute": 2 * n, "grad": 4 * n, "optimizer": optimizer_state_bytes(numels)}
    out["total"] = out["master"] + out["compute"] + out["grad"] + out["optimizer"]
    return out


def machine() -> dict[str, Any]:
    """Date, CPU model, cores, RAM and GPU of this machine (for a BENCHMARKS.md entry)."""
    info: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        info["cpu"] = fields.get("Model name", platform.processor()).strip()
        info["cpus"] = int(fields.get("CPU(s)", os.cpu_count() or 0))
    except (OSError, ValueError):
        info["cpu"], info["cpus"] = platform.processor(), os.cpu_count()
    info["usable_cpus"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info["ram_bytes"] = _meminfo("MemTotal")
    info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    info["torch"] = torch.__version__
    return info


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def proc_status(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` (bytes) of this process from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def disk_bytes(path: str) -> int:
    """Bytes allocated on disk by the files under ``path`` (``st_blocks``, so sparse files count what they use)."""
    total = 0
    for root, _, files in os.walk(path):
        for fn in files:
            try:
                total += os.stat(os.path.join(root, fn)).st_blocks * 512
            except FileNotFoundError:  # removed while walking
                pass
    return total


def gib(n: float) -> str:
    """Bytes as GiB (MiB under 1 GiB)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# ---------------------------------------------------------------------------------------------------------------------
# Training child
# ---------------------------------------------------------------------------------------------------------------------


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One training run in this (fresh) process, as ``spec`` says; returns what `RESULT_PREFIX` prints."""
    from datasets import Dataset
    from transformers import TrainerCallback

    import lazytrain_hf
    from lazytrain_hf import LazyTrainer, LazyTrainingArguments
    from lazytrain_hf.args import PLAN_FILE
    from lazytrain_hf.trainer import TRACE_FILE

    rss_start = proc_status("VmRSS")
    fp32 = spec["model_dtype"] == "float32"
    model = lazytrain_hf.from_pretrained(
        spec["checkpoint"], dtype=torch.float32 if fp32 else torch.bfloat16, use_cache=False
    )
    rss_loaded = proc_status("VmRSS")
    steps, ga, seq = spec["steps"], spec["ga"], spec["seq_len"]
    g = torch.Generator().manual_seed(spec["seed"])
    ids = torch.randint(0, model.config.vocab_size, (steps * ga, seq), generator=g).tolist()
    dataset = Dataset.from_list([{"input_ids": row, "labels": row} for row in ids])
    kw = dict(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=1,
        gradient_accumulation_steps=ga,
        max_steps=steps,
        learning_rate=spec["lr"],
        bf16=fp32,  # fp32 parameters: bf16=True computes with a bf16 copy; bf16 parameters compute in bf16 anyway
        seed=spec["seed"],
        data_seed=spec["seed"],
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        planner_warmup_steps=0,
        stream_embeddings=True,
    )
    if not torch.cuda.is_available():
        kw["use_cpu"] = True  # TrainingArguments refuses bf16 on a machine without a GPU otherwise
    kw.update(spec["lazy"])
    args = LazyTrainingArguments(**kw)

    class Clock(TrainerCallback):
        def __init__(self):
            self.begin: float | None = None
            self.ends: list[float] = []
            self.logged: list[float] = []
            self.state_files = 0  # largest bytes allocated under state_nvme_dir at a step end

        def on_train_begin(self, args, state, control, **kw):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())
            if args.state_nvme_dir:
                self.state_files = max(self.state_files, disk_bytes(args.state_nvme_dir))

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.logged.append(logs["loss"])

    class Recording(LazyTrainer):
        """Keeps every micro-batch's training loss as returned (the logged ones are averaged and rounded)."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.micro_losses: list[float] = []

        def training_step(self, *a, **kw):
            loss = super().training_step(*a, **kw)
            self.micro_losses.append(float(loss.detach().float().item()))
            return loss

    clock = Clock()
    trainer = Recording(model=model, args=args, train_dataset=dataset, callbacks=[clock])
    rss_before_train = proc_status("VmRSS")
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    peak = proc_status("VmHWM")
    if spec.get("save"):
        trainer.save_model(os.path.join(spec["output_dir"], "final"))
    marks = [clock.begin, *clock.ends]
    out: dict[str, Any] = {
        "peak_rss_bytes": peak,
        "rss_start_bytes": rss_start,
        "rss_loaded_bytes": rss_loaded,
        "rss_before_train_bytes": rss_before_train,
        "train_s": train_s,
        "step_s": [b - a for a, b in zip(marks, marks[1:])],
        "losses": clock.logged,
        "micro_losses_hex": [x.hex() for x in trainer.micro_losses],
        "state_files_bytes": clock.state_files,
        "device": str(args.device),
    }
    trace_path = os.path.join(spec["output_dir"], TRACE_FILE)
    if os.path.exists(trace_path):
        with open(trace_path) as f:
            out["trace_bytes"] = [s["bytes"] for s in json.load(f)["steps"]]
    plan_path = os.path.join(spec["output_dir"], PLAN_FILE)
    if os.path.exists(plan_path):
        with open(plan_path) as f:
            plan = json.load(f)
        out["predicted_bytes_per_step"] = plan.get("predicted", {}).get("bytes_per_step")
        out["plan"] = {
            "source": plan.get("source"),
            "hardware": plan.get("hardware"),
            "layers": len(plan["layers"]),
            "resident_layers": [i for i, lp in enumerate(plan["layers"]) if lp.get("resident")],
            "policies": sorted({lp.get("policy") for lp in plan["layers"]}),
            "state_nvme": plan.get("state_nvme", []),
        }
    return out


def run_child(spec: dict[str, Any], log_path: str) -> dict[str, Any]:
    """`child` in a fresh interpreter (its own peak RSS); its output goes to ``log_path`` and, on failure, the tail
    is printed. Raises RuntimeError when it fails."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    with open(log_path, "w") as f:
        f.write(proc.stdout + proc.stderr)
    results = [line[len(RESULT_PREFIX) :] for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not results:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"training run failed (exit {proc.returncode}; log {log_path}):\n{tail}")
    out = json.loads(results[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------------------------------------------------


def _header(mode: str, argv: list[str]) -> None:
    m = machine()
    print(f"# bench_state_nvme {mode}  {m['date']}")
    print(f"command: {' '.join(['python', 'benchmarks/bench_state_nvme.py', *argv])}")
    gpu = f", GPU {m['gpu']}" if m["gpu"] else ", no GPU"
    print(
        f"machine: {m['cpu']}, {m['cpus']} CPUs ({m['usable_cpus']} usable), RAM {gib(m['ram_bytes'])}{gpu}, "
        f"torch {m['torch']}, Python {platform.python_version()}"
    )


def _work_dir(args) -> str:
    if args.work:
        os.makedirs(args.work, exist_ok=True)
        return os.path.abspath(args.work)
    if not args.tiny:
        raise SystemExit("--work DIR is required without --tiny (the checkpoint is written there and reused).")
    return tempfile.mkdtemp(prefix="bench_state_nvme_")


def _checkpoint(config, path: str, dtype: torch.dtype) -> None:
    summary, seconds, reused = ensure_checkpoint(config, path, dtype)
    how = "reused" if reused else f"written in {seconds:.1f} s"
    print(
        f"checkpoint: {path} ({summary['params'] / 1e6:.1f}M parameters, {gib(summary['bytes'])}, "
        f"{len(summary['files'])} file(s), {str(dtype).removeprefix('torch.')}; {how})"
    )


def _fresh_dir(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def _lazy_args(args, policy: str | None, **kw) -> dict[str, Any]:
    out = dict(kw)
    if policy is not None:
        out["planner_policy"] = policy
    if args.hardware is not None:
        out["planner_hardware"] = args.hardware
    if args.gpu_budget is not None:
        out["planner_gpu_budget"] = args.gpu_budget
    if args.cpu:
        out["use_cpu"] = True  # also implied on a machine without CUDA
    if args.overlap:
        out["optim_overlap_forward"] = True  # the optimizer step (and its state I/O) overlaps the next forward
    return out


def headline(args, argv: list[str]) -> int:
    _header("--headline" + (" --tiny" if args.tiny else ""), argv)
    work = _work_dir(args)
    config = make_config(TINY_QWEN2 if args.tiny else QWEN25_3B)
    ckpt = os.path.join(work, "qwen2_tiny" if args.tiny else "qwen2.5-3b")
    _checkpoint(config, ckpt, torch.bfloat16)
    st = state_bytes(config)
    layers = args.state_nvme_layers or ("all" if args.tiny else "auto")
    budget = args.host_budget or (None if args.tiny else "6GiB")
    if args.tiny and args.gpu_budget is None:
        args.gpu_budget = TINY_GPU_BUDGET
    print(
        f"state: {gib(st['total'])} for {st['params'] / 1e6:.1f}M parameters (fp32 master {gib(st['master'])} + "
        f"bf16 compute {gib(st['compute'])} + fp32 grad {gib(st['grad'])} + 8-bit moments with absmax "
        f"{gib(st['optimizer'])}); state_nvme_layers={layers!r}, planner_host_budget={budget or 'default'}, "
        f"planner_gpu_budget={args.gpu_budget or 'default'}"
    )
    print(f"free disk in {work}: {gib(shutil.disk_usage(work).free)}")
    state_dir = _fresh_dir(os.path.join(work, "state"))
    out_dir = _fresh_dir(os.path.join(work, "out"))
    spec = {
        "checkpoint": ckpt,
        "output_dir": out_dir,
        "steps": args.steps or 3,
        "ga": args.ga,
        "seq_len": args.seq_len,
        "seed": 0,
        "lr": args.lr,
        "model_dtype": args.model_dtype,
        "lazy": _lazy_args(
            args,
            args.policy,
            state_nvme_dir=state_dir,
            state_nvme_layers=layers,
            **({"planner_host_budget": budget} if budget else {}),
        ),
    }
    res = run_child(spec, os.path.join(work, "headline.log"))
    print(
        f"device: {res['device']}; batch 1 x {args.seq_len} tokens, gradient_accumulation_steps {args.ga}; "
        f"{_precision(args)}"
    )
    print(
        f"peak RSS (VmHWM) {gib(res['peak_rss_bytes'])}; RSS at start {gib(res['rss_start_bytes'])}, after "
        f"from_pretrained {gib(res['rss_loaded_bytes'])}, before train {gib(res['rss_before_train_bytes'])}"
    )
    print(f"{'step':>4} {'wall s':>8} {'loss':>10}")
    for i, s in enumerate(res["step_s"]):
        loss = res["losses"][i] if i < len(res["losses"]) else float("nan")
        print(f"{i + 1:>4} {s:>8.2f} {loss:>10.4f}")
    later = res["step_s"][1:] or res["step_s"]
    print(
        f"step time median {statistics.median(res['step_s']):.2f} s (all steps), "
        f"{statistics.median(later):.2f} s (after the first); train() {res['train_s']:.1f} s"
    )
    _plan_line(res)
    print(
        f"state files on disk (largest at a step end): {gib(res['state_files_bytes'])} "
        f"({res['state_files_bytes'] / st['total']:.2f}x the whole state above)"
    )
    ok = _bytes_table(res)
    return 0 if ok else 1


def _precision(args) -> str:
    if args.model_dtype == "float32":
        return "model loaded in float32, bf16=True (bf16 compute copy, fp32 masters)"
    return "model loaded in bfloat16 (bf16 compute copy, fp32 masters in the store)"


def _plan_line(res: dict[str, Any]) -> None:
    plan = res.get("plan")
    if plan is None:
        print("plan: not found in output_dir")
        return
    L = plan["layers"]
    units = {-1: "embedding", L: "head"}
    on_nvme = ", ".join(units.get(k, str(k)) for k in plan["state_nvme"]) or "none"
    layers_nvme = sum(1 for k in plan["state_nvme"] if 0 <= k < L)
    print(
        f"plan ({plan['source']}, hardware {plan['hardware'] or '-'}): policies {plan['policies']}, "
        f"{len(plan['resident_layers'])} of {L} decoder layers resident on the device; state on NVMe: "
        f"{layers_nvme} of {L} decoder layers (units {on_nvme})"
    )


def _bytes_table(res: dict[str, Any]) -> bool:
    """Trace vs predicted bytes per step and lane; True when every lane of every traced step equals the prediction."""
    trace, pred = res.get("trace_bytes"), res.get("predicted_bytes_per_step")
    if not trace or not pred:
        print(f"trace or prediction missing (trace steps: {len(trace or [])}, prediction: {pred is not None})")
        return False
    lanes = ["nvme_read", "nvme_write", "h2d", "d2h"]
    print(f"{'step':>4} {'lane':<10} {'trace bytes':>16} {'predicted bytes':>16} {'ratio':>8}")
    ok = True
    for i, step in enumerate(trace):
        for lane in lanes:
            t, p = int(step.get(lane, 0)), int(pred.get(lane, 0))
            ratio = f"{t / p:.4f}" if p else ("1.0000" if t == 0 else "inf")
            ok &= t == p
            print(f"{i + 1:>4} {lane:<10} {t:>16,} {p:>16,} {ratio:>8}")
    print("trace == prediction on every lane of every traced step: " + ("yes" if ok else "NO"))
    return ok


def _weight_keys(d: str) -> dict[str, str]:
    """Tensor name -> safetensors file of a saved model directory."""
    from safetensors import safe_open

    out = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(d, fn), framework="pt") as f:
                out.update({k: os.path.join(d, fn) for k in f.keys()})
    return out


def _compare_weights(a_dir: str, b_dir: str) -> list[str]:
    """Names of the tensors that differ (bits, dtype or shape) between two saved models, or are only in one."""
    from safetensors import safe_open

    ka, kb = _weight_keys(a_dir), _weight_keys(b_dir)
    bad = sorted(set(ka) ^ set(kb))
    for k in sorted(set(ka) & set(kb)):
        with safe_open(ka[k], framework="pt") as fa, safe_open(kb[k], framework="pt") as fb:
            x, y = fa.get_tensor(k), fb.get_tensor(k)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            bad.append(k)
    if not ka:
        bad.append(f"<no weights in {a_dir}>")
    return bad


def _trained(initial_dir: str, final_dir: str) -> tuple[int, int, set[str]]:
    """``(tensors whose values changed from the initial checkpoint, tensors compared, dtypes saved)``: the
    comparison of two trained models means something only if training moved the weights."""
    from safetensors import safe_open

    ki, kf = _weight_keys(initial_dir), _weight_keys(final_dir)
    changed, dtypes = 0, set()
    for k in sorted(set(ki) & set(kf)):
        with safe_open(ki[k], framework="pt") as fi, safe_open(kf[k], framework="pt") as ff:
            x, y = fi.get_tensor(k), ff.get_tensor(k)
        dtypes.add(str(y.dtype).removeprefix("torch."))
        changed += not torch.equal(x.float(), y.float())
    return changed, len(set(ki) & set(kf)), dtypes


def bitexact(args, argv: list[str]) -> int:
    _header("--bitexact" + (" --tiny" if args.tiny else ""), argv)
    work = _work_dir(args)
    config = make_config(TINY_QWEN3 if args.tiny else QWEN3_300M)
    ckpt = os.path.join(work, "qwen3_tiny" if args.tiny else "qwen3-300m")
    _checkpoint(config, ckpt, torch.bfloat16)
    steps = args.steps or 4
    print(f"{_precision(args)}; learning rate {args.lr}")
    print(
        f"{steps} steps, gradient_accumulation_steps {args.ga}, batch 1 x {args.seq_len}; free disk {gib(shutil.disk_usage(work).free)}"
    )
    runs: dict[str, dict[str, Any]] = {}
    for name in ("ram", "nvme"):
        root = _fresh_dir(os.path.join(work, f"bitexact_{name}"))
        lazy = _lazy_args(args, args.policy or "default")
        if args.host_budget:
            lazy["planner_host_budget"] = args.host_budget
        if name == "nvme":
            lazy.update(state_nvme_dir=_fresh_dir(os.path.join(root, "state")), state_nvme_layers="all")
        spec = {
            "checkpoint": ckpt,
            "output_dir": os.path.join(root, "out"),
            "steps": steps,
            "ga": args.ga,
            "seq_len": args.seq_len,
            "seed": 0,
            "lr": args.lr,
            "model_dtype": args.model_dtype,
            "save": True,
            "lazy": lazy,
        }
        runs[name] = run_child(spec, os.path.join(root, "train.log"))
        r = runs[name]
        print(
            f"state in {'RAM' if name == 'ram' else 'NVMe':<4}: train() {r['train_s']:.1f} s, step median {statistics.median(r['step_s']):.2f} s, "
            f"peak RSS {gib(r['peak_rss_bytes'])}, device {r['device']}"
        )
    ram, nvme = runs["ram"], runs["nvme"]
    _plan_line(nvme)
    print(f"state files on disk (largest at a step end): {gib(nvme['state_files_bytes'])}")
    print(
        "per micro-batch, the loss training_step returns (divided by gradient_accumulation_steps), float64 of the fp32:"
    )
    print(f"{'micro-batch':>11} {'state in RAM':>24} {'state on NVMe':>24} {'equal':>6}")
    n = max(len(ram["micro_losses_hex"]), len(nvme["micro_losses_hex"]))
    losses_equal = len(ram["micro_losses_hex"]) == len(nvme["micro_losses_hex"]) > 0
    for i in range(n):
        a = ram["micro_losses_hex"][i] if i < len(ram["micro_losses_hex"]) else None
        b = nvme["micro_losses_hex"][i] if i < len(nvme["micro_losses_hex"]) else None
        losses_equal &= a == b
        fa = float.fromhex(a) if a else float("nan")
        fb = float.fromhex(b) if b else float("nan")
        print(f"{i + 1:>11} {fa:>24.17g} {fb:>24.17g} {'yes' if a == b else 'NO':>6}")
    print(f"logged losses: RAM {ram['losses']}, NVMe {nvme['losses']}")
    bad = _compare_weights(
        os.path.join(work, "bitexact_ram", "out", "final"), os.path.join(work, "bitexact_nvme", "out", "final")
    )
    changed, compared, dtypes = _trained(ckpt, os.path.join(work, "bitexact_ram", "out", "final"))
    print(
        f"training moved {changed} of {compared} tensors from the initial checkpoint (final weights saved as "
        f"{', '.join(sorted(dtypes))})"
    )
    print(f"losses bit-identical: {'yes' if losses_equal else 'NO'}")
    print(
        "final weights bit-identical: " + ("yes" if not bad else f"NO ({len(bad)} tensors differ, first: {bad[:5]})")
    )
    if nvme.get("trace_bytes"):
        print("state-on-NVMe run, bytes per traced step:")
        _bytes_table(nvme)
    return 0 if losses_equal and not bad else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--headline", action="store_true", help="Qwen2.5-3B-shaped run with the state on NVMe.")
    mode.add_argument("--bitexact", action="store_true", help="state in RAM vs on NVMe, bit for bit.")
    mode.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help="a ~6M-parameter model of the same family instead.")
    ap.add_argument("--work", help="directory for the checkpoint (reused), the state files and the outputs.")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 3 headline, 4 bitexact).")
    ap.add_argument("--ga", type=int, default=1, help="gradient_accumulation_steps.")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--host-budget", default=None, help="planner_host_budget (headline default 6GiB).")
    ap.add_argument("--hardware", default=None, help="planner_hardware (default: the arguments' default).")
    ap.add_argument(
        "--policy",
        default=None,
        help="planner_policy (default: the arguments' default for --headline; 'default', every layer streamed with "
        "the same fixed plan in both runs, for --bitexact).",
    )
    ap.add_argument("--gpu-budget", default=None, help="planner_gpu_budget (default: the arguments' default).")
    ap.add_argument(
        "--state-nvme-layers",
        choices=["auto", "all"],
        default=None,
        help="--headline's state_nvme_layers (default: auto; all with --tiny).",
    )
    ap.add_argument(
        "--model-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="dtype from_pretrained loads the model in: float32 with bf16=True (bf16 compute copy, fp32 masters, "
        "save_model writes the masters) or bfloat16 (bf16 parameters, fp32 masters in the store, save_model writes "
        "the bf16 weights).",
    )
    ap.add_argument("--cpu", action="store_true", help="train on the CPU even when CUDA is available.")
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="optim_overlap_forward=True (default on the CPU: off, as LazyTrainer's).",
    )
    args = ap.parse_args(argv)
    if args.child:
        print(RESULT_PREFIX + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    return headline(args, argv) if args.headline else bitexact(args, argv)


if __name__ == "__main__":
    sys.exit(main())
