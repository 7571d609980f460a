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
  device); an fp32 model computing with a bf16 copy is written from its fp32 masters, and a bf16 model's checkpoints
  carry its fp32 masters too. Resume restores them and the plan; the optimizer state is matched by parameter name.
  `training_args.bin` never holds the hub token.
- `evaluate()` / `predict()` / `streaming()`: inference with the model streamed.
- `log()`: adds throughput (tokens/s, TFLOPS), peak device memory and predicted vs measured step time.

This module is the orchestration: the Trainer overrides, which delegate to `lazytrain_hf.training` (`planning`: the
plan and the timed warm-up; `checkpoints`: what is written to disk and read back; `updater`: the layer-wise
optimizer step). Only this module and `args.py` import `transformers.Trainer`.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from .args import PLAN_FILE, LazyTrainingArguments
from .loading import weights_on_disk
from .training import (
    batches,
    checkpoints,
    contract,
    dataparallel,
    optimizer_groups,
    partitions,
    planning,
    saved_weights,
    user_access,
)
from .training.checkpoints import MASTER_FILE, STAGING_PREFIX, lazytrain_card_section, read_plan, verify_checkpoint
from .training.planning import TIMELINE_FILE, time_streamed_layers
from .training.run_trace import TRACE_FILE, untraced, write_trace
from .training.throughput import ThroughputWindow
from .training.updater import LayerwiseUpdater

