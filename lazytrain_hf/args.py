"""`LazyTrainingArguments`: `TrainingArguments` plus the LazyTrain groups (stream_*, planner_*, activation_*, optim_*)."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import sys
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from .activations.nvme import check_dir as check_nvme_dir
from .planner.baselines import BASELINES
from .planner.plan import DP_REDUCE, DP_REDUCE_EVERY, INPUT_TIERS
from .training.arg_upgrades import maintained_upgrade
from .training.plan_files import PLAN_FILE  # re-exported: the plan next to a checkpoint (also in output_dir)
from .units import parse_bytes

STATE_NVME_LAYERS = ("auto", "all")  # state_nvme_layers

PLANNER_POLICIES = ("milp", *BASELINES, "default")  # a baseline name plans with `baselines.make_baseline`
SOLVERS = ("auto", "cbc", "highs")
DP_REDUCE_CHOICES = ("auto", *DP_REDUCE)  # planner_dp_reduce
DP_REDUCE_EVERY_CHOICES = ("auto", *DP_REDUCE_EVERY)  # planner_dp_reduce_every


@dataclass
class LazyTrainingArguments(TrainingArguments):
    r"""
    Configuration for `LazyTrainer`. All `TrainingArguments` fields work as usual; the fields below are added.

    > Streaming (`lazytrain_hf.streaming`)

    stream_enabled (`bool`, defaults to `True`): keep parameters, gradients and optimizer states in host memory and
        stream each decoder layer to the device just in time. `False` gives plain `Trainer` behaviour.
    stream_prefetch_depth (`int`, defaults to `1`): layers fetched ahead when no plan decides it.
    stream_embeddings (`bool`, defaults to `False`): stream embeddings / final norm / lm_head too (else resident).
    stream_loss_chunk_tokens (`int`, defaults to `1024`): tokens per chunk of the chunked loss.
    stream_trace_steps (`int`, defaults to `3`): optimizer steps of the executor's trace written to
        ``output_dir/lazytrain_trace.json`` (bytes per lane, transfers, compute spans, updates, host syncs).

    > Planner (`lazytrain_hf.planner`)

    planner_policy (`str`, defaults to `"milp"`): `"milp"` solves the plan; a baseline name (`"megatrain"`,
        `"megatrain_plus"`, `"slideformer"`, `"keep_all"`, `"all_recompute"`, `"cpu_offload_inputs"`) or `"default"`
        uses that fixed plan.
    planner_hardware (`str`, defaults to `"auto"`): bundled profile name (`h800`, `h200`, `a100-80g`, `rtx3090`,
        `rtx4090`, `h100`, `cpu`), a path to a measured profile JSON, or `"auto"` (measure this machine).
    planner_gpu_budget (`int` or `str`, *optional*): device memory the plan may use, e.g. `"70GiB"`; default: the
        profile's device memory minus a 10% reserve.
    planner_host_budget (`int` or `str`, *optional*): the whole host footprint the run may use (fp32 masters,
        compute copy, gradients, optimizer state, pinned activation buffers, gradient staging, checkpoint-save
        transient), checked before anything is allocated; default: available RAM minus a reserve (5% of RAM, at
        least 1 GiB). The planner gives offloaded activations what the state leaves of it.
    planner_time_limit (`float`, defaults to `30`): MILP solver time limit in seconds.
    planner_mip_gap (`float`, defaults to `0.01`): relative optimality gap at which the solver stops.
    planner_solver (`str`, defaults to `"auto"`): `"cbc"`, `"highs"` or `"auto"` (HiGHS when installed).
    planner_auto_batch_size (`bool`, defaults to `False`): search the micro-batch size with the highest tokens/s
        that fits, and train with it (overrides `per_device_train_batch_size`).
    planner_max_batch_size (`int`, defaults to `256`): upper end of that search.
    planner_warmup_steps (`int`, defaults to `2`): timed warm-up steps that measure per-layer costs before solving.
    planner_dp_reduce (`str`, defaults to `"auto"`): data parallel only: where each streamed unit's gradient is
        reduced to the rank that owns its training state: `"host"` (every rank copies it D2H, gloo
        sums the fp32 copies), `"device"` (summed on the devices, NCCL on CUDA, before the D2H copy only the owner
        makes) or `"auto"` (what the plan says; the planner picks the shorter simulated step).
    planner_dp_reduce_every (`str`, defaults to `"auto"`): data parallel with gradient accumulation only: how often
        that reduce runs: `"micro_batch"` (every micro-batch), `"step"` (each rank accumulates every unit's gradient in
        its own fp32 host accumulator and reduces it once per optimizer step: 1/g of the network bytes for an fp32
        accumulator per unit it does not own; host reduce only) or `"auto"` (the planner picks by simulated step
        within the host memory; `"micro_batch"` without gradient accumulation).
    planner_plan (`str`, *optional*): a Plan JSON file (as `lazytrain plan --save` writes it, or a checkpoint's
        `lazytrain_plan.json`; a checkpoint directory works too) that `train()` executes as is: no hardware profile,
        warm-up or solve. It must match the model (layer count and kinds) and `per_device_train_batch_size`; its
        `optimizer_overlap` is honoured on any device unless `optim_overlap_forward` is set.

    > Activations (`lazytrain_hf.activations`)

    activation_tiers (`list[str]`, defaults to `["gpu", "cpu"]`): where saved activations may live: `gpu` (keep),
        `cpu` (pinned host), `nvme` (spill files). Recomputation is always allowed, its input on one of these tiers;
        without `gpu` the last layer, whose backward follows its forward directly, is recomputed from its input left
        on the device (a spill could not be read back in time).
    activation_nvme_dir (`str`, *optional*): an existing, writable directory for NVMe spill files; required when
        `nvme` is a tier.
    state_nvme_dir (`str`, *optional*): an existing, writable directory on a fast local disk for the training state
        of streamed layers that do not fit `planner_host_budget` (fp32 master, compute copy, gradient accumulator
        and 8-bit moments per layer, `lazytrain_hf.streaming.nvmestate`). Without it a state larger than the budget
        is refused before anything is allocated.
    state_nvme_layers (`str`, defaults to `"auto"`): which streamed units keep their state in `state_nvme_dir`:
        `auto` (the fewest, chosen by the planner, that bring the host footprint within `planner_host_budget`) or
        `all` (every streamed unit; for comparisons and tests).

    > Optimizer (`lazytrain_hf.optim`)

    optim_hybrid_8bit (`bool`, *optional*): use `HybridAdamW8bit` (CPU AdamW, block-wise 8-bit moments, fused
        clipping). Default: on when streaming is on.
    optim_block_size (`int`, defaults to `256`): elements per 8-bit quantisation block.
    optim_min_8bit_size (`int`, defaults to `4096`): tensors with fewer elements keep fp32 moments.
    optim_overlap_forward (`bool`, *optional*): update layers on a background thread while the next forward runs
        (layer i is fetched as soon as it is updated). Default: on with CUDA when the plan allows it.

    Changed `TrainingArguments` defaults: none. `max_grad_norm` is honoured through fused clipping when streaming.
    With streaming (or `optim_hybrid_8bit=True`) the optimizer is `HybridAdamW8bit` (`learning_rate`, `weight_decay`,
    `adam_beta1`, `adam_beta2`, `adam_epsilon` apply), so `optim` must stay at its default; `fp16` is refused
    (use `bf16`).

    Any `TrainingArguments` subclass (e.g. `Seq2SeqTrainingArguments`) is upgraded by `from_training_arguments` to
    a class deriving from both, keeping its own fields.
    """

    # ----------------------------------------------------------------- streaming
    stream_enabled: bool = field(
        default=True, metadata={"help": "Stream decoder layers from host memory (False: plain Trainer behaviour)."}
    )
    stream_prefetch_depth: int = field(default=1, metadata={"help": "Layers fetched ahead when no plan decides."})
    stream_embeddings: bool = field(
        default=False, metadata={"help": "Stream embeddings, final norm and lm_head instead of keeping them resident."}
    )
    stream_loss_chunk_tokens: int = field(default=1024, metadata={"help": "Tokens per chunk of the chunked loss."})
    stream_trace_steps: int = field(
        default=3,
        metadata={
            "help": "Optimizer steps of the executor's trace (every transfer, compute span, update and host sync) "
            "written to output_dir/lazytrain_trace.json; 0 writes none."
        },
    )

    # ----------------------------------------------------------------- planner
    planner_policy: str = field(
        default="milp", metadata={"help": f"How the plan is made: one of {', '.join(PLANNER_POLICIES)}."}
    )
    planner_hardware: str = field(
        default="auto",
        metadata={
            "help": "Hardware profile: bundled name (h800, h100, h200, a100-80g, rtx3090, rtx4090, cpu), JSON path, "
            "or 'auto' to measure this machine."
        },
    )
    planner_gpu_budget: int | str | None = field(
        default=None,
        metadata={
            "help": "Device memory the plan may use, e.g. '70GiB' (default: the profile's memory minus a 10 percent reserve)."
        },
    )
    planner_host_budget: int | str | None = field(
        default=None,
        metadata={
            "help": "Whole host footprint the run may use (fp32 masters, compute copy, gradients, optimizer state, "
            "pinned activation buffers, gradient staging, checkpoint-save transient), e.g. '64GiB'; default: "
            "available RAM minus a reserve (5 percent of RAM, at least 1 GiB)."
        },
    )
    planner_time_limit: float = field(default=30.0, metadata={"help": "MILP solver time limit in seconds."})
    planner_mip_gap: float = field(default=0.01, metadata={"help": "Relative MIP gap at which the solver stops."})
    planner_solver: str = field(default="auto", metadata={"help": "MILP solver: auto, cbc or highs."})
    planner_auto_batch_size: bool = field(
        default=False, metadata={"help": "Pick the micro-batch size with the best predicted tokens/s that fits."}
    )
    planner_max_batch_size: int = field(default=256, metadata={"help": "Largest micro-batch size searched."})
    planner_warmup_steps: int = field(
        default=2, metadata={"help": "Timed warm-up steps measuring per-layer costs before the plan is solved."}
    )
    planner_plan: str | None = field(
        default=None,
        metadata={
            "help": "Plan JSON to execute as is (from `lazytrain plan --save` or a checkpoint's lazytrain_plan.json): "
            "no profile, warm-up or solve."
        },
    )

    # ----------------------------------------------------------------- activations
    activation_tiers: list[str] = field(
        default_factory=lambda: ["gpu", "cpu"],
        metadata={"help": "Tiers saved activations may use: gpu, cpu, nvme (recompute is always allowed)."},
    )
    activation_nvme_dir: str | None = field(
        default=None,
        metadata={"help": "Existing, writable directory for NVMe activation spill files (needed for the nvme tier)."},
    )
    state_nvme_dir: str | None = field(
        default=None,
        metadata={
            "help": "Existing, writable directory for the training state of streamed layers that do not fit "
            "planner_host_budget (masters, compute copy, gradients, 8-bit moments on NVMe)."
        },
    )
    state_nvme_layers: str = field(
        default="auto",
        metadata={"help": "Streamed units whose state lives in state_nvme_dir: auto (what the budget needs) or all."},
    )

    # ----------------------------------------------------------------- optimizer
    optim_hybrid_8bit: bool | None = field(
        default=None, metadata={"help": "Use HybridAdamW8bit (default: on when streaming is on)."}
    )
    optim_block_size: int = field(default=256, metadata={"help": "Elements per 8-bit quantisation block."})
    optim_min_8bit_size: int = field(default=4096, metadata={"help": "Tensors smaller than this keep fp32 moments."})
    optim_overlap_forward: bool | None = field(
        default=None,
        metadata={
            "help": "Run the layer-wise optimizer step on a background thread overlapping the next forward "
            "(default: on with CUDA when the plan allows it)."
        },
    )
    planner_dp_reduce: str = field(
        default="auto",
        metadata={
            "help": "Data parallel: where each unit's gradient is reduced to its owner: 'host' (gloo on host copies), "
            "'device' (NCCL before the D2H copy) or 'auto' (the plan decides)."
        },
    )
    planner_dp_reduce_every: str = field(
        default="auto",
        metadata={
            "help": "Data parallel with gradient accumulation: reduce each unit's gradient to its owner every "
            "'micro_batch', once per 'step' (accumulated on each rank first), or 'auto' (the plan decides)."
        },
    )

    def __post_init__(self):
        # before TrainingArguments sets up the frameworks some of them name (DeepSpeed, FSDP), which never run here
        _refuse_while_streaming(self)
        super().__post_init__()
        # ---- types: HfArgumentParser converts the command line, Python callers can pass anything
        self._check_types()
        # ---- cross-field checks: each error names the option, the value and the fix
        if self.stream_prefetch_depth < 0:
            raise ValueError(f"stream_prefetch_depth={self.stream_prefetch_depth} must be >= 0 (1 is a good default).")
        if self.stream_loss_chunk_tokens < 1:
            raise ValueError(f"stream_loss_chunk_tokens={self.stream_loss_chunk_tokens} must be >= 1 (e.g. 1024).")
        if self.stream_trace_steps < 0:
            raise ValueError(
                f"stream_trace_steps={self.stream_trace_steps} must be >= 0 (0: no lazytrain_trace.json)."
            )
        if self.planner_policy not in PLANNER_POLICIES:
            raise ValueError(
                f"planner_policy={self.planner_policy!r} is not supported; use one of {', '.join(PLANNER_POLICIES)}."
            )
        if self.planner_solver not in SOLVERS:
            raise ValueError(f"planner_solver={self.planner_solver!r} is not supported; use one of {SOLVERS}.")
        if not self.planner_hardware:
            raise ValueError("planner_hardware='' is empty; pass a profile name, a JSON path or 'auto'.")
        check_hardware(self.planner_hardware)
        self.planner_gpu_budget = parse_bytes(self.planner_gpu_budget, "planner_gpu_budget")
        self.planner_host_budget = parse_bytes(self.planner_host_budget, "planner_host_budget")
        if self.planner_time_limit <= 0:
            raise ValueError(f"planner_time_limit={self.planner_time_limit} must be > 0 seconds (e.g. 30).")
        if not 0 <= self.planner_mip_gap < 1:
            raise ValueError(f"planner_mip_gap={self.planner_mip_gap} must be in [0, 1) (e.g. 0.01).")
        if self.planner_max_batch_size < 1:
            raise ValueError(f"planner_max_batch_size={self.planner_max_batch_size} must be >= 1.")
        if self.planner_warmup_steps < 0:
            raise ValueError(f"planner_warmup_steps={self.planner_warmup_steps} must be >= 0.")
        if self.planner_plan is not None:
            self.planner_plan = resolve_plan_path(self.planner_plan)
        if self.planner_dp_reduce not in DP_REDUCE_CHOICES:
            raise ValueError(
                f"planner_dp_reduce={self.planner_dp_reduce!r} is not one of {', '.join(DP_REDUCE_CHOICES)}; pass "
                "'auto' to let the plan decide, 'host' to reduce the gradients on the host, 'device' on the devices."
            )
        if self.planner_dp_reduce_every not in DP_REDUCE_EVERY_CHOICES:
            raise ValueError(
                f"planner_dp_reduce_every={self.planner_dp_reduce_every!r} is not one of "
                f"{', '.join(DP_REDUCE_EVERY_CHOICES)}; pass 'auto' to let the plan decide, 'micro_batch' to reduce "
                "the gradients every micro-batch, 'step' once per optimizer step."
            )
        if self.planner_dp_reduce_every == "step" and self.planner_dp_reduce == "device":
            raise ValueError(
                "planner_dp_reduce_every='step' with planner_dp_reduce='device': gradients reduced once per step are "
                "accumulated on the host; pass planner_dp_reduce='host' (or 'auto'), or planner_dp_reduce_every="
                "'micro_batch'."
            )

        # "gpu,cpu", ["gpu,cpu"] and ["gpu", "cpu"] all mean the same (the command line gives the middle form)
        if not isinstance(self.activation_tiers, str | list | tuple):
            raise ValueError(
                f"activation_tiers={self.activation_tiers!r} must be a list of tiers, e.g. activation_tiers=['gpu', "
                "'cpu'] (or the string 'gpu,cpu')."
            )
        tiers = [self.activation_tiers] if isinstance(self.activation_tiers, str) else list(self.activation_tiers)
        self.activation_tiers = [t.strip() for item in tiers for t in str(item).split(",") if t.strip()]
        bad = [t for t in self.activation_tiers if t not in INPUT_TIERS]
        if not self.activation_tiers:
            raise ValueError(
                f"activation_tiers={tiers!r} names no tier; pass at least one of {', '.join(INPUT_TIERS)} (the "
                "default is ['gpu', 'cpu'])."
            )
        if bad:
            raise ValueError(
                f"activation_tiers={self.activation_tiers!r}: unknown tier {bad[0]!r}; allowed tiers are "
                f"{', '.join(INPUT_TIERS)} (recompute is always allowed)."
            )
        if "nvme" in self.activation_tiers and not self.activation_nvme_dir:
            raise ValueError(
                "activation_tiers includes 'nvme' but activation_nvme_dir is not set; pass "
                "activation_nvme_dir=/path/on/nvme or drop 'nvme' from activation_tiers."
            )
        if self.activation_nvme_dir is not None:
            self.activation_nvme_dir = check_nvme_dir(self.activation_nvme_dir)
        if self.state_nvme_layers not in STATE_NVME_LAYERS:
            raise ValueError(
                f"state_nvme_layers={self.state_nvme_layers!r} is not one of {STATE_NVME_LAYERS}: 'auto' keeps on "
                "NVMe what planner_host_budget needs, 'all' every streamed unit."
            )
        if self.state_nvme_dir is not None:
            self.state_nvme_dir = check_nvme_dir(self.state_nvme_dir, "state_nvme_dir")
            if not self.stream_enabled:
                raise ValueError(
                    "state_nvme_dir is set but stream_enabled=False: only the streaming executor keeps training state "
                    "on NVMe; set stream_enabled=True or drop state_nvme_dir."
                )
        elif self.state_nvme_layers == "all":
            raise ValueError(
                "state_nvme_layers='all' needs state_nvme_dir: pass state_nvme_dir=/path/on/nvme, or leave "
                "state_nvme_layers='auto'."
            )

        # the optimizer's own limits (HybridAdamW8bit checks the same), so a bad value fails here, not at step 1
        if not 16 <= self.optim_block_size <= 4096 or self.optim_block_size & (self.optim_block_size - 1):
            raise ValueError(
                f"optim_block_size={self.optim_block_size} must be a power of two in [16, 4096] (256 is the usual "
                "choice)."
            )
        if self.optim_min_8bit_size < 1:
            raise ValueError(f"optim_min_8bit_size={self.optim_min_8bit_size} must be >= 1 (4096 by default).")
        if self.stream_enabled and self.optim_hybrid_8bit is False:
            raise ValueError(
                "optim_hybrid_8bit=False with stream_enabled=True: the streamed model is updated layer by layer by "
                "HybridAdamW8bit over the host fp32 masters; leave optim_hybrid_8bit on, or set stream_enabled=False "
                "to train with another optimizer."
            )
        hybrid = self.stream_enabled if self.optim_hybrid_8bit is None else self.optim_hybrid_8bit
        default_optim = _value_of(_field_default(type(self), "optim"))
        if hybrid and _value_of(self.optim) != default_optim:
            cause, off = (
                ("stream_enabled=True", "set stream_enabled=False")
                if self.stream_enabled
                else ("optim_hybrid_8bit=True", "leave optim_hybrid_8bit unset")
            )
            raise ValueError(
                f"optim={_value_of(self.optim)!r} with {cause}: the model is updated by HybridAdamW8bit (tuned by "
                "optim_block_size, optim_min_8bit_size and optim_overlap_forward; learning_rate, weight_decay, "
                f"adam_beta1, adam_beta2 and adam_epsilon apply), which would silently replace it; leave optim at "
                f"its default ({default_optim!r}), or {off} to train with optim={_value_of(self.optim)!r}."
            )
        if self.stream_enabled and (
            getattr(self, "activation_checkpointing", False) or getattr(self, "gradient_checkpointing", False)
        ):
            raise ValueError(
                "gradient_checkpointing=True (activation_checkpointing) with stream_enabled=True: HF checkpointing "
                "re-enters the decoder layers in backward, which the executor cannot stream; the plan recomputes "
                "activations instead (planner_policy='milp' chooses per layer, 'all_recompute' recomputes every "
                "layer). Leave it off, or set stream_enabled=False."
            )
        if self.stream_enabled and self.torch_compile:
            raise ValueError(
                "torch_compile=True with stream_enabled=True: the executor binds each decoder layer's weights into "
                "device slots through module hooks between calls, which a compiled graph would bake in or break on, "
                "so the model would not be compiled as asked. Set torch_compile=False (and leave "
                "torch_compile_backend / torch_compile_mode unset), or stream_enabled=False to compile the plain model."
            )
        if self.stream_enabled and self.fp16:
            raise ValueError(
                "fp16=True with stream_enabled=True: streaming has no fp16 loss scaling (the grad scaler fails at "
                "the first step); use bf16=True for mixed precision (supported), or set stream_enabled=False to "
                "train in fp16 with the plain Trainer."
            )

        # ---- derived defaults
        if self.optim_hybrid_8bit is None:
            self.optim_hybrid_8bit = bool(self.stream_enabled)

    def _check_types(self) -> None:
        """Refuse a LazyTrain number or flag of the wrong type (a bool is not an int here), and normalise numbers
        to the annotated type (``planner_time_limit=5`` -> ``5.0``, a numpy integer -> int)."""
        for name, (kinds, default) in _typed_fields().items():
            value = getattr(self, name)
            if value is None and type(None) in kinds:
                continue
            optional = " or None (the default)" if type(None) in kinds else ""
            example = default if default is not None else True
            if bool in kinds:
                ok, what = isinstance(value, bool), f"a bool (True or False){optional}"
            elif int in kinds:
                ok, what = isinstance(value, numbers.Integral) and not isinstance(value, bool), f"an int{optional}"
                value = int(value) if ok else value
            else:
                ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
                what = f"a finite number{optional}"
                value = float(value) if ok else value
            if not ok:
                raise ValueError(f"{name}={value!r} must be {what}; pass e.g. {name}={example!r}.")
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        """Only reached for a missing attribute. TRL's trainers other than SFT (`DPOTrainer`, `RewardTrainer`,
        `GRPOTrainer`, ...) read their own config's fields before `Trainer.__init__` could refuse these arguments
        (Note: [LazyTrainingArguments need LazyTrainer]): such a read gets an error that says so, still an
        `AttributeError` (``hasattr`` keeps working)."""
        frame = sys._getframe(1)
        if not name.startswith("_") and frame.f_globals.get("__name__", "").startswith("trl."):
            owner = type(frame.f_locals.get("self", None)).__name__
            raise AttributeError(
                f"{owner} read args.{name}, which {type(self).__name__} does not have: TRL's {owner} needs its own "
                "config and is not supported by LazyTrain's streaming path (its loss is not the causal-LM loss the "
                "executor computes). Supported: lazytrain_hf.LazyTrainer (transformers.Trainer) and "
                f"lazytrain_hf.LazySFTTrainer (trl.SFTTrainer). Train {owner} with its own TRL config (the model "
                "in memory, stream_enabled=False)."
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def get_process_log_level(self) -> int:
        """Note: [LazyTrainingArguments need LazyTrainer]
        `transformers.Trainer.__init__` asks its arguments for the log level first thing, which is the one point
        where the arguments see which trainer uses them. Streaming (the plan, the hooks, HybridAdamW8bit over the host
        masters) lives in `LazyTrainer`'s overrides, which no argument can install into another Trainer, so a plain
        `Trainer` (or an `SFTTrainer`) given ``stream_enabled=True`` is refused here rather than training a plain
        model while the arguments say it streams."""
        _refuse_foreign_trainer(self)
        return super().get_process_log_level()

    def __getstate__(self) -> dict:
        """Pickled without the hub token: Trainer writes `torch.save(args)` as `training_args.bin` into every
        checkpoint and into the folder `push_to_hub` uploads."""
        state = self.__dict__.copy()
        if state.get("hub_token"):
            state["hub_token"] = None
        return state

    @classmethod
    def from_training_arguments(cls, args: TrainingArguments, **overrides) -> LazyTrainingArguments:
        """Upgrade any `TrainingArguments` (every field it set is kept) to `LazyTrainingArguments`.

        A plain `TrainingArguments` becomes ``cls``; an object of another subclass (`Seq2SeqTrainingArguments`,
        trl's `SFTConfig`, ...) becomes an object of a dataclass deriving from both its class and ``cls`` (made
        once per class, see `upgraded_class`; trl's `SFTConfig` becomes `lazytrain_hf.LazySFTConfig`), so its own
        fields and checks are kept and ``isinstance`` holds for both. ``overrides`` set fields on the way (e.g.
        ``stream_enabled=False``). HF activation checkpointing, which a config made for plain training may have on
        (SFTConfig does by default), is turned off with a warning when the result streams: the plan recomputes.
        """
        if isinstance(args, cls) and not overrides:
            return args
        target = upgraded_class(type(args), cls)
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init and hasattr(args, f.name)}
        # TrainingArguments.__post_init__ rewrites some fields (enums, derived paths); re-run it from the originals.
        values.update(overrides)
        streams = values.get("stream_enabled", _field_default(target, "stream_enabled"))
        _refuse_unsupported_trl_config(type(args), streams)
        checkpointing = [k for k in ("activation_checkpointing", "gradient_checkpointing") if values.get(k)]
        if streams and checkpointing and not any(k in overrides for k in checkpointing):
            warnings.warn(
                f"{type(args).__name__} had {checkpointing[0]}=True: turned off for streaming, which recomputes "
                "activations by plan policy (planner_policy) instead.",
                stacklevel=2,
            )
            values.update({k: None if k == "activation_checkpointing" else False for k in checkpointing})
        return target(**_originals(args, values))


# Note: [TrainingArguments a streamed run refuses]
# TrainingArguments fields that Trainer would honour by changing the model or its placement in ways the executor
# cannot follow: each refused at construction while streaming, naming the option, the value and the fix, instead of
# being ignored (the Trainer contract, tests/test_trainer_contract.py). field -> (why, what to do instead).
STREAMING_REFUSED = {
    "bf16_full_eval": (
        "Trainer casts the whole model to bf16 on the device for evaluation, while the streamed model lives in the "
        "host store and is moved by the executor",
        "use bf16=True instead (evaluation then streams the bf16 compute copy training uses)",
    ),
    "fp16_full_eval": (
        "Trainer casts the whole model to fp16 on the device for evaluation, while the streamed model lives in the "
        "host store and is moved by the executor",
        "use bf16=True instead (evaluation then streams the bf16 compute copy training uses)",
    ),
    "optim_args": (
        "they configure the optimizer `optim` names, while the streamed model is updated by HybridAdamW8bit",
        "tune it with learning_rate, weight_decay, adam_beta1, adam_beta2, adam_epsilon and the optim_* fields",
    ),
    "use_liger_kernel": (
        "Liger swaps the model's modules and its fused linear cross entropy, while the executor computes the loss "
        "in chunks itself (the full logits never exist)",
        "leave it off (stream_loss_chunk_tokens bounds the loss memory)",
    ),
    "fsdp": (
        "FSDP shards and moves the parameters, which the executor keeps in its host store",
        "leave it off (data parallel works: `accelerate launch --multi_gpu`)",
    ),
    "deepspeed": (
        "DeepSpeed takes over the parameters, the optimizer and their placement, which the executor owns",
        "leave it off (data parallel works: `accelerate launch --multi_gpu`)",
    ),
    "parallelism_config": (
        "tensor / context parallelism shards the layers the executor streams whole",
        "leave it off (data parallel works: `accelerate launch --multi_gpu`)",
    ),
}


def _refuse_while_streaming(args: TrainingArguments) -> None:
    """Note: [TrainingArguments a streamed run refuses]."""
    if not getattr(args, "stream_enabled", False):
        return
    for name, (why, fix) in STREAMING_REFUSED.items():
        value = getattr(args, name, None)
        if value:  # unset: None, False, "" or an empty list
            raise ValueError(
                f"{name}={value!r} with stream_enabled=True: {why}. To stream, {fix}; or set stream_enabled=False "
                f"to train with {name} as Trainer does."
            )


# TRL configs whose trainer LazyTrain streams (`lazytrain_hf.LazySFTTrainer`), and their bases
TRL_SUPPORTED_CONFIGS = ("SFTConfig", "_BaseConfig", "BaseConfig")


def _refuse_unsupported_trl_config(config_cls: type, streams: bool) -> None:
    """A TRL config of a trainer other than SFT (`DPOConfig`, `RewardConfig`, `GRPOConfig`, ...) is not upgraded to
    streaming LazyTrain arguments: LazyTrain streams `Trainer` and `SFTTrainer` only (their causal-LM loss)."""
    if not streams:
        return
    for c in config_cls.__mro__:
        if (
            c.__module__.startswith("trl.")
            and c.__name__.endswith("Config")
            and c.__name__ not in TRL_SUPPORTED_CONFIGS
        ):
            trainer = c.__name__[: -len("Config")] + "Trainer"
            raise ValueError(
                f"{config_cls.__name__} with stream_enabled=True: TRL's {trainer} is not supported by LazyTrain's "
                f"streaming path (the executor computes a causal-LM loss, not {trainer}'s). Supported while "
                "streaming: lazytrain_hf.LazyTrainer (transformers.Trainer) and lazytrain_hf.LazySFTTrainer "
                f"(trl.SFTTrainer). Train with trl.{trainer} and a plain {c.__name__}, or pass stream_enabled=False."
            )


def _refuse_foreign_trainer(args: LazyTrainingArguments) -> None:
    if not args.stream_enabled:
        return
    frame = sys._getframe(2)  # get_process_log_level <- its caller (Trainer.__init__)
    for _ in range(4):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        names = {f"{c.__module__}.{c.__qualname__}" for c in type(owner).__mro__} if owner is not None else set()
        if "transformers.trainer.Trainer" in names:
            if "lazytrain_hf.trainer.LazyTrainer" in names:
                return
            sft = any(n.startswith("trl.") and n.endswith(".SFTTrainer") for n in names)
            other_trl = any(n.startswith("trl.") and n.endswith("Trainer") for n in names) and not sft
            fix = "lazytrain_hf.LazySFTTrainer(...)" if sft else "lazytrain_hf.LazyTrainer(...)"
            if other_trl:
                fix = (
                    "LazyTrain streams transformers.Trainer (LazyTrainer) and trl.SFTTrainer (LazySFTTrainer) only; "
                    f"train {type(owner).__name__} with its own config"
                )
            raise ValueError(
                f"{type(owner).__name__}(args={type(args).__name__}(stream_enabled=True)): only LazyTrainer runs "
                f"the LazyTrain path (plan, streaming hooks, HybridAdamW8bit); a {type(owner).__name__} would train "
                f"the unstreamed model with its own optimizer. Use {fix} with the same arguments, or set "
                "stream_enabled=False."
            )
        frame = frame.f_back


_UPGRADED: dict[tuple[type, type], type] = {}  # (user's TrainingArguments subclass, LazyTrainingArguments class)


def upgraded_class(base: type, lazy: type = LazyTrainingArguments) -> type:
    """The class `LazyTrainingArguments.from_training_arguments` gives an object of class ``base``.

    ``lazy`` itself when ``base`` is one of its bases (plain `TrainingArguments`), ``base`` when it already derives
    from ``lazy``, else ``@dataclass class Lazy<Base>(base, lazy)``, made once per pair. In that class the fields of
    ``base`` keep ``base``'s defaults (dataclass fields are collected along the reversed MRO, so the first base wins
    for a field both define: the `TrainingArguments` fields ``base`` re-declares) and the LazyTrain fields keep
    ``lazy``'s; ``__post_init__`` is the cooperative chain ``base`` -> ``lazy`` -> `TrainingArguments`, so each
    validation runs once. It pickles by reference to ``base`` and ``lazy`` (Trainer writes ``training_args.bin``).
    """
    if not (isinstance(base, type) and issubclass(base, TrainingArguments)):
        raise TypeError(f"args of type {base!r} is not a TrainingArguments; pass a TrainingArguments (or subclass).")
    if issubclass(base, lazy):
        return base
    if issubclass(lazy, base):
        return lazy
    maintained = maintained_upgrade(base)  # trl's SFTConfig: LazySFTConfig (its own defaults and checks)
    if maintained is not None and issubclass(maintained, lazy):
        return maintained
    key = (base, lazy)
    if key not in _UPGRADED:
        name = f"Lazy{base.__name__}"
        namespace = {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"`{base.__name__}` with the `{lazy.__name__}` fields (made by `upgraded_class`).",
            "__reduce__": _reduce_upgraded,
            "_upgraded_from": key,
        }
        _UPGRADED[key] = dataclass(type(name, (base, lazy), namespace))
    return _UPGRADED[key]


def _reduce_upgraded(self) -> tuple:
    return _rebuild_upgraded, (*type(self)._upgraded_from, self.__getstate__())


def _rebuild_upgraded(base: type, lazy: type, state: dict) -> Any:
    cls = upgraded_class(base, lazy)
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


@functools.cache
def _typed_fields() -> dict[str, tuple[frozenset, Any]]:
    """The bool / int / float fields `LazyTrainingArguments` adds to `TrainingArguments` (optionally None), as
    ``{name: (types, default)}``. Read from the resolved annotations: `HfArgumentParser` rewrites ``Field.type``
    in place, so the field's own annotation may be a string or a type."""
    hints = typing.get_type_hints(LazyTrainingArguments)
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    out = {}
    for f in dataclasses.fields(LazyTrainingArguments):
        hint = hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        kinds = frozenset(typing.get_args(hint) if union else (hint,))
        if f.name not in base and kinds <= {bool, int, float, type(None)}:
            out[f.name] = (kinds, f.default)
    return out


