"""`LazyTrainer(Trainer)`: plan at `train()` start, stream layers through hooks, Hybrid 8-bit optimizer.

What changes against `transformers.Trainer` (everything else is inherited unchanged):

- `train()`: hardware profile -> timed warm-up steps (per-layer forward/backward times) -> plan (MILP, a baseline, or
  the default) -> streaming hooks and activation policies installed -> `Trainer.train()` -> hooks removed, also
  when training raises.
- `compute_loss()`: the chunked causal-LM loss of the executor (the full B x T x V logits never exist).
- `create_optimizer()`: `HybridAdamW8bit` over the host fp32 master weights, with Trainer's decay groups.
- `_clip_grad_norm()` / `_get_grad_norm()`: the global norm comes from per-layer squared norms taken as gradients
  were produced, and the clip coefficient is folded into the optimizer pass (no extra pass over gradients).
  A non-finite norm skips the step (optimizer state untouched, scheduler not stepped), counted and logged.
- `_save_checkpoint()` / `save_model()`: written to a staging directory, then renamed, so an interrupted save never
  replaces a good checkpoint with a half-written one; weights are read from the host store (never gathered on the
  device) and checkpoints also carry the fp32 masters when the compute copy is bf16. Resume restores them and the
  plan. `training_args.bin` never holds the hub token.
- `evaluate()` / `predict()` / `streaming()`: inference with the model streamed.
- `log()`: adds throughput (tokens/s, TFLOPS), peak device memory and predicted vs measured step time.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import threading
import time
from typing import Any

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from . import models
from .args import PLAN_FILE, LazyTrainingArguments
from .streams import SimDelay, simulate_async
from .units import format_bytes

logger = logging.get_logger(__name__)

STAGING_PREFIX = ".staging-"
MASTER_FILE = "lazytrain_master.safetensors"
TIMELINE_FILE = "lazytrain_timeline.png"


def _unwrap_base(model: torch.nn.Module) -> torch.nn.Module:
    """The `*ForCausalLM` under PEFT / DDP wrappers."""
    inner = getattr(model, "module", model)
    if hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    return inner


class LazyTrainer(Trainer):
    """A `transformers.Trainer` that trains models larger than the GPU.

    With `args.stream_enabled=False` it is exactly `Trainer` (and, with `optim_hybrid_8bit=True`, Trainer with the
    Hybrid 8-bit optimizer). A plain `TrainingArguments` is upgraded to `LazyTrainingArguments` (every field it set
    is kept, LazyTrain fields take their defaults).
    """

    def __init__(self, model: Any = None, args: TrainingArguments | None = None, **kwargs: Any):
        # Phase 1: arguments. A plain TrainingArguments is upgraded, not rejected.
        if args is None:
            args = LazyTrainingArguments(output_dir="trainer_output")
        elif not isinstance(args, LazyTrainingArguments):
            args = LazyTrainingArguments.from_training_arguments(args)

        # Phase 2: fail early on models the executor cannot stream.
        if args.stream_enabled and model is not None:
            models.get_spec(_unwrap_base(model))

        super().__init__(model=model, args=args, **kwargs)

        # Phase 3: LazyTrain state, filled by train().
        self.stream_handle = None
        self.lazy_plan = None
        self.lazy_cost_model = None
        self.skipped_nonfinite_steps = 0
        self._clip_coef: float | None = None
        self._skip_step = False
        self._updater: LayerwiseUpdater | None = None
        self._preloaded_checkpoint: str | None = None
        self._resident_reduced = False
        self._step_t0: float | None = None
        self._window = {"tokens": 0, "last_step": 0}
        self._n_params: int | None = None
        self._plan_from_file = False

    # ------------------------------------------------------------------ train()
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any):
        if not self.args.stream_enabled:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        from .streaming import attach

        if self.optimizer is not None:
            raise ValueError(
                "LazyTrainer(optimizers=...) with stream_enabled=True: the streamed model is updated by the "
                "HybridAdamW8bit that train() builds over the host fp32 masters, so a given optimizer would never "
                "update the streamed layers. Drop `optimizers` (tune it with the optim_* arguments) or set "
                "stream_enabled=False."
            )
        checkpoint = self._resolve_checkpoint(resume_from_checkpoint)
        plan = None
        if checkpoint is not None:
            verify_checkpoint(checkpoint)
            # weights go in before the host store is built from them; the plan is the one that trained them
            self._load_from_checkpoint(checkpoint)
            self._preloaded_checkpoint = checkpoint
            plan = read_plan(checkpoint)
            if plan is not None:
                self.lazy_plan = plan
                if self.args.planner_auto_batch_size:
                    self._adopt_batch_size(plan)  # the batch size the plan chose when training started
                self.check_plan_fits(plan, where=checkpoint, check_batch=False)
        if plan is None and self.args.planner_plan is not None:
            plan = self.load_plan_file(self.args.planner_plan)
            self.check_plan_fits(plan, where=self.args.planner_plan)
        if plan is None:
            plan = self.make_plan()
        self.check_host_memory(plan)  # before the host store allocates anything
        self.stream_handle = attach(
            self.model, plan=plan, device=self.args.device, nvme_dir=self.args.activation_nvme_dir
        )
        if "nvme" in plan.tiers_used():
            try:
                self.stream_handle.activations.check_nvme_capacity(int(plan.predicted.get("nvme_bytes", 0)))
            except BaseException:
                handle, self.stream_handle = self.stream_handle, None
                handle.remove()
                raise
        # Note: [The executor owns placement] Accelerate must neither move the model to the device nor wrap it in
        # DDP: streamed layers live on the host and gradients are all-reduced per layer by the executor.
        self.model._is_accelerate_prepared = True
        try:
            self._restore_masters(checkpoint, "store")  # Note: [fp32 masters in checkpoints]
            if self.args.world_size > 1:
                self.stream_handle.grad_reducer = self._all_reduce_layer
            return super().train(resume_from_checkpoint=checkpoint, trial=trial, **kwargs)
        finally:
            with contextlib.suppress(AttributeError):
                del self.model._is_accelerate_prepared
            self._preloaded_checkpoint = None
            if self._updater is not None:
                self._updater.close()
                self._updater = None
                # its parameters are views of the host store removed below; the next train() builds a new one
                # (resume_from_checkpoint restores the state)
                self.optimizer = None
            handle, self.stream_handle = self.stream_handle, None
            handle.remove()

    def load_plan_file(self, path: str):
        """The plan `planner_plan` names, executed as is (no profile, warm-up or solve); saved to output_dir."""
        from .planner.plan import Plan

        plan = Plan.from_json(path)
        self._plan_from_file = True
        self.lazy_plan = plan
        if self.args.should_save:
            os.makedirs(self.args.output_dir, exist_ok=True)
            _atomic_write_text(os.path.join(self.args.output_dir, PLAN_FILE), plan.to_json())
        return plan

    def check_plan_fits(self, plan, where: str | None = None, check_batch: bool = True) -> None:
        """Refuse, before anything is attached, a plan made for another model or (``check_batch``) another
        micro-batch size, or one that needs a directory the arguments do not give."""
        base = _unwrap_base(self.model)
        kinds = models.layer_kinds(base.config)
        src = f"the plan from {where}" if where else "the plan"
        fix = (
            "make a plan for this model and batch (`lazytrain plan --model <config.json> --batch-size N --save "
            "plan.json`) or drop planner_plan to plan at train() start"
        )
        if plan.num_layers != len(kinds):
            raise ValueError(
                f"{src}: field `layers` has {plan.num_layers} entries but the model has {len(kinds)} decoder layers; "
                f"{fix}."
            )
        for lp, kind in zip(plan.layers, kinds):
            if lp.kind != kind:
                raise ValueError(
                    f"{src}: field `layers[{lp.index}].kind` is {lp.kind!r} but the model's layer {lp.index} is "
                    f"{kind!r}; {fix}."
                )
        if check_batch and plan.micro_batch_size != self.args.per_device_train_batch_size:
            raise ValueError(
                f"{src}: field `micro_batch_size` is {plan.micro_batch_size} but per_device_train_batch_size is "
                f"{self.args.per_device_train_batch_size}; set per_device_train_batch_size={plan.micro_batch_size} "
                f"or {fix}."
            )
        nvme = [lp.index for lp in plan.layers if lp.tier == "nvme"]
        if nvme and not self.args.activation_nvme_dir:
            raise ValueError(
                f"{src}: layers {nvme} keep activations on the nvme tier but activation_nvme_dir is not set; pass "
                "activation_nvme_dir=/path/on/fast/disk or use a plan without the nvme tier."
            )

    def check_host_memory(self, plan) -> None:
        """Refuse, before anything is allocated, a run whose host store, optimizer state and pinned activation
        buffers would not fit in the host memory available now, with the numbers and what would fit."""
        params = list(self.model.parameters())
        n_train = sum(p.numel() for p in params if p.requires_grad)
        n_all = sum(p.numel() for p in params)
        dtype = params[0].dtype if params else torch.float32
        master = 0 if dtype == torch.float32 else 4 * n_train  # fp32 compute copies are the master (aliased)
        grads = 4 * n_train
        optim = 2 * n_train if self.args.optim_hybrid_8bit else 8 * n_train
        pinned = int(plan.predicted.get("pinned_host_bytes", 0) or 0)
        fixed = master + grads + optim
        available = _available_host_bytes()
        if available is None or fixed + pinned <= available:
            return
        per_seq = pinned / max(1, plan.micro_batch_size)
        fits = int((available - fixed) // per_seq) if per_seq and available > fixed else 0
        hint = (
            f"per_device_train_batch_size <= {fits} fits"
            if fits >= 1
            else f"even batch 1 does not fit: the model itself needs {format_bytes(fixed)} ({n_all} parameters); "
            "train LoRA adapters (frozen weights need no gradients or optimizer state) or use a larger machine"
        )
        raise ValueError(
            f"host memory: this run needs {fixed + pinned} bytes ({format_bytes(fixed + pinned)}): fp32 master "
            f"{format_bytes(master)}, gradients {format_bytes(grads)}, optimizer state {format_bytes(optim)}, pinned "
            f"activations {format_bytes(pinned)} at micro-batch {plan.micro_batch_size}; only {available} bytes "
            f"({format_bytes(available)}) are available. {hint}; or set planner_host_budget / allow the nvme tier "
            "(activation_tiers) so activations leave host memory."
        )

    def _resolve_checkpoint(self, resume_from_checkpoint: str | bool | None) -> str | None:
        from transformers.trainer_utils import get_last_checkpoint

        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return None
        if resume_from_checkpoint is True:
            last = get_last_checkpoint(self.args.output_dir)
            if last is None:
                raise ValueError(
                    f"resume_from_checkpoint=True but no checkpoint-<N> directory is in output_dir="
                    f"{self.args.output_dir!r}; pass a checkpoint path or start without resuming."
                )
            return last
        if not os.path.isdir(resume_from_checkpoint):
            raise ValueError(
                f"resume_from_checkpoint={resume_from_checkpoint!r} is not a directory; pass a checkpoint-<N> path."
            )
        return str(resume_from_checkpoint)

    def _separate_masters(self, store: bool = True, resident: bool = True) -> dict[str, torch.Tensor]:
        """The fp32 masters that are not the model's own weights (their compute copy is bf16/fp16), by name: views of
        the host store's masters and the optimizer's resident masters.

        Note: [fp32 masters in checkpoints] the weights of a checkpoint are the compute copy; resuming from them alone
        would restart from masters rounded to the compute dtype. Checkpoints therefore carry these masters too.
        """
        out: dict[str, torch.Tensor] = {}
        if store and self.stream_handle is not None:
            for ls in self.stream_handle.store.layers.values():
                if ls.master is not None and not ls.aliased:
                    out.update(ls.master_views)
        if resident and self._updater is not None:
            out.update({n: m for n, p, m in self._updater.resident if m.data_ptr() != p.data_ptr()})
        return out

    def _unsaved_masters(self) -> dict[str, torch.Tensor]:
        """Copies of `_separate_masters()` once the optimizer step in flight (if any) has finished."""
        if self._updater is not None:
            self._updater.wait_all()
        return {n: t.detach().contiguous().clone() for n, t in self._separate_masters().items()}

    def _restore_masters(self, checkpoint: str | None, where: str) -> None:
        """Copy the checkpoint's fp32 masters into the host store (`where="store"`, right after attach) or into the
        optimizer's resident masters (`where="resident"`, when the optimizer is built)."""
        path = os.path.join(checkpoint, MASTER_FILE) if checkpoint else None
        if path is None or not os.path.exists(path):
            return
        from safetensors.torch import load_file

        saved = load_file(path)
        targets = self._separate_masters(store=where == "store", resident=where == "resident")
        with torch.no_grad():
            for name, dst in targets.items():
                if name not in saved or saved[name].shape != dst.shape:
                    raise ValueError(
                        f"checkpoint file {path} has no fp32 master of shape {tuple(dst.shape)} for {name!r}; it was "
                        "written for another model. Resume from a checkpoint of this model."
                    )
                dst.copy_(saved[name])

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self.stream_handle is not None and resume_from_checkpoint == self._preloaded_checkpoint:
            return  # loaded before the executor was attached
        try:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        except Exception as e:
            raise ValueError(_checkpoint_error(resume_from_checkpoint, e)) from e

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        try:
            super()._load_optimizer_and_scheduler(checkpoint)
        except Exception as e:
            raise ValueError(_checkpoint_error(checkpoint, e)) from e

    def _move_model_to_device(self, model, device) -> None:
        if self.args.stream_enabled:
            return  # Note: [The executor owns placement]
        super()._move_model_to_device(model, device)

    def _all_reduce_layer(self, layer: int, grads: list[torch.Tensor]) -> None:
        """Average one layer's device gradients over the data-parallel ranks, as they are produced."""
        import torch.distributed as dist

        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n

    def _reduce_resident_grads(self) -> None:
        if self.args.world_size <= 1 or self.stream_handle is None or self._resident_reduced:
            return
        grads = [p.grad for _, p in self.stream_handle.resident_parameters() if p.grad is not None]
        if grads:
            self._all_reduce_layer(-1, grads)
        self._resident_reduced = True

    # ------------------------------------------------------------------ inference while streamed
    @contextlib.contextmanager
    def streaming(self):
        """Stream the model for inference (a forward-only default plan) when it is not already streamed:
        ``with trainer.streaming(): model.generate(...)``. A no-op with streaming off or inside `train()`."""
        if not self.args.stream_enabled or self.stream_handle is not None:
            yield self.stream_handle
            return
        from .streaming import attach

        handle = attach(self.model, plan=self.lazy_plan, device=self.args.device)
        self.model._is_accelerate_prepared = True
        try:
            yield handle
        finally:
            with contextlib.suppress(AttributeError):
                del self.model._is_accelerate_prepared
            handle.remove()

    def evaluate(self, *args: Any, **kwargs: Any):
        with self.streaming():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any):
        with self.streaming():
            return super().predict(*args, **kwargs)

    # ------------------------------------------------------------------ planning
    def _sample_batch(self) -> dict[str, torch.Tensor]:
        """One collated training micro-batch, taken without touching the training dataloader's RNG."""
        if self.train_dataset is None:
            raise ValueError("LazyTrainer.train() needs a train_dataset to plan and train.")
        n = min(self.args.per_device_train_batch_size, len(self.train_dataset))
        if n == 0:
            raise ValueError("train_dataset is empty; pass a dataset with at least one row.")
        rows = [self.train_dataset[i] for i in range(n)]
        dl = self.get_train_dataloader()  # only for its collator (column removal included)
        batch = dl.collate_fn(rows) if hasattr(dl, "collate_fn") else self.data_collator(rows)
        return self._prepare_inputs(batch)

    def measure_layer_times(self, batch: dict[str, torch.Tensor], steps: int) -> tuple[list[float], list[float]]:
        """Median forward and backward seconds per decoder layer over `steps` timed forward+backward passes
        (`time_streamed_layers`), restoring every RNG state and the train/eval mode: warm-up never changes training.
        """
        rng = _rng_state()
        was_training = self.model.training
        try:
            self.model.train()
            return time_streamed_layers(self.model, batch, self.args.device, max(1, steps))
        finally:
            self.model.train(was_training)
            _set_rng_state(rng)

    def make_plan(self):
        """Profile -> warm-up timings -> plan, per `args.planner_*`. Saves the plan (JSON + timeline) to output_dir."""
        from .planner import baselines, costmodel, hardware, milp
        from .planner.plan import Plan

        a = self.args
        base = _unwrap_base(self.model)
        config = base.config
        kinds = models.layer_kinds(config)
        batch = self._sample_batch()
        seq_len = int(batch["input_ids"].shape[1])
        mbs = int(batch["input_ids"].shape[0])

        if a.planner_policy == "default":
            plan = Plan.default(
                len(kinds),
                kinds,
                prefetch_depth=a.stream_prefetch_depth,
                micro_batch_size=mbs,
                seq_len=seq_len,
                loss_chunk_tokens=a.stream_loss_chunk_tokens,
                stream_embeddings=a.stream_embeddings,
                model=config.model_type,
            )
            self.lazy_plan = plan
            return plan

        profile = (
            hardware.measure(
                cache_path=os.path.join(a.output_dir, "hardware_profile.json"),
                device=str(a.device),
                nvme_dir=a.activation_nvme_dir,
            )
            if a.planner_hardware == "auto"
            else hardware.get_profile(a.planner_hardware)
        )
        dtype_bytes = 4 if next(base.parameters()).dtype == torch.float32 else 2
        attn = attention_cost_class(config)
        common = dict(loss_chunk_tokens=a.stream_loss_chunk_tokens, attn_implementation=attn)
        measured = None
        if a.planner_warmup_steps > 0:
            measured = self.measure_layer_times(batch, a.planner_warmup_steps)
        nvme_budget = 0
        if "nvme" in a.activation_tiers and a.activation_nvme_dir:
            nvme_budget = int(shutil.disk_usage(_existing_parent(a.activation_nvme_dir)).free * 0.9)

        if a.planner_policy == "milp":
            plan = milp.plan_for_model(
                config,
                profile,
                seq_len=seq_len,
                micro_batch_size=mbs,
                auto_batch_size=a.planner_auto_batch_size,
                max_batch_size=a.planner_max_batch_size,
                gpu_budget=a.planner_gpu_budget,
                host_budget=a.planner_host_budget,
                nvme_budget=nvme_budget,
                allowed_tiers=tuple(a.activation_tiers),
                time_limit=a.planner_time_limit,
                gap=a.planner_mip_gap,
                solver=a.planner_solver,
                dtype_bytes=dtype_bytes,
                measured_times=measured,
                **common,
            )
        # the cost model of the batch the plan trains with (auto batch size may have changed it): the baselines and
        # the timeline are made from it; measured layer times apply to the measured batch only
        plan_mbs = plan.micro_batch_size if a.planner_policy == "milp" else mbs
        cm = costmodel.CostModel.from_config(
            config, profile, seq_len=seq_len, micro_batch_size=plan_mbs, dtype_bytes=dtype_bytes, **common
        )
        if measured is not None and plan_mbs == mbs:
            cm = cm.with_measured_times(*measured)
        if a.planner_policy != "milp":
            plan = baselines.make_baseline(a.planner_policy, cm)
        self.lazy_cost_model = cm
        plan.loss_chunk_tokens = a.stream_loss_chunk_tokens
        plan.stream_embeddings = plan.stream_embeddings or a.stream_embeddings
        plan.model = plan.model or config.model_type
        if a.planner_auto_batch_size:
            self._adopt_batch_size(plan)
        self.lazy_plan = plan
        self._save_plan(plan, cm)
        return plan

    def _adopt_batch_size(self, plan) -> None:
        a = self.args
        if plan.micro_batch_size != a.per_device_train_batch_size:
            logger.warning(f"planner_auto_batch_size: training with micro-batch size {plan.micro_batch_size}.")
            a.per_device_train_batch_size = plan.micro_batch_size
            self._train_batch_size = a.train_batch_size

    def _save_plan(self, plan, cost_model) -> None:
        if not self.args.should_save:
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        _atomic_write_text(os.path.join(self.args.output_dir, PLAN_FILE), plan.to_json())
        logger.warning("LazyTrain plan:\n" + plan.table())
        try:
            from .planner import simulate

            simulate.draw_timeline(
                simulate.simulate(plan, cost_model), os.path.join(self.args.output_dir, TIMELINE_FILE)
            )
        except ImportError as e:  # matplotlib is optional (extra `plot`)
            logger.warning(f"timeline picture not drawn ({e}); pip install 'lazytrain-hf[plot]' to get it.")

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        if (
            self.stream_handle is None
            or return_outputs
            or self.label_smoother is not None
            or (self.compute_loss_func is not None)
        ):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if self._step_t0 is None:
            self._step_t0 = time.perf_counter()
        mask = inputs.get("attention_mask")
        # a device tensor (no host sync per micro-batch); read once per log in `_throughput_logs`
        self._window["tokens"] += mask.sum() if mask is not None else inputs["input_ids"].numel()
        loss = self.stream_handle.causal_lm_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes
        return loss

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, model=None):
        """`HybridAdamW8bit` (or, with `optim_hybrid_8bit=False` while streaming, torch AdamW) over the host fp32
        master weights when streaming, over the model's parameters otherwise; Trainer's decay / no-decay groups."""
        if not self.args.optim_hybrid_8bit:  # streaming implies it (LazyTrainingArguments)
            return super().create_optimizer(model)
        if self.optimizer is not None:
            return self.optimizer
        model = model if model is not None else self.model
        decay = set(self.get_decay_parameter_names(model))
        groups: dict[bool, list[torch.Tensor]] = {True: [], False: []}
        if self.stream_handle is not None:
            self._updater = LayerwiseUpdater(self.stream_handle, overlap=self._overlap_enabled())
            self._restore_masters(self._preloaded_checkpoint, "resident")
            for name, master in self._updater.named_masters():
                groups[name in decay].append(master)
        else:
            for name, p in model.named_parameters():
                if p.requires_grad:
                    groups[name in decay].append(p)
        param_groups = [
            {"params": groups[True], "weight_decay": self.args.weight_decay},
            {"params": groups[False], "weight_decay": 0.0},
        ]
        param_groups = [g for g in param_groups if g["params"]]
        from .optim import HybridAdamW8bit

        opt = HybridAdamW8bit(
            param_groups,
            lr=self.args.learning_rate,
            betas=(self.args.adam_beta1, self.args.adam_beta2),
            eps=self.args.adam_epsilon,
            block_size=self.args.optim_block_size,
            min_8bit_size=self.args.optim_min_8bit_size,
        )
        if self.stream_handle is not None:
            self._updater.bind(opt)
        self._wrap_optimizer_step(opt)
        self.optimizer = opt
        return opt

    def _overlap_enabled(self) -> bool:
        if self.args.optim_overlap_forward is not None:
            return bool(self.args.optim_overlap_forward)
        if self._plan_from_file and self.lazy_plan is not None:
            return bool(self.lazy_plan.optimizer_overlap)  # executed as is (planner_plan)
        plan_ok = self.lazy_plan is None or self.lazy_plan.optimizer_overlap
        return plan_ok and self.args.device.type == "cuda"

    def _wrap_optimizer_step(self, opt: torch.optim.Optimizer) -> None:
        """Route Trainer's plain `optimizer.step()` through fast clipping, non-finite skipping and the host sync.

        Trainer calls `optimizer.step()` with no arguments between `_clip_grad_norm` and `model.zero_grad()`; the
        clip coefficient computed from the per-layer norms is passed into the fused pass here.
        """
        inner_step = opt.step

        def step(closure=None):
            coef, self._clip_coef = self._clip_coef, None
            try:
                if self._skip_step:
                    return None
                if self.stream_handle is not None:
                    if closure is not None:
                        raise ValueError("LazyTrainer's streamed optimizer step takes no closure.")
                    self._updater.run(None if coef is None or coef >= 1.0 else coef)
                    return None
                if coef is None or coef >= 1.0:
                    return inner_step(closure)
                return inner_step(closure, clip_coef=coef)  # folded into the fused pass
            finally:
                self._skip_step = False
                self._resident_reduced = False
                if self.stream_handle is not None:
                    self.stream_handle.zero_grad()

        opt.step = step

    def _uses_default_optimizer(self) -> bool:
        return not self.args.optim_hybrid_8bit

    def _grad_norm_now(self, model) -> float:
        self._reduce_resident_grads()
        if self.stream_handle is not None:
            return float(self.stream_handle.global_grad_norm())
        from .optim.clip import global_norm, partial_sq_norms

        return float(global_norm(partial_sq_norms([p.grad for p in model.parameters() if p.grad is not None])))

    def _clip_grad_norm(self, model):
        if self._uses_default_optimizer():
            return super()._clip_grad_norm(model)
        from .optim.clip import clip_coefficient

        norm = self._grad_norm_now(model)
        if not math.isfinite(norm):
            self._skip_nonfinite_step(norm)
            return torch.tensor(norm)
        self._clip_coef = float(clip_coefficient(norm, self.args.max_grad_norm))
        return torch.tensor(norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if self._uses_default_optimizer():
            return super()._get_grad_norm(model, grad_norm)
        if grad_norm is None:  # max_grad_norm == 0: no clipping, but the norm is free (already reduced)
            norm = self._grad_norm_now(model)
            if not math.isfinite(norm):
                self._skip_nonfinite_step(norm)
            return norm
        return float(grad_norm)

    def _skip_nonfinite_step(self, norm: float) -> None:
        """Skip this optimizer step, as mixed-precision training does on overflow."""
        self.skipped_nonfinite_steps += 1
        logger.warning(
            f"non-finite gradient norm ({norm}); optimizer step skipped "
            f"({self.skipped_nonfinite_steps} so far), optimizer state untouched."
        )
        self._skip_step = True
        if hasattr(self.optimizer, "_is_overflow"):  # AcceleratedOptimizer: the scheduler is not stepped either
            self.optimizer._is_overflow = True

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            logs["skipped_nonfinite_steps"] = self.skipped_nonfinite_steps
            if self.stream_handle is not None:
                logs.update(self._throughput_logs())
        super().log(logs, start_time) if start_time is not None else super().log(logs)

    def _throughput_logs(self) -> dict[str, float]:
        out: dict[str, float] = {}
        now = time.perf_counter()
        tokens = int(self._window["tokens"])
        if self._step_t0 is not None and tokens:
            secs = now - self._step_t0
            steps = max(1, self.state.global_step - self._window["last_step"])
            if self._n_params is None:
                self._n_params = sum(p.numel() for p in self.model.parameters())
            n_params = self._n_params
            out["tokens_per_s"] = tokens / secs
            # 6 * N * tokens (forward + backward), as `Trainer.floating_point_ops`; recompute not counted as useful
            out["tflops"] = 6 * n_params * tokens / secs / 1e12
            out["step_time_s"] = secs / steps
            predicted = (self.lazy_plan.predicted or {}).get("step_time_s") if self.lazy_plan else None
            if predicted:
                out["predicted_step_time_s"] = float(predicted)
        stats = self.stream_handle.memory_stats()
        out["peak_device_bytes"] = int(stats.get("device_peak_bytes", 0))
        self.stream_handle.reset_peak()
        self._window = {"tokens": 0, "last_step": self.state.global_step}
        self._step_t0 = now
        return out

    # ------------------------------------------------------------------ saving
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self._updater is not None:
            self._updater.wait_all()  # weights of every layer updated before they are written
        # Streamed parameters point at their host copy while unbound, so `state_dict()` reads host memory: the
        # weights are written straight from the host store, never gathered on the device.
        super()._save(output_dir, state_dict=state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save and self.lazy_plan is not None:
            _atomic_write_text(os.path.join(output_dir, PLAN_FILE), self.lazy_plan.to_json())

    def _save_checkpoint(self, model, trial) -> None:
        """Write the checkpoint into a staging directory and rename it into place when complete.

        Note: [Atomic checkpoints] `get_last_checkpoint` only matches `checkpoint-<N>`; a staging directory left by
        a killed process is never taken as the latest checkpoint and is removed by the next save.
        """
        run_dir = self._get_output_dir(trial=trial)
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        staging_root = os.path.join(run_dir, f"{STAGING_PREFIX}{os.getpid()}")
        if self.args.should_save:
            _remove_stale_staging(run_dir)
        original = self._get_output_dir
        self._get_output_dir = lambda trial=None: staging_root  # super() writes staging_root/checkpoint-N
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._get_output_dir = original
        if not self.args.should_save:
            return
        staged = os.path.join(staging_root, os.path.basename(final))
        masters = self._unsaved_masters()
        if masters:
            from safetensors.torch import save_file

            save_file(masters, os.path.join(staged, MASTER_FILE))
        _fsync_tree(staged)
        if os.path.exists(final):
            old = final + f".old-{os.getpid()}"
            os.replace(final, old)
            os.replace(staged, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staged, final)
        _fsync_dir(run_dir)
        shutil.rmtree(staging_root, ignore_errors=True)
        if self.state.best_model_checkpoint and self.state.best_model_checkpoint.startswith(staging_root):
            self.state.best_model_checkpoint = final
        from transformers.trainer_utils import rotate_checkpoints

        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,
        )

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        super().create_model_card(*args, **kwargs)
        if not self.args.should_save or self.lazy_plan is None:
            return
        path = os.path.join(self.args.output_dir, "README.md")
        if not os.path.exists(path):
            return
        with open(path) as f:
            card = f.read()
        card += "\n" + lazytrain_card_section(self.lazy_plan, self.state.log_history) + "\n"
        _atomic_write_text(path, card)


# ---------------------------------------------------------------------- layer-wise optimizer step
class LayerwiseUpdater:
    """Runs the optimizer update of a streamed model parameter group by layer, in layer order.

    The optimizer sees, per streamed layer, views of the layer's flat fp32 master with ``.grad`` set to views of its
    flat fp32 gradient accumulator, and one fp32 host master per resident parameter (the parameter itself when it
    already is an fp32 CPU tensor). `run()` updates the resident parameters first (the next forward needs the
    embedding before anything else), then layers 0..L-1, refreshing each layer's compute copy right after its update.

    With ``overlap=True`` the updates run on a background thread and `run()` returns at once, so the next step's
    forward starts while later layers are still being updated.

    Note: [Update before fetch]
        The executor calls `wait_layer(i)` (its ``fetch_guard``) before any fetch of layer ``i`` reads the host
        compute copy and before every forward of a plan-resident layer ``i`` (whose dedicated slot the update
        re-uploads), and `wait_resident()` (its ``resident_guard``) when any forward begins (training, evaluation,
        prediction, generation): nothing reads a weight before its update of the previous step is complete.
        Hyperparameters (lr, betas, eps, weight decay) are frozen when `run()` is called, so an LR scheduler stepping
        while the thread works does not change this step's update. Gradients are taken over at `run()`, after
        `StreamHandle.synchronize` (Note: [Host accumulators are read only after their copy landed] in
        streaming/engine.py): resident ones detached from the parameters, streamed ones read from host buffers the
        next backward only writes after the next forward, which waits for every layer. `run()` also marks the
        resident slots released (the step's compute is queued), so the uploads are ordered after it. Tests:
        ``tests/test_plan_space.py`` (the property test with ``optimizer_overlap`` and resident layers under the
        simulated asynchronous engine, and one regression test per guard).

    Note: [The compute copy is written in the fused pass]
        For a layer whose trainable compute copy is bf16 (and not the master itself), the fused optimizer pass
        writes the bf16 weights straight into the host compute copy (``out_bf16``), so no second pass over the layer
        (`LayerStore.sync`) follows. The write waits for fetches still reading the compute copy first (Note: [Host
        compute copy is not rewritten while a fetch reads it] in streaming/engine.py).
    """

    def __init__(self, handle, overlap: bool = False):
        self.handle = handle
        self.overlap = overlap
        self.layers: dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}  # i -> [(name, master, grad)]
        for i, ls in sorted(handle.store.layers.items()):
            if ls.master is None:
                continue
            self.layers[i] = [(e.name, ls.master_views[e.name], ls.grad_views[e.name]) for e in ls.trainable_entries]
        # resident: (name, parameter, fp32 host master). An fp32 CPU parameter is updated in place through an alias
        # (`p.detach()`: same storage, its own `.grad`), so `zero_grad()` on the model never races the update.
        self.resident: list[tuple[str, torch.nn.Parameter, torch.Tensor]] = []
        for name, p in handle.resident_parameters():
            direct = p.device.type == "cpu" and p.dtype == torch.float32
            self.resident.append((name, p, p.detach() if direct else p.detach().to("cpu", torch.float32).clone()))
        self._aliased = {id(m) for _, p, m in self.resident if m.data_ptr() == p.data_ptr()}
        # Note: [The compute copy is written in the fused pass]: per layer, its bf16 compute views (or None)
        self._outs: dict[int, list[torch.Tensor] | None] = {}
        for i, entries in self.layers.items():
            ls = handle.store.layers[i]
            fused = not ls.aliased and all(e.dtype == torch.bfloat16 for e in ls.trainable_entries)
            self._outs[i] = [ls.compute_views[name] for name, _, _ in entries] if fused else None
        self._events = {i: threading.Event() for i in self.layers}
        self._resident_done = threading.Event()
        for ev in [*self._events.values(), self._resident_done]:
            ev.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._where: dict[int, tuple[int, int]] = {}
        # LAZYTRAIN_SIMULATE_ASYNC=1: the background update lags by seeded random delays (lazytrain_hf.streams)
        self._delay = SimDelay("optimizer") if overlap and simulate_async() else None
        handle.fetch_guard = self.wait_layer
        handle.resident_guard = self.wait_resident

    def named_masters(self) -> list[tuple[str, torch.Tensor]]:
        out = [(name, master) for name, _, master in self.resident]
        for entries in self.layers.values():
            out.extend((name, master) for name, master, _ in entries)
        return out

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._where = {
            id(p): (gi, k) for gi, g in enumerate(optimizer.param_groups) for k, p in enumerate(g["params"])
        }

    # ------------------------------------------------------------------ running
    def run(self, clip_coef: float | None) -> None:
        self.wait_all()
        self.handle.synchronize()  # Note: [Update before fetch]: the host accumulators are complete
        self.handle.mark_resident_released()
        opt = self.optimizer
        frozen = [{k: v for k, v in g.items()} for g in opt.param_groups]
        # take the gradients over now (Note: [Update before fetch])
        resident = []
        for _, p, master in self.resident:
            g = p.grad
            if g is not None and id(master) in self._aliased:
                master.grad = g  # the model's `.grad` may be cleared now: the alias keeps the tensor
            else:
                master.grad = None if g is None else g.detach().to("cpu", torch.float32)
            resident.append((p, master))
        layers = []
        for i, entries in self.layers.items():
            fresh = self.handle.store.layers[i].has_grad
            for _, master, grad in entries:
                master.grad = grad if fresh else None
            layers.append((i, [m for _, m, _ in entries]))
            self._events[i].clear()
        self._resident_done.clear()
        work = (frozen, resident, layers, clip_coef)
        if self.overlap:
            self._thread = threading.Thread(target=self._work, args=work, name="lazytrain-optimizer", daemon=True)
            self._thread.start()
        else:
            self._work(*work)
            self._raise()
            self.handle.wait_uploads()  # the model reads as updated once the step returns

    def _update(
        self, frozen: list[dict], params: list[torch.Tensor], clip: float | None, outs: list | None = None
    ) -> bool:
        """One fused pass per tensor; ``outs`` (one bf16 view per tensor) receive the compute copy. Returns whether
        every tensor's compute copy was written (all had a gradient)."""
        opt = self.optimizer
        if self._delay is not None:
            self._delay.sleep()
        written = outs is not None
        for k, p in enumerate(params):
            if p.grad is None:
                written = False
                continue
            gi, j = self._where[id(p)]
            opt._update(p, frozen[gi], j, 1.0 if clip is None else float(clip), None if outs is None else outs[k])
        return written

    def _work(self, frozen, resident, layers, clip) -> None:
        try:
            with torch.no_grad():
                self._update(frozen, [m for _, m in resident], clip)
                for p, master in resident:
                    if id(master) not in self._aliased:
                        p.data.copy_(master, non_blocking=True)
                    master.grad = None
                self._resident_done.set()
                for i, params in layers:
                    outs = self._outs[i]
                    if outs is not None:
                        self.handle.engine.wait_host_reads(i)  # Note: [The compute copy is written in the fused pass]
                    written = self._update(frozen, params, clip, outs)
                    for m in params:
                        m.grad = None
                    self.handle.sync_compute(i, compute_written=written)
                    self._events[i].set()
        except BaseException as e:  # surfaced to the training thread by the next wait
            self._error = e
        finally:
            self._resident_done.set()
            for ev in self._events.values():
                ev.set()

    # ------------------------------------------------------------------ waiting
    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("the layer-wise optimizer step failed") from err

    def wait_layer(self, i: int) -> None:
        ev = self._events.get(i)
        if ev is not None:
            ev.wait()
        self._raise()

    def wait_resident(self) -> None:
        self._resident_done.wait()
        self._raise()

    def wait_all(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._raise()
            self.handle.wait_uploads()
        self._raise()

    def close(self) -> None:
        try:
            self.wait_all()
        finally:
            self.handle.fetch_guard = None
            self.handle.resident_guard = None


# ---------------------------------------------------------------------- helpers
def time_streamed_layers(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device, passes: int
) -> tuple[list[float], list[float]]:
    """Median forward and backward seconds per decoder layer over ``passes`` forward+backward passes of ``model``
    streamed with the default plan (the executor's own costs included), the first pass dropped (it pays one-off
    allocation costs). Parameters and gradients are left as they were. Used by the trainer's timed warm-up and by
    `benchmarks/gpu_check.py`."""
    from .streaming import attach

    layers = models.decoder_layers(_unwrap_base(model))
    fwd: list[list[float]] = [[] for _ in layers]
    bwd: list[list[float]] = [[] for _ in layers]
    t_start: dict[tuple[str, int], float] = {}
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def clock() -> float:
        sync()
        return time.perf_counter()

    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: t_start.__setitem__(("f", i), clock())))
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: fwd[i].append(clock() - t_start["f", i])))
        hooks.append(layer.register_full_backward_pre_hook(lambda m, g, i=i: t_start.__setitem__(("b", i), clock())))
        hooks.append(
            layer.register_full_backward_hook(lambda m, gi, go, i=i: bwd[i].append(clock() - t_start["b", i]))
        )
    handle = attach(model, plan=None, device=device)
    try:
        for _ in range(passes):
            handle.causal_lm_loss(model, dict(batch)).backward()
            handle.zero_grad()
    finally:
        handle.remove()
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)

    def med(xs: list[float]) -> float:
        xs = sorted(xs[1:] if len(xs) > 1 else xs)
        return xs[len(xs) // 2] if xs else 0.0

    return [med(x) for x in fwd], [med(x) for x in bwd]


def lazytrain_card_section(plan, log_history: list[dict]) -> str:
    """Model-card section: the plan that trained the model and the throughput measured while training."""
    measured = [h for h in log_history if "tokens_per_s" in h]
    last = measured[-1] if measured else {}
    lines = [
        "## LazyTrain",
        "",
        "Trained with lazytrain_hf (layer streaming, planned activations, Hybrid 8-bit).",
        "",
        "```",
        plan.table(),
        "```",
        "",
    ]
    if last:
        lines.append(
            f"Measured: {last['tokens_per_s']:.1f} tokens/s, {last.get('tflops', 0.0):.3f} TFLOPS, "
            f"peak device memory {format_bytes(last.get('peak_device_bytes'))}."
        )
    return "\n".join(lines)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_stale_staging(run_dir: str) -> None:
    """Remove staging directories of saves that never completed (their process died)."""
    if not os.path.isdir(run_dir):
        return
    for name in os.listdir(run_dir):
        if name.startswith(STAGING_PREFIX):
            pid = name[len(STAGING_PREFIX) :]
            if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
                continue
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


# Attention implementations by what their backward saves: "eager" keeps the T x T probabilities, the fused kernels
# (sdpa, flash, flex) keep O(T) statistics like sdpa.
ATTENTION_COST_CLASS = {
    "eager": "eager",
    "sdpa": "sdpa",
    "flash_attention_2": "sdpa",
    "flash_attention_3": "sdpa",
    "flex_attention": "sdpa",
}


def attention_cost_class(config: Any) -> str:
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in ATTENTION_COST_CLASS:
        raise ValueError(
            f"attn_implementation={impl!r} is not supported by the LazyTrain planner; use one of "
            f"{', '.join(ATTENTION_COST_CLASS)} (e.g. from_pretrained(..., attn_implementation='sdpa'))."
        )
    return ATTENTION_COST_CLASS[impl]


def _available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None (not checked)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _existing_parent(path: str) -> str:
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _checkpoint_error(checkpoint: str | None, e: BaseException) -> str:
    return (
        f"could not load checkpoint {checkpoint!r}: {e}. A file in it is corrupted or truncated; resume from an "
        f"earlier checkpoint (the checkpoint-<N> directories next to it) or start without resume_from_checkpoint."
    )


def verify_checkpoint(checkpoint_dir: str) -> None:
    """Open every file a resume reads (weights, optimizer, scheduler and RNG states, trainer state, plan) without
    loading it into the model; a corrupted or truncated one raises ValueError naming the file. (`training_args.bin`
    is written by Trainer for reference only and never read back.)"""
    from safetensors import safe_open

    from .planner.plan import Plan

    for name in sorted(os.listdir(checkpoint_dir)):
        path = os.path.join(checkpoint_dir, name)
        try:
            if name.endswith(".safetensors"):
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        f.get_slice(key)  # header and offsets are checked against the file size
                size = os.path.getsize(path)
                with open(path, "rb") as fh:
                    header_len = int.from_bytes(fh.read(8), "little")
                    header = json.loads(fh.read(header_len))
                end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
                if 8 + header_len + end != size:
                    raise ValueError(f"size {size} bytes, header describes {8 + header_len + end}")
            elif name in ("optimizer.pt", "scheduler.pt", "scaler.pt") or (
                name.startswith("rng_state") and name.endswith(".pth")
            ):
                from transformers.trainer_pt_utils import safe_globals

                with safe_globals():  # the numpy RNG types Trainer's rng_state.pth holds, as Trainer loads it
                    torch.load(path, map_location="cpu", weights_only=True)
            elif name == PLAN_FILE:
                Plan.from_json(path)
            elif name.endswith(".json"):
                with open(path) as fh:
                    json.load(fh)
        except Exception as e:
            raise ValueError(
                f"checkpoint file {path} is corrupted or truncated ({type(e).__name__}: {e}); resume from an "
                f"earlier checkpoint-<N> directory or delete this one."
            ) from e


def read_plan(checkpoint_dir: str):
    """The plan saved with a checkpoint (or None). Corrupted files raise an error naming the file."""
    from .planner.plan import Plan

    path = os.path.join(checkpoint_dir, PLAN_FILE)
    if not os.path.exists(path):
        return None
    return Plan.from_json(path)


__all__ = ["LazyTrainer", "lazytrain_card_section", "read_plan"]
