"""Plans as files: `planner_plan` executes a saved Plan JSON as is, and refuses one that does not fit the model or
the run before anything is attached."""

from __future__ import annotations

import json

import pytest
from conftest import load_recipe, tiny_config, tiny_model
from trainer_fixtures import token_dataset
from transformers import TrainerCallback

from lazytrain_hf import LazyTrainer, LazyTrainingArguments, models
from lazytrain_hf.planner import hardware, milp
from lazytrain_hf.planner.plan import LayerPlan, Plan, PlanError
from lazytrain_hf.streaming import hooks
from lazytrain_hf.training import planning


def mixed_plan(kinds: list[str], micro_batch_size: int = 2) -> Plan:
    layers = [LayerPlan(index=i, kind=k) for i, k in enumerate(kinds)]
    layers[1].policy = "offload_cpu"
    layers[2].policy, layers[2].input_tier = "recompute", "cpu"
    layers[3].resident = True
    return Plan(layers=layers, micro_batch_size=micro_batch_size, seq_len=10, source="file", loss_chunk_tokens=7)


def make_args(tmp_path, plan_path, **kw) -> LazyTrainingArguments:
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        planner_plan=str(plan_path),
    )
    base.update(kw)
    return LazyTrainingArguments(**base)


@pytest.fixture
def no_planning(monkeypatch):
    """Any profile, warm-up or solve fails the test: a file plan is executed as is."""

    def forbidden(*a, **k):
        raise AssertionError("planner_plan must not profile, warm up or solve")

    monkeypatch.setattr(hardware, "measure", forbidden)
    monkeypatch.setattr(hardware, "get_profile", forbidden)
    monkeypatch.setattr(planning, "time_streamed_layers", forbidden)
    monkeypatch.setattr(milp, "plan_for_model", forbidden)