def _field_default(cls: type, name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _value_of(value: Any) -> Any:
    """An ExplicitEnum (``OptimizerNames.SGD``) as its string, anything else as is."""
    return value.value if hasattr(value, "value") and value.__class__.__module__.startswith("transformers") else value


def check_hardware(value: Any) -> None:
    """ValueError naming ``planner_hardware`` unless ``value`` is ``"auto"``, a bundled profile name or a profile
    JSON that exists and parses (positive, finite numbers), checked here so a typo fails at construction, not at
    `train()`. Only `lazytrain_hf.planner.hardware` is imported (no Trainer, no torch)."""
    from .planner.hardware import BUNDLED_PROFILES, get_profile

    names = ", ".join(BUNDLED_PROFILES)
    if not isinstance(value, str):
        raise ValueError(
            f"planner_hardware={value!r} must be a string: a bundled profile name ({names}), the path of a profile "
            "JSON, or 'auto'."
        )
    if value == "auto" or value.lower() in BUNDLED_PROFILES:
        return
    if not (value.endswith(".json") or os.path.sep in value):
        raise ValueError(
            f"planner_hardware={value!r} is not a bundled profile; use one of {names}, the path of a profile JSON "
            "written by `lazytrain_hf.planner.hardware.measure(cache_path=...)`, or 'auto' to measure this machine."
        )
    try:
        get_profile(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"planner_hardware={value!r}: {e} ('auto' measures this machine instead.)") from e


def resolve_plan_path(path: str) -> str:
    """The plan file ``planner_plan`` names (a checkpoint directory stands for its ``lazytrain_plan.json``), checked
    to parse as a `Plan`; ValueError naming the option, the value and the fix otherwise."""
    from .planner.plan import Plan, PlanError

    if not isinstance(path, str | os.PathLike) or not str(path):
        raise ValueError(
            f"planner_plan={path!r} must be the path of a Plan JSON file; write one with "
            "`lazytrain plan --model ... --save plan.json`."
        )
    resolved = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if os.path.isdir(resolved):
        resolved = os.path.join(resolved, PLAN_FILE)
    if not os.path.isfile(resolved):
        raise ValueError(
            f"planner_plan={path!r}: no plan file at {resolved}; pass a file written by `lazytrain plan --save` or "
            f"a checkpoint's {PLAN_FILE}."
        )
    try:
        Plan.from_json(resolved)
    except (PlanError, OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"planner_plan={path!r} is not a valid plan ({e}); write it again with `lazytrain plan --save`."
        ) from e
    return resolved


def _originals(args: TrainingArguments, values: dict) -> dict:
    """Undo the normalisations `TrainingArguments.__post_init__` applied, so re-running it is idempotent."""
    return {name: _value_of(value) for name, value in values.items()}
