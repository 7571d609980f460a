"""`LazyTrainingArguments`: `TrainingArguments` plus the LazyTrain groups (stream_*, planner_*, activation_*, optim_*)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from transformers import TrainingArguments

from .planner.plan import INPUT_TIERS
from .units import parse_bytes

PLAN_FILE = "lazytrain_plan.json"  # the plan next to a checkpoint (also written to output_dir)
PLANNER_POLICIES = ("milp", "megatrain", "keep_all", "all_recompute", "cpu_offload_inputs", "default")
SOLVERS = ("auto", "cbc", "highs")


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

    > Planner (`lazytrain_hf.planner`)

    planner_policy (`str`, defaults to `"milp"`): `"milp"` solves the plan; a baseline name (`"megatrain"`,
        `"keep_all"`, `"all_recompute"`, `"cpu_offload_inputs"`) or `"default"` uses that fixed plan.
    planner_hardware (`str`, defaults to `"auto"`): bundled profile name (`h800`, `h200`, `a100-80g`, `rtx3090`,
        `rtx4090`, `cpu`), a path to a measured profile JSON, or `"auto"` (measure this machine).
    planner_gpu_budget (`int` or `str`, *optional*): device memory the plan may use, e.g. `"70GiB"`; default: the
        profile's device memory minus a 10% reserve.
    planner_host_budget (`int` or `str`, *optional*): pinned host memory for offloaded activations; default: half
        of the profile's host RAM.
    planner_time_limit (`float`, defaults to `30`): MILP solver time limit in seconds.
    planner_mip_gap (`float`, defaults to `0.01`): relative optimality gap at which the solver stops.
    planner_solver (`str`, defaults to `"auto"`): `"cbc"`, `"highs"` or `"auto"` (HiGHS when installed).
    planner_auto_batch_size (`bool`, defaults to `False`): search the micro-batch size with the highest tokens/s
        that fits, and train with it (overrides `per_device_train_batch_size`).
    planner_max_batch_size (`int`, defaults to `256`): upper end of that search.
    planner_warmup_steps (`int`, defaults to `2`): timed warm-up steps that measure per-layer costs before solving.
    planner_plan (`str`, *optional*): a Plan JSON file (as `lazytrain plan --save` writes it, or a checkpoint's
        `lazytrain_plan.json`; a checkpoint directory works too) that `train()` executes as is: no hardware profile,
        warm-up or solve. It must match the model (layer count and kinds) and `per_device_train_batch_size`; its
        `optimizer_overlap` is honoured on any device unless `optim_overlap_forward` is set.

    > Activations (`lazytrain_hf.activations`)

    activation_tiers (`list[str]`, defaults to `["gpu", "cpu"]`): where saved activations may live: `gpu` (keep),
        `cpu` (pinned host), `nvme` (spill files). Recomputation is always allowed.
    activation_nvme_dir (`str`, *optional*): directory for NVMe spill files; required when `nvme` is a tier.

    > Optimizer (`lazytrain_hf.optim`)

    optim_hybrid_8bit (`bool`, *optional*): use `HybridAdamW8bit` (CPU AdamW, block-wise 8-bit moments, fused
        clipping). Default: on when streaming is on.
    optim_block_size (`int`, defaults to `256`): elements per 8-bit quantisation block.
    optim_min_8bit_size (`int`, defaults to `4096`): tensors with fewer elements keep fp32 moments.
    optim_overlap_forward (`bool`, *optional*): update layers on a background thread while the next forward runs
        (layer i is fetched as soon as it is updated). Default: on with CUDA when the plan allows it.

    Changed `TrainingArguments` defaults: none. `max_grad_norm` is honoured through fused clipping when streaming.
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

    # ----------------------------------------------------------------- planner
    planner_policy: str = field(
        default="milp", metadata={"help": f"How the plan is made: one of {', '.join(PLANNER_POLICIES)}."}
    )
    planner_hardware: str = field(
        default="auto",
        metadata={
            "help": "Hardware profile: bundled name (h800, h200, a100-80g, rtx3090, rtx4090, cpu), JSON path, "
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
        default=None, metadata={"help": "Pinned host memory for offloaded activations, e.g. '64GiB'."}
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
        default=None, metadata={"help": "Directory for NVMe activation spill files (needed for the nvme tier)."}
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

    def __post_init__(self):
        super().__post_init__()
        # ---- cross-field checks: each error names the option, the value and the fix
        if self.stream_prefetch_depth < 0:
            raise ValueError(f"stream_prefetch_depth={self.stream_prefetch_depth} must be >= 0 (1 is a good default).")
        if self.stream_loss_chunk_tokens < 1:
            raise ValueError(f"stream_loss_chunk_tokens={self.stream_loss_chunk_tokens} must be >= 1 (e.g. 1024).")
        if self.planner_policy not in PLANNER_POLICIES:
            raise ValueError(
                f"planner_policy={self.planner_policy!r} is not supported; use one of {', '.join(PLANNER_POLICIES)}."
            )
        if self.planner_solver not in SOLVERS:
            raise ValueError(f"planner_solver={self.planner_solver!r} is not supported; use one of {SOLVERS}.")
        if not self.planner_hardware:
            raise ValueError("planner_hardware='' is empty; pass a profile name, a JSON path or 'auto'.")
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

        # "gpu,cpu", ["gpu,cpu"] and ["gpu", "cpu"] all mean the same (the command line gives the middle form)
        tiers = [self.activation_tiers] if isinstance(self.activation_tiers, str) else list(self.activation_tiers)
        self.activation_tiers = [t.strip() for item in tiers for t in str(item).split(",") if t.strip()]
        bad = [t for t in self.activation_tiers if t not in INPUT_TIERS]
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
            self.activation_nvme_dir = os.path.abspath(os.path.expanduser(self.activation_nvme_dir))

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

        # ---- derived defaults
        if self.optim_hybrid_8bit is None:
            self.optim_hybrid_8bit = bool(self.stream_enabled)

    def __getstate__(self) -> dict:
        """Pickled without the hub token: Trainer writes `torch.save(args)` as `training_args.bin` into every
        checkpoint and into the folder `push_to_hub` uploads."""
        state = self.__dict__.copy()
        if state.get("hub_token"):
            state["hub_token"] = None
        return state

    @classmethod
    def from_training_arguments(cls, args: TrainingArguments, **overrides) -> LazyTrainingArguments:
        """Upgrade a plain `TrainingArguments` (every field it set is kept) to `LazyTrainingArguments`."""
        if isinstance(args, cls) and not overrides:
            return args
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init and hasattr(args, f.name)}
        # TrainingArguments.__post_init__ rewrites some fields (enums, derived paths); re-run it from the originals.
        values.update(overrides)
        return cls(**_originals(args, values))


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
    out = {}
    for name, value in values.items():
        if hasattr(value, "value") and value.__class__.__module__.startswith("transformers"):
            value = value.value  # ExplicitEnum -> its string
        out[name] = value
    return out