def test_plan_file_is_executed_as_is(tmp_path, no_planning):
    model = tiny_model("qwen3", seed=1)
    plan = mixed_plan(models.layer_kinds(model.config))
    path = tmp_path / "plan.json"
    plan.to_json(str(path))
    seen: dict = {}

    class Look(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            h = tr.stream_handle
            seen["plan"] = h.plan.to_dict()
            seen["layer_bytes"] = h.activations.layer_bytes()

    tr = LazyTrainer(model=model, args=make_args(tmp_path, path), train_dataset=token_dataset(), callbacks=[Look()])
    tr.train()
    # executed as is; train() adds only what the executor's trace must show (Note: [The trace is the planner's referee])
    expected = plan.to_dict()
    assert set(seen["plan"]["predicted"]) == {"bytes_per_step"}
    expected["predicted"] = {"bytes_per_step": seen["plan"]["predicted"]["bytes_per_step"]}
    assert seen["plan"] == expected
    assert seen["layer_bytes"][1]["cpu"] > 0 and seen["layer_bytes"][0]["cpu"] == 0  # offload_cpu of layer 1 ran
    with open(tmp_path / "out" / "lazytrain_plan.json") as f:
        assert json.load(f) == expected
    assert tr.state.global_step == 2


def test_plan_written_by_the_cli_and_a_checkpoint_directory(tmp_path):
    from lazytrain_hf import cli

    cfg_dir = tmp_path / "cfg"
    tiny_config("qwen3").save_pretrained(cfg_dir)
    saved = tmp_path / "cli_plan.json"
    assert cli.main(
        [
            "plan",
            "--model",
            str(cfg_dir),
            "--hardware",
            "cpu",
            "--seq-len",
            "12",
            "--batch-size",
            "4",
            "--time-limit",
            "10",
            "--save",
            str(saved),
        ]
    ) in (0, None)
    plan = Plan.from_json(str(saved))
    ckpt = tmp_path / "checkpoint-7"
    ckpt.mkdir()
    (ckpt / "lazytrain_plan.json").write_text(saved.read_text())
    args = make_args(tmp_path, ckpt, per_device_train_batch_size=4)
    assert args.planner_plan == str(ckpt / "lazytrain_plan.json")
    tr = LazyTrainer(model=tiny_model("qwen3", seed=1), args=args, train_dataset=token_dataset())
    tr.train()
    # executed as is; the bytes prediction of the cost model is replaced by the exact one for this model
    got, want = tr.lazy_plan.to_dict(), plan.to_dict()
    # the executor's prediction lists every lane its trace records: ``net`` (data parallel) is 0 on one process
    assert set(want["predicted"]["bytes_per_step"]) | {"net"} == set(got["predicted"]["bytes_per_step"])
    assert got["predicted"]["bytes_per_step"]["net"] == 0
    want["predicted"]["bytes_per_step"] = got["predicted"]["bytes_per_step"]
    assert got == want


def _untouched(model) -> dict:
    return {n: (p.data_ptr(), p.device, p.dtype) for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("layers", r"field `layers` has 3 entries but the model has 4 decoder layers; make a plan for this model"),
        ("kind", r"field `layers\[0\]\.kind` is 'full_attention' but the model's layer 0 is 'linear_attention\+moe'"),
        (
            "batch",
            r"field `micro_batch_size` is 2 but per_device_train_batch_size is 4; set "
            r"per_device_train_batch_size=2",
        ),
        ("nvme", r"layers \[1\] keep activations on the nvme tier but activation_nvme_dir is not set"),
    ],
)
def test_plan_that_does_not_fit_is_refused_before_attach(tmp_path, no_planning, case, pattern):
    model_type = "qwen3_next" if case == "kind" else "qwen3"
    model = tiny_model(model_type, seed=1)
    kinds = models.layer_kinds(model.config)
    plan = mixed_plan(kinds)
    batch = 2
    if case == "layers":
        plan.layers = plan.layers[:3]
    elif case == "kind":
        plan.layers = [LayerPlan(index=i, kind="full_attention") for i in range(len(kinds))]
    elif case == "batch":
        batch = 4
    elif case == "nvme":
        plan.layers[1].policy = "offload_nvme"
    path = tmp_path / "plan.json"
    plan.to_json(str(path))
    before = _untouched(model)
    tr = LazyTrainer(
        model=model, args=make_args(tmp_path, path, per_device_train_batch_size=batch), train_dataset=token_dataset()
    )
    with pytest.raises(ValueError, match=pattern) as e:
        tr.train()
    assert str(path) in str(e.value)  # the error names the file
    assert tr.stream_handle is None and model not in hooks._ATTACHED
    assert _untouched(model) == before
    assert not any(m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize(
    "content,pattern",
    [
        (None, r"planner_plan='.*missing\.json': no plan file at .*; pass a file written by `lazytrain plan --save`"),
        ("{not json", r"planner_plan=.* is not a valid plan \(plan file .* is not valid JSON"),
        ('{"layers": [{"index": 0, "policy": "teleport"}]}', r"is not a valid plan .*policy='teleport'"),
    ],
)
def test_bad_plan_file_is_refused_at_construction(tmp_path, content, pattern):
    path = tmp_path / "missing.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=pattern):
        make_args(tmp_path, path)


def test_source_file_round_trip():
    plan = Plan.from_json(json.dumps({"layers": [{"index": 0}], "source": "file"}))
    assert plan.source == "file" and Plan.from_json(plan.to_json()).to_dict() == plan.to_dict()


def test_block_graphs_field(tmp_path):
    """`Plan.block_graphs`: a plan file written before the field loads as ``"block"``; ``"layer"`` is saved and
    loaded; any other value is refused naming the field, the value and the choices."""
    old = {"layers": [{"index": i, "policy": "recompute"} for i in range(4)], "checkpoint_every": 2}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    plan = Plan.from_json(str(path))
    assert plan.block_graphs == "block" and plan.checkpoint_every == 2 and not plan.layer_graphs
    plan.block_graphs = "layer"
    again = Plan.from_json(plan.to_json())
    assert again.block_graphs == "layer" and again.layer_graphs and "block_graphs=layer" in again.table()
    with pytest.raises(PlanError, match=r"block_graphs='layers' is not one of \('block', 'layer'\); write 'block'"):
        Plan.from_json(json.dumps({**old, "block_graphs": "layers"}))


def test_recipe_flag(tmp_path):
    plan = mixed_plan(["full_attention"] * 4)
    path = tmp_path / "plan.json"
    plan.to_json(str(path))
    _, targs = (
        load_recipe()
        .make_parser()
        .parse_args_into_dataclasses(args=["--output_dir", str(tmp_path / "o"), "--planner_plan", str(path)])
    )
    assert targs.planner_plan == str(path)


@pytest.mark.parametrize("override,expected", [(None, True), (False, False)])
def test_file_plan_overlap_is_honoured_on_cpu(tmp_path, override, expected):
    """A file plan's `optimizer_overlap` runs on any device; `optim_overlap_forward` still overrides it."""
    model = tiny_model("qwen3", seed=1)
    plan = mixed_plan(models.layer_kinds(model.config))
    plan.optimizer_overlap = True
    path = tmp_path / "plan.json"
    plan.to_json(str(path))
    tr = LazyTrainer(
        model=model, args=make_args(tmp_path, path, optim_overlap_forward=override), train_dataset=token_dataset()
    )
    flags = {}

    class Look(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            flags["overlap"] = tr._updater.overlap

    tr.add_callback(Look())
    tr.train()
    assert flags["overlap"] is expected
