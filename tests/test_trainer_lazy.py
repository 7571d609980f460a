"""LazyTrainer end to end on CPU: the plan is made, executed, and training matches the unmodified Trainer."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import tiny_model
from trainer_fixtures import make_trainer, token_dataset
from transformers import AutoModelForCausalLM

# Streaming only moves data and the chunked loss sums in another order (fp32): per-step losses agree to this
# relative tolerance with the unstreamed run using the same optimizer.
LOSS_RTOL = 1e-5
TIGHT_BUDGET = 400_000  # bytes: forces every layer to stream and activations to the CPU tier (tiny qwen3)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_losses_close(a: list[float], b: list[float], rtol: float = LOSS_RTOL) -> None:
    assert len(a) == len(b) and a, (a, b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rtol * abs(y), f"step {i + 1}: {x} vs {y} (all: {a} vs {b})"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Unstreamed Trainer run with the same Hybrid 8-bit optimizer."""
    tr = make_trainer(tmp_path_factory.mktemp("ref"), max_steps=4, stream=False, optim_hybrid_8bit=True)
    tr.train()
    return tr.loss_recorder.losses, _weights(tr.model)


@pytest.mark.parametrize(
    "policy,budget",
    [
        ("milp", TIGHT_BUDGET),
        ("all_recompute", None),
        ("cpu_offload_inputs", None),
        ("megatrain", None),
        ("megatrain_plus", None),
        ("slideformer", None),
    ],
)
def test_streamed_training_matches_unstreamed(tmp_path, reference, policy, budget):
    ref_losses, ref_w = reference
    tr = make_trainer(tmp_path, max_steps=4, planner_policy=policy, planner_gpu_budget=budget)
    tr.train()
    plan = tr.lazy_plan
    if policy == "milp":
        assert plan.source in ("milp", "heuristic")
        assert not any(lp.resident for lp in plan.layers), plan.table()  # the budget forces streaming
        assert "offload_cpu" in plan.policies or "recompute" in plan.policies, plan.table()
    _assert_losses_close(tr.loss_recorder.losses, ref_losses)
    w = _weights(tr.model)
    for k in ref_w:
        torch.testing.assert_close(w[k], ref_w[k], rtol=1e-4, atol=1e-6, msg=k)
    # the plan was saved and the logs carry the LazyTrain measurements
    saved = json.load(open(tmp_path / "lazytrain_plan.json"))
    png = tmp_path / "lazytrain_timeline.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [lp["policy"] for lp in saved["layers"]] == plan.policies
    last = tr.loss_recorder.logs[-1]
    for key in ("tokens_per_s", "tflops", "peak_device_bytes", "grad_norm", "skipped_nonfinite_steps"):
        assert key in last, last
    assert last["tokens_per_s"] > 0 and last["peak_device_bytes"] > 0
    # hooks gone after train(): the model is a plain model again
    layer = tr.model.model.layers[0]
    assert not layer._forward_pre_hooks and not layer._forward_hooks


def test_optimizer_overlap_is_exact(tmp_path):
    """The layer-wise optimizer on a background thread overlapping the next forward gives the same result as
    running it inline, bit for bit (Note: [Update before fetch])."""
    a = make_trainer(tmp_path / "inline", max_steps=4, planner_policy="default", optim_overlap_forward=False)
    a.train()
    b = make_trainer(tmp_path / "overlap", max_steps=4, planner_policy="default", optim_overlap_forward=True)
    b.train()
    assert a.loss_recorder.losses == b.loss_recorder.losses
    wa, wb = _weights(a.model), _weights(b.model)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_evaluate_predict_generate_while_streamed(tmp_path):
    tr = make_trainer(tmp_path, max_steps=2, planner_policy="default", per_device_eval_batch_size=4)
    tr.train()
    ds = token_dataset(8, seed=5)
    plain = tiny_model("qwen3", seed=1)
    plain.load_state_dict(tr.model.state_dict())
    plain.eval()
    batch = torch.tensor(ds["input_ids"][:4])
    with torch.no_grad():
        ref_loss = plain(input_ids=batch, labels=batch).loss
    metrics = tr.evaluate(eval_dataset=token_dataset(4, seed=5))
    assert metrics["eval_loss"] == pytest.approx(ref_loss.item(), rel=1e-5)
    pred = tr.predict(token_dataset(4, seed=5))
    with torch.no_grad():
        ref_logits = plain(input_ids=batch).logits
    torch.testing.assert_close(torch.as_tensor(pred.predictions), ref_logits, rtol=1e-5, atol=1e-5)
    prompt = batch[:2, :5]
    with torch.no_grad():
        ref_gen = plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        with tr.streaming() as handle:
            assert handle is not None
            gen = tr.model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(gen, ref_gen)


