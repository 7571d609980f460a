"""Correct under every plan: the plans a solver can emit, trained through `LazyTrainer(planner_plan=...)` under the
simulated asynchronous CPU engine, are bit-exact to the keep-all, no-overlap run on the synchronous engine.

The input space (hypothesis): per layer policy and input tier (nvme included), residency, ``fetch_fwd_ahead`` /
``fetch_bwd_ahead`` / ``reload_ahead`` in 0..3; ``stream_embeddings``, ``state_nvme`` (any streamed, non-resident
units' training state on NVMe), ``checkpoint_every`` (1, or K with every
layer recomputed), ``loss_chunk_tokens``, ``optimizer_overlap``, ``gradient_accumulation_steps`` 1..3, the model
dtype and the compute dtype (an fp32 model computed with a bf16 copy, ``bf16=True``), what is frozen (nothing, some
decoder layers and perhaps the embedding, or the base of a PEFT LoRA model), over six model families. The oracle: the ``keep_all`` plan (every activation kept, every layer streamed,
prefetch 1, no overlap) with the same settings that change a summation order (``stream_embeddings``,
``loss_chunk_tokens``) and the same data (gradient accumulation, dtype), trained on the synchronous CPU engine.
Compared: every micro-batch loss and every final weight and fp32 master, with ``torch.equal``; and every frozen
parameter against its value before training, with ``torch.equal`` (Note: [A frozen parameter keeps its own values]).

The regression tests below each failed before their fix (see the closing note of the change that added them).
"""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch
from conftest import tiny_model
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from trainer_fixtures import token_dataset
from transformers import TrainerCallback

from lazytrain_hf import LazyTrainer, LazyTrainingArguments, models
from lazytrain_hf.planner.plan import BLOCK_GRAPHS, INPUT_TIERS, POLICIES, LayerPlan, Plan
from lazytrain_hf.streams import SIMULATE_ENV

FAMILIES = ["qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"]
STEPS = 3
MICRO_BATCH = 2


# ---------------------------------------------------------------------------------------------------------- runs
def write_plan(plan: Plan, directory: str) -> str:
    path = os.path.join(directory, "plan.json")
    plan.to_json(path)
    return path


NOTHING_FROZEN = ("none",)


def build_model(model_type: str, dtype: torch.dtype, frozen: tuple = NOTHING_FROZEN) -> torch.nn.Module:
    """The tiny model in ``dtype`` with ``frozen``: ``("none",)``, ``("layers", indices, embedding_too)`` (those
    decoder layers, and the input embedding, ``requires_grad_(False)``) or ``("peft",)`` (LoRA on q/v: the base is
    frozen)."""
    model = tiny_model(model_type, seed=1).to(dtype)
    if frozen[0] == "layers":
        _, indices, embedding = frozen
        for i in indices:
            models.decoder_layers(model)[i].requires_grad_(False)
        if embedding:
            models.embed_tokens(model).requires_grad_(False)
    elif frozen[0] == "peft":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(5)
        cfg = LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = get_peft_model(model, cfg)
        for p in model.parameters():
            if p.requires_grad:  # LoRA's B starts at zero: a non-zero start makes the adapters matter from step 1
                torch.nn.init.normal_(p, std=0.02)
    return model