logger = logging.get_logger(__name__)


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

        # Phase 2: fail early on what would not be honoured (training/contract.py).
        contract.check_construction(type(self), LazyTrainer, args, model, kwargs.get("optimizer_cls_and_kwargs"))
        super().__init__(model=model, args=args, **kwargs)
        contract.check_model(self.model, args.stream_enabled)  # also what model_init returned

        # Phase 3: LazyTrain state, filled by train().
        self.stream_handle = None
        self.lazy_plan = self.lazy_cost_model = None
        self.lazy_world_links = None  # Note: [The world's links are measured] (training/world_links.py)
        self.skipped_nonfinite_steps = 0
        self._clip_coef: float | None = None
        self._skip_step = False
        self._updater: LayerwiseUpdater | None = None
        self._preloaded_checkpoint: str | None = None
        self._resident_reduced = False
        self._window = ThroughputWindow()
        self._n_params: int | None = None
        self._plan_from_file = False
        self._best_pending = False
        self._previous_optimizer: torch.optim.Optimizer | None = None
        self._prebuilt_optimizer: torch.optim.Optimizer | None = None  # Note: [create_optimizer() before train()]
        self._dp: dataparallel.PartitionedDataParallel | None = None  # data parallel: the state partitioned by unit
        self._partitions: partitions.PartitionCheckpoints | None = None  # and its checkpoints
        self._legacy_group_names: list[list[str]] | None = None  # Note: [Optimizer state is matched by parameter name]
        self._longer_batch_seen = False  # Note: [The plan is made for the longest batch] (warned once for a plan file)
        # Notes: [Callbacks see the updated weights], [In-place edits of weights are folded into the masters]
        user_access.guard_callbacks(self.callback_handler, lambda: self._updater)

    # ------------------------------------------------------------------ train()
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any):
        if not self.args.stream_enabled:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        from .streaming import attach

        self._best_pending = False
        model_init = self.model_init
        if model_init is not None:
            self._init_trial_model(trial)  # Note: [model_init builds each trial's model before it is planned]
        # Note: [The optimizer outlives train()]: ours from an earlier train() seeds the next one's state
        if self.optimizer is not None and self.optimizer is self._previous_optimizer:
            self.optimizer = None
        elif self.optimizer is not None and self.optimizer is self._prebuilt_optimizer:
            self.optimizer = None  # Note: [create_optimizer() before train()]
        contract.check_given_optimizer(self.optimizer)
        checkpoint = checkpoints.resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if self.args.world_size > 1:
            partitions.check_partitioned_args(self.args, self.model)
        self.check_host_memory(None)  # the model's own state, before a warm-up or a solve allocates anything
        plan = None
        if checkpoint is not None:
            verify_checkpoint(checkpoint, self.model)
            # weights go in before the host store is built from them; the plan is the one that trained them
            self._load_from_checkpoint(checkpoint)
            self._preloaded_checkpoint = checkpoint
            plan = read_plan(checkpoint)
            if plan is not None:
                plan.state_nvme = []  # placed again below, for this run's budget and state_nvme_dir
                self.lazy_plan = plan
                if self.args.planner_auto_batch_size:
                    self._adopt_batch_size(plan)  # the batch size the plan chose when training started
                self.check_plan_fits(plan, where=checkpoint, check_batch=False)
        if plan is None and self.args.planner_plan is not None:
            plan = self.load_plan_file(self.args.planner_plan)
            self.check_plan_fits(plan, where=self.args.planner_plan)
        if plan is None:
            plan = self._plan_on_rank_zero()
        # which streamed units keep their training state on NVMe (state_nvme_dir): decided for this machine's budget,
        # unless a plan file says (planner_plan is executed as is)
        if not self._plan_from_file:
            planning.place_state(
                plan,
                self.model,
                self.args,
                hybrid_8bit=self.args.optim_hybrid_8bit,
                compute_dtype=self._compute_dtype(),
            )
        # Note: [The trace is the planner's referee]: what the trace must show, in the plan written to output_dir
        planning.predict_bytes(plan, self.model, self.args, self._compute_dtype(), batch=self._sample_batch())
        if self.args.should_save:
            checkpoints.write_plan(plan, self.args.output_dir)
        self.check_host_memory(plan)  # before the host store allocates anything
        self.stream_handle = attach(
            self.model,
            plan=plan,
            device=self.args.device,
            nvme_dir=self.args.activation_nvme_dir,
            compute_dtype=self._compute_dtype(),
            **self._state_nvme_kwargs(),
            **self._partition_kwargs(plan),
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
            # Note: [fp32 masters in checkpoints] in training/checkpoints.py
            masters_in_weights = set(saved_weights.cast_overrides(self.stream_handle))
            checkpoints.restore_masters(checkpoint, self.stream_handle, self._updater, "store", masters_in_weights)
            # Note: [Squared norms of accumulated gradients] in streaming/gradients.py: norms (and, in data
            # parallel, reductions) only on the last micro-batch of an optimizer step, as Trainer's gradient state says
            self.stream_handle.last_micro_batch = lambda: self.accelerator.sync_gradients
            if self._dp is not None:  # Note: [The training state is partitioned by unit] (dataparallel.py)
                self._dp.bind(self.stream_handle)
                self._partitions = partitions.PartitionCheckpoints(self.stream_handle, self._dp)
            self.model_init = None  # Trainer.train() would build another model than the one streamed
            result = super().train(resume_from_checkpoint=checkpoint, trial=trial, **kwargs)
            if self._dp is not None and self._updater is not None:
                self._dp.gather_masters(self.stream_handle, self._updater)  # before remove() gives them back
        except Exception as e:
            if self._partitions is not None:
                self._partitions.check_error(e)  # Note: [A failed rank is named] in training/partitions.py
            raise
        finally:
            self._partitions = None
            self.model_init = model_init
            with contextlib.suppress(AttributeError):
                del self.model._is_accelerate_prepared
            self._preloaded_checkpoint = None
            if self._updater is not None:
                self._updater.close()
                self._updater = None
                self._previous_optimizer = self.optimizer  # Note: [The optimizer outlives train()]
            if self.stream_handle.trace.step_index <= self.args.stream_trace_steps:
                self._write_trace()  # a run of at most stream_trace_steps steps (its updates are complete now)
            handle, self.stream_handle = self.stream_handle, None
            handle.remove()
            dp, self._dp = self._dp, None
            dp is not None and dp.close()  # the node copy, once no parameter points into it
        if self._best_pending:
            # Note: [The best model is loaded into the unstreamed model]
            self._best_pending = False
            self._load_best_now()
        return result

    def _init_trial_model(self, trial: Any) -> None:
        """Note: [model_init builds each trial's model before it is planned]
        `Trainer.train()` would call ``model_init`` after the executor was attached to the previous model (the new
        one then computes the loss, the old one is updated): it is built here first, as Trainer builds it, and
        Trainer builds no other. Each trial gets its own plan, host store and optimizer."""
        from transformers.trainer_utils import enable_full_determinism, set_seed

        self._hp_search_setup(trial)  # the trial's hyperparameters (a batch size the plan must know) first
        enable_full_determinism(self.args.seed) if self.args.full_determinism else set_seed(self.args.seed)
        self.model = self.call_model_init(trial)
        contract.check_model(self.model, self.args.stream_enabled)
        self.model_wrapped = self.model
        self.optimizer, self.lr_scheduler = None, None
        self._previous_optimizer = self._prebuilt_optimizer = None
        self.lazy_plan, self.lazy_cost_model, self._n_params = None, None, None

    def _load_best_model(self) -> None:
        """Note: [The best model is loaded into the unstreamed model]
        `load_best_model_at_end` loads the best checkpoint's weights into the model at the end of `Trainer.train`,
        while the executor is still attached: resident layers would take them into their device slot only, and
        `remove()` would put the last step's host copy back. The load is therefore deferred until the executor is
        removed, so every weight is the best checkpoint's."""
        if self.stream_handle is not None:
            self._best_pending = True
            return
        self._load_best_now()

    def _load_best_now(self) -> None:
        best = self.state.best_model_checkpoint
        # Note: [Checkpoint weights in the saved format] in training/checkpoints.py (MoE experts saved per expert)
        if best is not None and checkpoints.load_checkpoint_weights(best, self.model):
            logger.info(f"Loaded best model from {best} (score: {self.state.best_metric}).")
            return
        super()._load_best_model()

    # ------------------------------------------------------------------ planning (lazytrain_hf.training.planning)
    def make_plan(self):
        """Profile -> warm-up timings -> plan, per `args.planner_*`. Saves the plan (JSON + timeline) to output_dir."""
        plan, cost_model = planning.make_plan(self.model, self.args, self._sample_batch(), self.lazy_world_links)
        self.lazy_plan = plan
        if cost_model is not None:  # profiled and planned (not the default plan)
            self.lazy_cost_model = cost_model
            if self.args.planner_auto_batch_size:
                self._adopt_batch_size(plan)
            if self.args.should_save:
                planning.save_plan(plan, cost_model, self.args.output_dir)
        return plan

    def _plan_on_rank_zero(self):
        """Note: [One plan for every rank]
        In data parallel only rank 0 profiles, warms up and solves; the plan (with the batch size it chose) is
        broadcast and every rank executes it, so all ranks stream the same way and keep the same batch size. A
        planning error on rank 0 is raised on every rank instead of leaving the others waiting."""
        self.lazy_world_links = planning.measure_world_links(self.args)  # every rank: rank 0 plans with them
        plan, received = planning.plan_on_rank_zero(self.make_plan, self.args.world_size)
        if not received:
            return plan  # made here by make_plan()
        self.lazy_plan = plan
        if self.args.planner_auto_batch_size:
            self._adopt_batch_size(plan)
        return plan

    def load_plan_file(self, path: str):
        """The plan `planner_plan` names, executed as is (no profile, warm-up or solve); saved to output_dir."""
        plan = planning.load_plan_file(path, self.args.output_dir if self.args.should_save else None)
        self._plan_from_file = True
        self.lazy_plan = plan
        return plan

    def check_plan_fits(self, plan, where: str | None = None, check_batch: bool = True) -> None:
        """Refuse, before anything is attached, a plan made for another model or (``check_batch``) another
        micro-batch size, or one that needs a directory the arguments do not give."""
        planning.check_plan_fits(plan, self.model, self.args, where=where, check_batch=check_batch)

    def check_host_memory(self, plan) -> None:
        """Refuse, before anything is allocated, a run whose whole host footprint (`planning.host_footprint`) would
        not fit ``planner_host_budget`` (default: the available RAM minus a reserve), with every term and what would
        fit. ``plan`` None: the default plan, checked before the warm-up and the solve allocate anything."""
        planning.check_host_memory(
            plan,
            self.model,
            hybrid_8bit=self.args.optim_hybrid_8bit,
            compute_dtype=self._compute_dtype(),
            args=self.args,
        )

    def _state_nvme_kwargs(self) -> dict[str, Any]:
        return dict(
            state_nvme_dir=self.args.state_nvme_dir,
            optim_block_size=self.args.optim_block_size,
            optim_min_8bit_size=self.args.optim_min_8bit_size,
        )

    def _compute_dtype(self) -> torch.dtype | None:
        """``bf16=True`` with fp32 parameters: compute with a bf16 copy, fp32 masters on the host (as a bf16-loaded
        model trains, the optimizer on fp32 masters). Accelerate's autocast never applies to the streamed model
        (Note: [The executor owns placement]), so this is what bf16 means here."""
        if not self.args.bf16:
            return None
        fp32 = any(p.dtype == torch.float32 for p in self.model.parameters())
        return torch.bfloat16 if fp32 else None

    def measure_layer_times(self, batch: dict[str, torch.Tensor], steps: int) -> tuple[list[float], list[float]]:
        """Median forward and backward seconds per decoder layer over `steps` timed forward+backward passes, every
        RNG state and the train/eval mode restored (`planning.measure_layer_times`)."""
        return planning.measure_layer_times(self.model, batch, self.args.device, steps)

    def _sample_batch(self) -> dict[str, torch.Tensor]:
        """The longest collated training micro-batch the data can produce (its longest rows), taken without touching
        the training dataloader's RNG."""
        if self.train_dataset is None:
            raise ValueError("LazyTrainer.train() needs a train_dataset to plan and train.")
        # Note: [The plan is made for the longest batch] in training/batches.py (an iterable dataset: its first rows)
        rows = batches.sample_rows(self.train_dataset, self.args.per_device_train_batch_size)
        if not rows:
            raise ValueError("train_dataset is empty; pass a dataset with at least one row.")
        dl = self.get_train_dataloader()  # only for its collator (column removal included)
        batch = dl.collate_fn(rows) if hasattr(dl, "collate_fn") else self.data_collator(rows)
        return self._prepare_inputs(batch)

    def _adopt_batch_size(self, plan) -> None:
        a = self.args
        if plan.micro_batch_size != a.per_device_train_batch_size:
            logger.warning(f"planner_auto_batch_size: training with micro-batch size {plan.micro_batch_size}.")
            a.per_device_train_batch_size = plan.micro_batch_size
            self._train_batch_size = a.train_batch_size

    # ------------------------------------------------------------------ resume, placement, data parallel
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self.stream_handle is not None and resume_from_checkpoint == self._preloaded_checkpoint:
            return  # loaded before the executor was attached
        # Note: [Checkpoint weights in the saved format] in training/checkpoints.py
        if checkpoints.load_checkpoint_weights(resume_from_checkpoint, self.model if model is None else model):
            return
        try:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        except Exception as e:
            raise ValueError(checkpoints.checkpoint_error(resume_from_checkpoint, e)) from e

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # Note: [Optimizer state is matched by parameter name] in training/optimizer_groups.py
        written_streamed = checkpoint is not None and os.path.exists(os.path.join(checkpoint, PLAN_FILE))
        by_name = optimizer_groups.load_by_name(
            self.optimizer, checkpoint, self.stream_handle is not None, self._legacy_group_names, written_streamed
        )
        # Note: [A checkpoint of a partitioned state] in training/partition_files.py: any world size
        if self._dp is not None or partitions.is_partitioned(checkpoint):
            by_name = partitions.load_by_name(self.optimizer, checkpoint)
        try:
            with by_name:
                super()._load_optimizer_and_scheduler(checkpoint)
        except optimizer_groups.OptimizerStateMismatch:
            raise
        except Exception as e:
            raise ValueError(checkpoints.checkpoint_error(checkpoint, e)) from e
        if checkpoint is not None and self.optimizer is not None:
            # Note: [Checkpoints of the state on NVMe] in training/checkpoints.py
            checkpoints.restore_nvme_optimizer_state(checkpoint, self.stream_handle, self._updater, self.optimizer)

    def _move_model_to_device(self, model, device) -> None:
        if self.args.stream_enabled:
            return  # Note: [The executor owns placement]
        super()._move_model_to_device(model, device)

    def _partition_kwargs(self, plan) -> dict[str, Any]:
        """Note: [The training state is partitioned by unit]: each rank holds its own units' training state."""
        if self.args.world_size <= 1:
            return {}
        self._dp = dataparallel.PartitionedDataParallel.for_run(self.model, plan, self.args, self._compute_dtype())
        return self._dp.attach_kwargs()

    def _reduce_resident_grads(self) -> None:
        """The resident parameters' gradients averaged over the ranks, once per optimizer step (before the norm)."""
        if self._dp is None or self.stream_handle is None or self._resident_reduced:
            return
        self._dp.reduce_resident(self.stream_handle)
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

        handle = attach(
            self.model,
            plan=self.lazy_plan,
            device=self.args.device,
            compute_dtype=self._compute_dtype(),
            **self._state_nvme_kwargs(),
        )
        self.model._is_accelerate_prepared = True
        try:
            yield handle
        finally:
            with contextlib.suppress(AttributeError):
                del self.model._is_accelerate_prepared
            handle.remove()

    def evaluate(self, *args: Any, **kwargs: Any):
        with self.streaming() as handle, untraced(handle):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any):
        with self.streaming() as handle, untraced(handle):
            return super().predict(*args, **kwargs)

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        if (
            self.stream_handle is None
            or return_outputs
            or self.label_smoother is not None
            or (self.compute_loss_func is not None)
            or contract.custom_forward(model) is not None  # a user's forward (override or wrapper) must run
        ):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if model.training and not self._longer_batch_seen:  # Note: [The plan is made for the longest batch]
            plan = self.stream_handle.plan
            self._longer_batch_seen = batches.check_batch_planned(plan, inputs, from_file=self._plan_from_file)
        mask = inputs.get("attention_mask")
        self._window.count(mask.sum() if mask is not None else inputs["input_ids"].numel())
        loss = self.stream_handle.causal_lm_loss(
            model,
            inputs,
            num_items_in_batch=num_items_in_batch,
            aux_loss_weight=self._router_aux_weight(num_items_in_batch),
        )
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes
        return loss

    def _router_aux_weight(self, num_items_in_batch: Any) -> float | None:
        """The weight of a MoE model's router auxiliary loss in the chunked loss; None: the model's own
        ``router_aux_loss_coef``, added as its ``*ForCausalLM.forward`` adds it (what Trainer trains). Subclasses
        whose reference weighs it otherwise (TRL's SFT) override this."""
        return None

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, model=None):
        """`HybridAdamW8bit` (or, with `optim_hybrid_8bit=False` while streaming, torch AdamW) over the host fp32
        master weights when streaming, over the model's parameters otherwise; Trainer's decay / no-decay groups."""
        if not self.args.optim_hybrid_8bit:  # streaming implies it (LazyTrainingArguments)
            return super().create_optimizer(model)
        if self.optimizer is not None:
            return self.optimizer
        model = model if model is not None else self.model
        prebuilt, self._prebuilt_optimizer = self._prebuilt_optimizer, None
        decay = set(self.get_decay_parameter_names(model))
        if self.stream_handle is not None:
            self._updater = LayerwiseUpdater(self.stream_handle, self._overlap_enabled(), data_parallel=self._dp)
            ckpt, in_weights = self._preloaded_checkpoint, set(saved_weights.cast_overrides(self.stream_handle))
            checkpoints.restore_masters(ckpt, self.stream_handle, self._updater, "resident", in_weights)
            named = self._updater.named_masters()
        else:
            named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        # Note: [Optimizer state is matched by parameter name] in training/optimizer_groups.py
        order = [name for name, _ in model.named_parameters()]
        param_groups, self._legacy_group_names = optimizer_groups.decay_groups(
            named, decay, self.args.weight_decay, order
        )
        from .optim import HybridAdamW8bit

        opt = HybridAdamW8bit(
            param_groups,
            lr=self.args.learning_rate,
            betas=(self.args.adam_beta1, self.args.adam_beta2),
            eps=self.args.adam_epsilon,
            block_size=self.args.optim_block_size,
            min_8bit_size=self.args.optim_min_8bit_size,
        )
        # Note: [create_optimizer() before train()]
        self._prebuilt_optimizer = contract.prebuilt_optimizer(opt, prebuilt, self.args, self.stream_handle)
        if self.stream_handle is not None:
            self._updater.bind(opt)
            previous, self._previous_optimizer = self._previous_optimizer, None
            if previous is not None:
                # Note: [The optimizer outlives train()]
                # After train() the optimizer stays (`trainer.optimizer`, as with Trainer) over the masters of the
                # host store it trained; the next train() builds the store anew and continues from its state (a
                # checkpoint given to resume_from_checkpoint is loaded over it afterwards, as Trainer does).
                opt.load_state_dict(previous.state_dict())
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
                    self._end_trace_step()

        opt.step = step

    def _end_trace_step(self) -> None:
        """The optimizer step was issued: close it in the executor's trace, and write `TRACE_FILE` once the first
        ``stream_trace_steps`` steps are complete (Note: [The trace is the planner's referee])."""
        trace = self.stream_handle.trace
        trace.end_step()
        # one step later: an overlapped update (and its uploads) of step N is complete once step N + 1 was issued
        if trace.step_index == self.args.stream_trace_steps + 1:
            self._write_trace()

    def _write_trace(self) -> None:
        if self.stream_handle is not None and self.is_world_process_zero():
            write_trace(self.stream_handle.trace, self.args.output_dir, self.args.stream_trace_steps)

    def _uses_default_optimizer(self) -> bool:
        return not self.args.optim_hybrid_8bit

    def _grad_norm_now(self, model) -> float:
        self._reduce_resident_grads()
        if self._dp is not None:
            return self._dp.global_grad_norm(self.stream_handle)  # Note: [The global norm of a partitioned state]
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
        out = self._window.logs(self.state.global_step, self._param_count, self.lazy_plan)
        stats = self.stream_handle.memory_stats()
        out["peak_device_bytes"] = int(stats.get("device_peak_bytes", 0))
        self.stream_handle.reset_peak()
        return out

    def _param_count(self) -> int:
        if self._n_params is None:
            self._n_params = sum(p.numel() for p in self.model.parameters())
        return self._n_params

    # ------------------------------------------------------------------ saving
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self._updater is not None:
            self._updater.wait_all()  # weights of every layer updated before they are written
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        streamed = self.stream_handle is not None or weights_on_disk(self.model)  # e.g. units left on NVMe by train()
        if streamed and state_dict is None and checkpoints.streams_weights(self.model):
            # Note: [Checkpoints are streamed from the host store] in training/checkpoints.py: streamed parameters
            # point at their host copy while unbound, so the weights are written from it layer by layer, never
            # gathered on the device nor copied whole; the rest as Trainer._save writes it. With the state
            # partitioned, every rank takes part (Note: [A checkpoint of a partitioned state])
            from transformers.trainer import TRAINING_ARGS_NAME

            tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
            parts, handle = self._partitions, self.stream_handle
            partitions.save_weights(self.model, output_dir, self.args, TRAINING_ARGS_NAME, handle, tokenizer, parts)
        else:
            super()._save(output_dir, state_dict=state_dict)
        if self.args.should_save and self.lazy_plan is not None:
            checkpoints.write_plan(self.lazy_plan, output_dir)

    def _save_checkpoint(self, model, trial) -> None:
        """Let Trainer write the checkpoint into a staging directory, add the fp32 masters and rename it into place
        when complete (Note: [Atomic checkpoints] in training/checkpoints.py)."""
        run_dir = self._get_output_dir(trial=trial)
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        parts = self._partitions  # Note: [A checkpoint of a partitioned state] in training/partition_files.py
        staging_root = parts.shared_staging(run_dir) if parts is not None else checkpoints.staging_dir(run_dir)
        if self.args.should_save and parts is None:
            checkpoints.remove_stale_staging(run_dir)
        original = self._get_output_dir
        self._get_output_dir = lambda trial=None: staging_root  # super() writes staging_root/checkpoint-N
        try:
            with parts.resident_optimizer_only(self._updater) if parts is not None else contextlib.nullcontext():
                super()._save_checkpoint(model, trial)
        finally:
            self._get_output_dir = original
        if parts is not None:
            parts.complete(staging_root, final, self._updater)  # every rank's partition, then published
        elif self.args.should_save:  # fp32 masters, state on NVMe, renamed into place (Note: [Atomic checkpoints])
            checkpoints.complete_checkpoint(staging_root, final, self.stream_handle, self._updater)
        if not self.args.should_save:
            return
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
        if self.args.should_save and self.lazy_plan is not None:
            checkpoints.append_card_section(
                os.path.join(self.args.output_dir, "README.md"), self.lazy_plan, self.state.log_history
            )


# Also importable from here; their homes are in `lazytrain_hf.training`. Patch a function in the module that calls
# it (its home), not here.
__all__ = [
    "MASTER_FILE",
    "PLAN_FILE",
    "STAGING_PREFIX",
    "TIMELINE_FILE",
    "TRACE_FILE",
    "LayerwiseUpdater",
    "LazyTrainer",
    "lazytrain_card_section",
    "read_plan",
    "time_streamed_layers",
    "verify_checkpoint",
]