def test_save_model_reloads_equal_weights_and_card(tmp_path):
    tr = make_trainer(tmp_path, max_steps=2, planner_policy="all_recompute")
    tr.train()
    out = tmp_path / "final"
    tr.save_model(str(out))
    reloaded = AutoModelForCausalLM.from_pretrained(str(out))
    live = tr.model.state_dict()
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, live[k]), k
    assert (out / "lazytrain_plan.json").exists()
    tr.create_model_card(model_name="tiny")
    card = open(tmp_path / "README.md").read()
    assert "## LazyTrain" in card and "recompute" in card and "tokens/s" in card


def test_resume_continues_with_same_losses(tmp_path):
    full = make_trainer(tmp_path / "full", max_steps=6, planner_policy="milp", planner_gpu_budget=TIGHT_BUDGET)
    full.train()

    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                control.should_training_stop = True

    run = tmp_path / "interrupted"
    first = make_trainer(run, max_steps=6, save_steps=3, planner_policy="milp", planner_gpu_budget=TIGHT_BUDGET)
    first.add_callback(StopAt())
    first.train()
    assert (run / "checkpoint-3" / "lazytrain_plan.json").exists()
    second = make_trainer(run, max_steps=6, save_steps=3, planner_policy="milp", planner_gpu_budget=TIGHT_BUDGET)
    second.train(resume_from_checkpoint=True)
    assert second.lazy_plan.policies == first.lazy_plan.policies  # the plan came back with the checkpoint
    losses = first.loss_recorder.losses + second.loss_recorder.losses
    assert losses == full.loss_recorder.losses
    wa, wb = _weights(full.model), _weights(second.model)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_corrupted_checkpoint_is_named(tmp_path):
    tr = make_trainer(tmp_path, max_steps=2, save_steps=2, planner_policy="default")
    tr.train()
    ckpt = tmp_path / "checkpoint-2"
    for name, damage in [("model.safetensors", lambda b: b[: len(b) // 2]), ("optimizer.pt", lambda b: b[:100]),
                         ("lazytrain_plan.json", lambda b: b[:20])]:
        path = ckpt / name
        good = path.read_bytes()
        path.write_bytes(damage(good))
        again = make_trainer(tmp_path, max_steps=3, planner_policy="default")
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            again.train(resume_from_checkpoint=str(ckpt))
        path.write_bytes(good)


def test_nonfinite_gradients_skip_the_step(tmp_path):
    tr = make_trainer(tmp_path, max_steps=4, planner_policy="default")
    emb = tr.model.model.embed_tokens
    calls = {"n": 0}

    def poison(module, args, out):
        calls["n"] += 1
        if calls["n"] == 2 and module.training:  # the 2nd training step: one forward per step, no warm-up
            return out * float("inf")
        return out

    snap = {}

    from transformers import TrainerCallback

    class Snap(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1:
                snap["w"] = _weights(tr.model)
                snap["opt"] = _flat_state(tr.optimizer.optimizer.state_dict())
                snap["lr"] = tr.lr_scheduler.get_last_lr()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                snap["w2"] = _weights(tr.model)
                snap["opt2"] = _flat_state(tr.optimizer.optimizer.state_dict())
                snap["lr2"] = tr.lr_scheduler.get_last_lr()

    h = emb.register_forward_hook(poison)
    tr.add_callback(Snap())
    try:
        tr.train()
    finally:
        h.remove()
    assert tr.skipped_nonfinite_steps == 1
    for k in snap["w"]:
        assert torch.equal(snap["w"][k], snap["w2"][k]), k
    for k, v in snap["opt"].items():
        assert torch.equal(v, snap["opt2"][k]) if torch.is_tensor(v) else v == snap["opt2"][k], k
    assert snap["lr"] == snap["lr2"]  # scheduler not stepped on the skipped step
    logged = [entry["skipped_nonfinite_steps"] for entry in tr.loss_recorder.logs]
    assert logged[-1] == 1
    assert all(torch.isfinite(v).all() for v in _weights(tr.model).values())


def _flat_state(sd: dict) -> dict:
    """A copy of the optimizer state (state_dict() returns live tensors)."""
    out = {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            out[f"{pid}.{k}"] = v.clone() if torch.is_tensor(v) else v
    return out


def test_lora_adapters_streamed_base_trained_and_reloaded(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    base = tiny_model("qwen3", seed=1)
    frozen_before = {k: v.clone() for k, v in base.state_dict().items()}
    model = get_peft_model(base, LoraConfig(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8,
                                            init_lora_weights=False))
    tr = make_trainer(tmp_path, max_steps=3, planner_policy="default")
    tr.model = tr.model_wrapped = model
    tr.optimizer = None
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    tr.train()
    assert tr.loss_recorder.losses
    after = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n)
    for n, p in model.get_base_model().named_parameters():
        if "lora" not in n:
            key = n.replace(".base_layer", "")
            assert torch.equal(p.detach(), frozen_before[key]), n
    out = tmp_path / "adapter"
    tr.save_model(str(out))
    assert (out / "adapter_model.safetensors").exists()
    reloaded = PeftModel.from_pretrained(tiny_model("qwen3", seed=1), str(out))
    got = {n: p for n, p in reloaded.named_parameters() if "lora" in n}
    for n, v in after.items():
        assert torch.equal(got[n], v), n


def test_push_to_hub_uploads_from_host_copy(tmp_path, monkeypatch):
    import transformers.trainer as hf_trainer

    uploads = []

    class FakeApi:
        def create_repo(self, repo_id, token=None, private=None, exist_ok=False, **kw):
            class Url:
                pass

            url = Url()
            url.repo_id = f"user/{os.path.basename(repo_id)}"
            return url

        def upload_folder(self, repo_id, folder_path, **kw):
            files = {}
            for root, _, names in os.walk(folder_path):
                for n in names:
                    rel = os.path.relpath(os.path.join(root, n), folder_path)
                    if any(rel.startswith(p) for p in ("checkpoint-", "_")):
                        continue
                    files[rel] = open(os.path.join(root, n), "rb").read()
            uploads.append({"repo_id": repo_id, "files": files, "token": kw.get("token")})

            class Done:
                def is_done(self):
                    return True

            return Done()

    monkeypatch.setattr(hf_trainer, "hf_api", lambda: FakeApi())
    secret = "hf_SECRETtoken1234567890"
    tr = make_trainer(tmp_path / "push", max_steps=2, planner_policy="all_recompute", push_to_hub=True,
                      hub_model_id="tiny-lazy", hub_token=secret, hub_strategy="end")
    tr.train()
    tr.push_to_hub()
    assert uploads, "upload_folder was not called"
    files = uploads[-1]["files"]
    for name in ("model.safetensors", "config.json", "README.md", "lazytrain_plan.json"):
        assert name in files, sorted(files)
    assert b"## LazyTrain" in files["README.md"]
    for name, data in files.items():
        assert secret.encode() not in data, f"hub token written into {name}"
    from safetensors.torch import load

    uploaded = load(files["model.safetensors"])
    live = tr.model.state_dict()
    for k, v in uploaded.items():
        assert torch.equal(v, live[k]), k


def test_resume_bf16_restores_the_fp32_master(tmp_path):
    """With a bf16 compute copy the fp32 master is not in the saved weights; checkpoints carry it, so a resumed
    run continues bit-exactly instead of restarting from weights rounded to bf16."""
    from transformers import TrainerCallback

    def bf16_trainer(out, **kw):
        tr = make_trainer(out, max_steps=6, planner_policy="default", learning_rate=1e-2, **kw)
        tr.model.to(torch.bfloat16)
        return tr

    full = bf16_trainer(tmp_path / "full")
    full.train()

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                control.should_training_stop = True

    run = tmp_path / "interrupted"
    first = bf16_trainer(run, save_steps=3)
    first.add_callback(StopAt())
    first.train()
    assert (run / "checkpoint-3" / "lazytrain_master.safetensors").exists()
    second = bf16_trainer(run, save_steps=3)
    second.train(resume_from_checkpoint=True)
    assert first.loss_recorder.losses + second.loss_recorder.losses == full.loss_recorder.losses
    wa, wb = _weights(full.model), _weights(second.model)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_host_budget_bounds_the_whole_footprint(tmp_path, monkeypatch):
    """planner_host_budget is the whole host footprint: the MILP gets for pinned activations what the run's state
    leaves of it (here: nothing, so no layer is offloaded to the cpu tier)."""
    import lazytrain_hf.planner.milp as milp
    from lazytrain_hf.training import planning

    seen = {}
    real = milp.plan_for_model

    def spy(*a, **k):
        seen["host_budget"] = k["host_budget"]
        return real(*a, **k)

    monkeypatch.setattr(milp, "plan_for_model", spy)
    tr = make_trainer(tmp_path, planner_policy="milp", planner_hardware="h800", planner_warmup_steps=0)
    state = planning.host_footprint(None, tr.model, hybrid_8bit=True, args=tr.args)
    tr.args.planner_host_budget = max(state.total, state.save_peak) - state.activations + 1000
    plan = tr.make_plan()
    assert seen["host_budget"] == 1000
    assert plan.predicted["pinned_host_bytes"] <= 1000