def train_plan(
    model_type: str,
    plan: Plan,
    ga: int,
    dtype: torch.dtype,
    simulate: bool,
    callbacks=(),
    frozen: tuple = NOTHING_FROZEN,
    bf16_compute: bool = False,
    **extra,
):
    """Train ``STEPS`` optimizer steps under ``plan``; returns (micro-batch losses, final weights, fp32 masters).

    ``frozen`` (`build_model`) and ``bf16_compute`` (``bf16=True``: an fp32 model computed with a bf16 copy) choose
    what is frozen and the compute dtype; every frozen parameter must be bit-identical to its value before training
    (Note: [A frozen parameter keeps its own values] in streaming/store.py)."""
    prev = os.environ.get(SIMULATE_ENV)
    os.environ[SIMULATE_ENV] = "1" if simulate else "0"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            os.makedirs(os.path.join(tmp, "nvme"))
            model = build_model(model_type, dtype, frozen)
            before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
            args = LazyTrainingArguments(
                output_dir=os.path.join(tmp, "out"),
                per_device_train_batch_size=plan.micro_batch_size,
                gradient_accumulation_steps=ga,
                max_steps=STEPS,
                learning_rate=1e-2,
                max_grad_norm=1.0,
                logging_steps=1,
                report_to=[],
                seed=5,
                data_seed=5,
                use_cpu=True,
                save_strategy="no",
                planner_plan=write_plan(plan, tmp),
                activation_nvme_dir=os.path.join(tmp, "nvme"),
                state_nvme_dir=os.path.join(tmp, "nvme"),  # for the plan's state_nvme units
                bf16=bf16_compute,
                **extra,
            )
            n = STEPS * ga * plan.micro_batch_size
            trainer = LazyTrainer(
                model=model, args=args, train_dataset=token_dataset(n=n, T=10), callbacks=list(callbacks)
            )
            losses: list[torch.Tensor] = []
            masters: dict[str, torch.Tensor] = {}
            inner = trainer.compute_loss

            def compute_loss(*a, **k):
                loss = inner(*a, **k)
                losses.append(loss.detach().clone())
                return loss

            trainer.compute_loss = compute_loss

            class MasterCapture(TrainerCallback):
                def on_train_end(self, args, state, control, **kwargs):
                    trainer._updater.wait_all()
                    masters.update({k: m.detach().clone() for k, m in trainer._updater.master_values().items()})

            trainer.add_callback(MasterCapture())
            trainer.train()
            after = dict(model.named_parameters())
            changed = [n for n, v in before.items() if not torch.equal(after[n].detach(), v)]
            assert not changed, f"{len(changed)} of {len(before)} frozen parameters changed, first {changed[:5]}"
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            return losses, weights, masters
    finally:
        if prev is None:
            os.environ.pop(SIMULATE_ENV, None)
        else:
            os.environ[SIMULATE_ENV] = prev


def keep_all_plan(kinds: list[str], stream_embeddings: bool, loss_chunk_tokens: int) -> Plan:
    return Plan(
        layers=[LayerPlan(index=i, kind=k) for i, k in enumerate(kinds)],
        micro_batch_size=MICRO_BATCH,
        seq_len=10,
        stream_embeddings=stream_embeddings,
        loss_chunk_tokens=loss_chunk_tokens,
        source="file",
        optimizer_overlap=False,
    )


@functools.cache
def reference(
    model_type: str,
    stream_embeddings: bool,
    loss_chunk_tokens: int,
    ga: int,
    dtype: torch.dtype,
    frozen: tuple = NOTHING_FROZEN,
    bf16_compute: bool = False,
):
    kinds = models.layer_kinds(tiny_model(model_type).config)
    plan = keep_all_plan(kinds, stream_embeddings, loss_chunk_tokens)
    return train_plan(model_type, plan, ga, dtype, False, frozen=frozen, bf16_compute=bf16_compute)


def assert_bit_exact(got, ref, what: str) -> None:
    losses, weights, masters = got
    ref_losses, ref_weights, ref_masters = ref
    assert len(losses) == len(ref_losses), (what, len(losses), len(ref_losses))
    bad = [(i, float(a), float(b)) for i, (a, b) in enumerate(zip(losses, ref_losses)) if not torch.equal(a, b)]
    assert not bad, f"{what}: micro-batch losses differ (index, got, reference): {bad[:5]}"
    assert sorted(weights) == sorted(ref_weights)
    bad_w = [k for k in ref_weights if not torch.equal(weights[k], ref_weights[k])]
    assert not bad_w, f"{what}: {len(bad_w)} final weights differ, first {bad_w[:5]}"
    assert sorted(masters) == sorted(ref_masters)
    bad_m = [k for k in ref_masters if not torch.equal(masters[k], ref_masters[k])]
    assert not bad_m, f"{what}: {len(bad_m)} fp32 masters differ, first {bad_m[:5]}"


# ---------------------------------------------------------------------------------------------------------- plans
@st.composite
def plans(draw, kinds: list[str]) -> Plan:
    L = len(kinds)
    block = draw(st.sampled_from([1, 1, 2, 3]))
    layers = []
    for i, kind in enumerate(kinds):
        if block > 1:
            policy, tier = "recompute", "gpu"
        else:
            policy = draw(st.sampled_from(POLICIES))
            tier = draw(st.sampled_from(INPUT_TIERS)) if policy == "recompute" else "gpu"
        layers.append(
            LayerPlan(
                index=i,
                kind=kind,
                policy=policy,
                input_tier=tier,
                resident=draw(st.booleans()),
                fetch_fwd_ahead=draw(st.integers(0, 3)),
                fetch_bwd_ahead=draw(st.integers(0, 3)),
                reload_ahead=draw(st.integers(0, 3)),
            )
        )
    assert len(layers) == L
    stream_embeddings = draw(st.booleans())
    # units whose training state lives on NVMe (lazytrain_hf.streaming.nvmestate): any streamed, non-resident ones
    units = [lp.index for lp in layers if not lp.resident] + ([-1, L] if stream_embeddings else [])
    state_nvme = sorted(draw(st.lists(st.sampled_from(units), unique=True))) if units else []
    return Plan(
        layers=layers,
        micro_batch_size=MICRO_BATCH,
        seq_len=10,
        stream_embeddings=stream_embeddings,
        state_nvme=state_nvme,
        loss_chunk_tokens=draw(st.sampled_from([7, 1024])),
        source="file",
        checkpoint_every=block,
        block_graphs=draw(st.sampled_from(BLOCK_GRAPHS)) if block > 1 else "block",
        optimizer_overlap=draw(st.booleans()),
    )


@st.composite
def frozen_parts(draw, num_layers: int) -> tuple:
    """What is frozen (`build_model`): nothing, some decoder layers (and perhaps the embedding), or a PEFT base."""
    kind = draw(st.sampled_from(["none", "layers", "peft"]))
    if kind == "layers":
        indices = draw(st.lists(st.integers(0, num_layers - 1), min_size=1, max_size=num_layers - 1, unique=True))
        return ("layers", tuple(sorted(indices)), draw(st.booleans()))
    return (kind,)


@st.composite
def cases(draw):
    model_type = draw(st.sampled_from(FAMILIES))
    kinds = models.layer_kinds(tiny_model(model_type).config)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return (
        model_type,
        draw(plans(kinds)),
        draw(st.integers(1, 3)),
        dtype,
        draw(frozen_parts(len(kinds))),
        dtype == torch.float32 and draw(st.booleans()),  # bf16 compute of the fp32 model
    )


def check_case(case) -> None:
    model_type, plan, ga, dtype, frozen, bf16_compute = case
    event(f"frozen={frozen[0]}, compute={'bf16 copy' if bf16_compute else dtype}")  # --hypothesis-show-statistics
    ref = reference(model_type, plan.stream_embeddings, plan.loss_chunk_tokens, ga, dtype, frozen, bf16_compute)
    got = train_plan(model_type, plan, ga, dtype, simulate=True, frozen=frozen, bf16_compute=bf16_compute)
    what = f"{model_type} ga={ga} {dtype} frozen={frozen} bf16_compute={bf16_compute} plan:\n{plan.table()}"
    assert_bit_exact(got, ref, what)


_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None)


@settings(max_examples=8, **_SETTINGS)
@given(cases())
def test_plan_space_bit_exact(case):
    check_case(case)


@pytest.mark.slow
@settings(max_examples=80, **{**_SETTINGS, "derandomize": False})
@given(cases())
def test_plan_space_bit_exact_large(case):
    check_case(case)


# ---------------------------------------------------------------------------------------------------------- regressions
def resident_plan(kinds: list[str], overlap: bool, resident=(1, 2, 3)) -> Plan:
    """The shape of the recipe's own plan: most layers resident, the CPU optimizer overlapping the next forward."""
    plan = keep_all_plan(kinds, False, 1024)
    for i in resident:
        plan.layers[i].resident = True
    plan.optimizer_overlap = overlap
    return plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resident_layers_with_overlap_bit_exact(async_engine, dtype):
    """Update-before-fetch holds for resident layers: their forward waits for the layer's update and its upload."""
    kinds = models.layer_kinds(tiny_model("qwen3").config)
    ref = reference("qwen3", False, 1024, 1, dtype)
    got = train_plan("qwen3", resident_plan(kinds, overlap=True), 1, dtype, simulate=True)
    assert_bit_exact(got, ref, f"resident layers 1-3, optimizer overlap, {dtype}")


def test_weights_read_between_steps_are_updated(async_engine):
    """A callback reading the model after a step (no overlap) sees every resident layer's uploaded update."""
    kinds = models.layer_kinds(tiny_model("qwen3").config)

    def snapshots(plan: Plan, simulate: bool) -> list[dict[str, torch.Tensor]]:
        seen: list[dict[str, torch.Tensor]] = []

        class Snap(TrainerCallback):
            def on_step_end(self, args, state, control, model=None, **kwargs):
                seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})

        train_plan("qwen3", plan, 1, torch.bfloat16, simulate, callbacks=[Snap()])
        return seen

    ref = snapshots(keep_all_plan(kinds, False, 1024), simulate=False)
    got = snapshots(resident_plan(kinds, overlap=False), simulate=True)
    assert len(got) == len(ref) == STEPS
    for step, (a, b) in enumerate(zip(got, ref)):
        bad = [k for k in b if not torch.equal(a[k], b[k])]
        assert not bad, f"after step {step + 1}: {bad[:5]} differ from the synchronous keep-all run"


def test_evaluation_during_training_waits_for_updates(async_engine):
    """evaluate() at every step, with the update of the step still running in the background, sees updated weights."""
    kinds = models.layer_kinds(tiny_model("qwen3").config)
    eval_ds = token_dataset(n=4, T=10, seed=9)

    def eval_losses(plan: Plan, simulate: bool) -> list[float]:
        prev = os.environ.get(SIMULATE_ENV)
        with tempfile.TemporaryDirectory() as tmp:
            os.environ[SIMULATE_ENV] = "1" if simulate else "0"
            try:
                args = LazyTrainingArguments(
                    output_dir=tmp,
                    per_device_train_batch_size=MICRO_BATCH,
                    per_device_eval_batch_size=2,
                    max_steps=STEPS,
                    learning_rate=1e-2,
                    report_to=[],
                    seed=5,
                    data_seed=5,
                    use_cpu=True,
                    save_strategy="no",
                    eval_strategy="steps",
                    eval_steps=1,
                    planner_plan=write_plan(plan, tmp),
                )
                tr = LazyTrainer(
                    model=tiny_model("qwen3", seed=1),
                    args=args,
                    train_dataset=token_dataset(n=STEPS * MICRO_BATCH, T=10),
                    eval_dataset=eval_ds,
                )
                tr.train()
            finally:
                os.environ[SIMULATE_ENV] = prev if prev is not None else "0"
            return [h["eval_loss"] for h in tr.state.log_history if "eval_loss" in h]

    ref = eval_losses(keep_all_plan(kinds, False, 1024), simulate=False)
    got = eval_losses(resident_plan(kinds, overlap=True, resident=(0, 1, 2, 3)), simulate=True)
    assert len(got) == len(ref) == STEPS
    assert got == ref, (got, ref)


def test_updater_synchronizes_what_it_reads(async_engine, monkeypatch):
    """`LayerwiseUpdater.run` waits for the gradient copies itself (nothing else synchronises first here)."""
    from lazytrain_hf.streams import MAX_DELAY_ENV

    monkeypatch.setenv(MAX_DELAY_ENV, "0.05")  # copies lag well behind the end of backward
    from conftest import tiny_model as build

    from lazytrain_hf.optim import HybridAdamW8bit
    from lazytrain_hf.streaming import attach
    from lazytrain_hf.trainer import LayerwiseUpdater

    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))

    def masters_after_step(simulate: bool) -> dict[str, torch.Tensor]:
        os.environ[SIMULATE_ENV] = "1" if simulate else "0"
        model = build("qwen3", seed=1)
        handle = attach(model, device="cpu")
        try:
            updater = LayerwiseUpdater(handle)
            opt = HybridAdamW8bit([m for _, m in updater.named_masters()], lr=1e-2)
            updater.bind(opt)
            model(input_ids=ids, labels=ids).loss.backward()
            updater.run(None)
            updater.close()
            return {n: m.detach().clone() for n, m in updater.named_masters()}
        finally:
            handle.remove()

    try:
        ref = masters_after_step(simulate=False)
        got = masters_after_step(simulate=True)
    finally:
        os.environ[SIMULATE_ENV] = "1"
    bad = [n for n in ref if not torch.equal(got[n], ref[n])]
    assert not bad, f"{len(bad)} masters differ from the synchronous run, first {bad[:5]}"


def test_resident_upload_needs_release(async_engine):
    """A copy into a resident slot the compute side still holds (no release since its last use) is refused."""
    from lazytrain_hf.streaming import attach

    model = tiny_model("qwen3", seed=1)
    kinds = models.layer_kinds(model.config)
    handle = attach(model, plan=resident_plan(kinds, overlap=False, resident=(1,)), device="cpu")
    try:
        ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        with pytest.raises(RuntimeError, match="Slot reuse waits for the compute event"):
            handle.sync_compute(1)
        handle.mark_resident_released()
        handle.sync_compute(1)  # after the release the upload is ordered behind the step's compute
        handle.wait_uploads()
    finally:
        handle.remove()


def test_compute_copy_written_in_the_fused_pass(monkeypatch):
    """bf16 compute copies are written by the optimizer's fused pass (no `LayerStore.sync` pass) and equal the
    masters rounded to bf16, bit for bit."""
    from lazytrain_hf.streaming import store

    calls: list[int] = []
    real_sync = store.LayerStore.sync
    monkeypatch.setattr(store.LayerStore, "sync", lambda self: (calls.append(self.index), real_sync(self))[1])
    kinds = models.layer_kinds(tiny_model("qwen3").config)
    checked: dict[int, bool] = {}

    with tempfile.TemporaryDirectory() as tmp:
        args = LazyTrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=MICRO_BATCH,
            max_steps=2,
            learning_rate=1e-2,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            planner_plan=write_plan(resident_plan(kinds, overlap=False, resident=(2,)), tmp),
        )
        tr = LazyTrainer(
            model=tiny_model("qwen3", seed=1).to(torch.bfloat16),
            args=args,
            train_dataset=token_dataset(n=2 * MICRO_BATCH, T=10),
        )

        class Check(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                for i, ls in tr.stream_handle.store.layers.items():
                    for e in ls.trainable_entries:
                        want = ls.master_views[e.name].to(torch.bfloat16)
                        assert torch.equal(ls.compute_views[e.name], want), (i, e.name)
                    checked[i] = True

        tr.add_callback(Check())
        tr.train()
    assert sorted(checked) == [0, 1, 2, 3]
    assert calls == [], f"LayerStore.sync ran for layers {calls}"
