"""recipes/qwen_metamath.py and accelerate_configs/: parsing, --help, configs, a short end-to-end run, errors."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import load_recipe

pytestmark = pytest.mark.usefixtures("evaluate_cache")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "qwen_metamath.py"
CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


@pytest.fixture(scope="module")
def recipe():
    return load_recipe()


# ------------------------------------------------------------------------------------------------ configs


EXPECTED = {
    "cpu.yaml": {"distributed_type": "NO", "use_cpu": True, "num_processes": 1},
    "single_gpu.yaml": {"distributed_type": "NO", "use_cpu": False, "num_processes": 1, "gpu_ids": "0"},
    "multi_gpu.yaml": {"distributed_type": "MULTI_GPU", "use_cpu": False},
    # MULTI_GPU is what makes accelerate start torch.distributed.run (test_cpu_2proc_config_starts_two_processes)
    "cpu_2proc.yaml": {"distributed_type": "MULTI_GPU", "use_cpu": True, "num_processes": 2},
}
REQUIRED_KEYS = {"compute_environment", "distributed_type", "mixed_precision", "num_machines", "num_processes",
                 "machine_rank", "use_cpu", "main_training_function"}  # fmt: skip


def test_every_config_is_valid_for_accelerate():
    from accelerate.commands.config.config_args import load_config_from_file

    assert {c.name for c in CONFIGS} == set(EXPECTED)
    for path in CONFIGS:
        raw = yaml.safe_load(path.read_text())
        assert REQUIRED_KEYS <= set(raw), f"{path.name} lacks {REQUIRED_KEYS - set(raw)}"
        for key, value in EXPECTED[path.name].items():
            assert raw[key] == value, (path.name, key, raw[key])
        loaded = load_config_from_file(str(path))  # accelerate's own parser and enum checks
        assert loaded.distributed_type.value == raw["distributed_type"]
        assert loaded.compute_environment.value == "LOCAL_MACHINE"
        assert loaded.num_machines == 1
        if path.name in ("multi_gpu.yaml", "cpu_2proc.yaml"):
            assert loaded.num_processes > 1
        # the header comment gives the exact launch command
        header = path.read_text().split("\ncompute_environment", 1)[0]
        assert f"accelerate launch --config_file accelerate_configs/{path.name}" in header
        assert "recipes/qwen_metamath.py" in header


def _accelerate_launch_args(*argv: str):
    """``accelerate launch argv recipes/qwen_metamath.py`` as accelerate 1.x resolves it before choosing a launcher
    (its parser, then the config file's defaults), without launching."""
    from accelerate.commands import launch

    args = launch.launch_command_parser().parse_args([*argv, str(RECIPE)])
    return launch._validate_launch_command(args)[0]


def test_cpu_2proc_config_starts_two_processes():
    """accelerate 1.x starts several processes (through torch.distributed.run) only on its multi-device path
    (``args.multi_gpu`` and not ``--cpu``); ``--cpu --num_processes 2`` and a ``distributed_type: MULTI_CPU`` config
    take its simple launcher, one process (MULTI_CPU starts more only through mpirun). cpu_2proc.yaml takes the
    torch.distributed.run path with 2 processes; the recipe's ranks then run on the CPU (--use_cpu True without
    CUDA)."""
    two = _accelerate_launch_args("--config_file", str(ROOT / "accelerate_configs" / "cpu_2proc.yaml"))
    assert two.multi_gpu and not two.cpu and two.num_processes == 2 and two.num_machines == 1
    assert two.main_process_port == 0  # a free port: two launches on one machine do not collide
    one = _accelerate_launch_args("--cpu", "--num_processes", "2")
    assert not one.multi_gpu and one.cpu  # -> simple_launcher: one process, whatever --num_processes says


def test_documented_commands_use_existing_configs_and_parse(recipe):
    doc = recipe.__doc__.replace("\\\n", " ")
    commands = [line.strip() for line in doc.splitlines() if "recipes/qwen_metamath.py" in line]
    assert len(commands) >= 4
    for cmd in commands:
        words = shlex.split(cmd)
        if "--config_file" in words:
            assert (ROOT / words[words.index("--config_file") + 1]).is_file(), cmd
        args = words[words.index("recipes/qwen_metamath.py") + 1 :]
        script_args, training_args = recipe.make_parser().parse_args_into_dataclasses(args=args)
        assert script_args.trust_remote_code is False
    assert "--model_name_or_path Qwen/Qwen2.5-3B" in doc and "--dataset_name meta-math/MetaMathQA" in doc


# ------------------------------------------------------------------------------------------------ parsing


def test_defaults_are_embedded_and_cpu_friendly(recipe):
    import torch

    script_args, training_args = recipe.make_parser().parse_args_into_dataclasses(args=[])
    assert script_args.model_name_or_path == "embedded" and script_args.dataset_name == "embedded"
    assert script_args.trust_remote_code is False
    assert training_args.output_dir == "runs/qwen_metamath"
    assert training_args.report_to in ([], ["none"], "none")
    assert training_args.use_cpu is (not torch.cuda.is_available())
    assert training_args.stream_enabled is True and training_args.optim_hybrid_8bit is True
    assert training_args.push_to_hub is False


def test_embedded_default_plan_streams_offloads_and_recomputes(recipe, tmp_path):
    """The README's main job (no flags): its plan streams layers, offloads activations to the CPU and recomputes, and
    the timeline picture is drawn (the same plan every run: bundled `cpu` profile, cost-model layer times)."""
    from lazytrain_hf import LazyTrainer
    from lazytrain_hf.data import CausalLMCollator

    script_args, training_args = recipe.parse_args(["--output_dir", str(tmp_path)])
    budgets = {"planner_gpu_budget": int(57.5 * 2**20), "planner_host_budget": 110 * 2**20}
    for key, value in recipe.EMBEDDED_PLANNER_DEFAULTS.items():
        assert getattr(training_args, key) == budgets.get(key, value), key
    tokenizer = recipe.build_embedded_tokenizer()
    train_rows, _ = recipe.load_splits("embedded", None, script_args.num_eval_samples, seed=training_args.seed)
    dataset = recipe.format_dataset(train_rows, tokenizer, script_args.max_seq_length, script_args.overlong)
    trainer = LazyTrainer(
        model=recipe._load_model(script_args, tokenizer, training_args.seed),
        args=training_args,
        train_dataset=dataset,
        data_collator=CausalLMCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
    )
    plan = trainer.make_plan()
    layers = plan.layers
    assert plan.source == "milp" and (plan.micro_batch_size, plan.seq_len) == (32, 87), plan.table()
    assert any(not lp.resident for lp in layers), plan.table()  # streamed weights
    assert any(lp.tier == "cpu" for lp in layers), plan.table()  # activations (or a recompute input) on the CPU
    assert any(lp.policy == "recompute" for lp in layers), plan.table()
    assert re.fullmatch(r"[1-4]/4 layers streamed, [1-4] offload to cpu, [1-4] recomputed", recipe.plan_summary(plan))
    png = tmp_path / recipe.TIMELINE_FILE
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    # a flag given wins over the embedded planner defaults
    _, given = recipe.parse_args(["--planner_gpu_budget", "1GiB", "--planner_hardware", "auto"])
    assert given.planner_gpu_budget == 2**30 and given.planner_hardware == "auto" and given.planner_warmup_steps == 0
    _, real = recipe.parse_args(["--model_name_or_path", "Qwen/Qwen2.5-3B"])
    assert (
        real.planner_gpu_budget is None
        and real.planner_host_budget is None
        and real.planner_hardware == "auto"
        and real.planner_warmup_steps == 2
    )


def test_sample_command_line(recipe, tmp_path):
    argv = shlex.split(
        f"--model_name_or_path Qwen/Qwen2.5-3B --dataset_name data/mm.jsonl --max_seq_length 1024 "
        f"--num_train_samples 5000 --num_eval_samples 50 --eval_max_new_tokens 300 --trust_remote_code "
        f"--output_dir {tmp_path} --max_steps 7 --learning_rate 1e-5 --planner_gpu_budget 70GiB "
        f"--planner_policy megatrain --activation_tiers gpu cpu --stream_enabled False"
    )
    script_args, training_args = recipe.make_parser().parse_args_into_dataclasses(args=argv)
    assert script_args.model_name_or_path == "Qwen/Qwen2.5-3B" and script_args.dataset_name == "data/mm.jsonl"
    assert (script_args.max_seq_length, script_args.num_train_samples, script_args.num_eval_samples) == (
        1024,
        5000,
        50,
    )
    assert script_args.eval_max_new_tokens == 300 and script_args.trust_remote_code is True
    assert training_args.output_dir == str(tmp_path) and training_args.max_steps == 7
    assert training_args.learning_rate == 1e-5 and training_args.planner_gpu_budget == 70 * 2**30
    assert training_args.planner_policy == "megatrain" and training_args.activation_tiers == ["gpu", "cpu"]
    assert training_args.stream_enabled is False and training_args.optim_hybrid_8bit is False


@pytest.mark.parametrize(
    ("flag", "value", "pattern"),
    [
        ("--max_seq_length", "1", r"--max_seq_length=1 must be >= 2"),
        ("--num_eval_samples", "0", r"--num_eval_samples=0 must be >= 1"),
        ("--eval_max_new_tokens", "0", r"--eval_max_new_tokens=0 must be >= 1"),
        ("--dtype", "int8", r"--dtype='int8' is not supported"),
    ],
)
def test_bad_script_arguments(recipe, flag, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        recipe.make_parser().parse_args_into_dataclasses(args=[flag, value])


def test_help_runs_as_a_script(tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH="")
    out = subprocess.run(
        [sys.executable, str(RECIPE), "--help"], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in ("--model_name_or_path", "--dataset_name", "--max_seq_length", "--num_train_samples",
                 "--num_eval_samples", "--eval_max_new_tokens", "--trust_remote_code", "--stream_enabled",
                 "--planner_gpu_budget", "--push_to_hub"):  # fmt: skip
        assert flag in out.stdout, flag


# ------------------------------------------------------------------------------------------------ end to end


def _short_run_args(tmp_path, *extra: str) -> list[str]:
    return [
        "--output_dir", str(tmp_path / "run"), "--max_steps", "3", "--num_train_samples", "48",
        "--num_eval_samples", "4", "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "4",
        "--eval_max_new_tokens", "10", "--logging_steps", "1", "--warmup_steps", "0", "--planner_warmup_steps", "1",
        "--planner_time_limit", "5", "--planner_hardware", "cpu", *extra,
    ]  # fmt: skip


def _check_run(recipe, tmp_path, capsys, *extra):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lazytrain_hf.metrics import generate_responses

    metrics = recipe.main(_short_run_args(tmp_path, *extra))
    out = capsys.readouterr().out
    for key in ("exact_match_before", "exact_match_after"):
        assert 0.0 <= metrics[key] <= 1.0
    assert metrics["global_step"] == 3 and metrics["num_eval_samples"] == 4 and metrics["num_train_samples"] == 48
    assert re.search(r"exact match before training: \d+\.\d\d% on 4 eval problems", out), out
    if "--stream_enabled" not in extra:
        assert re.search(r"the plan it trained with \(\d/4 layers streamed, \d offload to cpu, \d recomputed\)", out)
        assert f"timeline of one step, as the simulator replays the plan: {tmp_path / 'run'}" in out, out
    summary = [line for line in out.splitlines() if line.startswith("[qwen_metamath] model=")]
    assert len(summary) == 1, out
    assert re.search(r"exact_match before=\d+\.\d\d% after=\d+\.\d\d% \(n=4\)", summary[0]), summary[0]

    run = tmp_path / "run"
    saved = json.loads((run / "eval_results.json").read_text())
    assert saved["exact_match_before"] == metrics["exact_match_before"]
    assert saved["exact_match_after"] == metrics["exact_match_after"]
    # the saved model and tokenizer reload and reproduce the post-training predictions exactly (greedy)
    model = AutoModelForCausalLM.from_pretrained(run)
    tok = AutoTokenizer.from_pretrained(run)
    records = json.loads((run / "eval_predictions.json").read_text())
    assert len(records) == 4
    again = generate_responses(model, tok, [r["query"] for r in records], max_new_tokens=10, batch_size=4)
    assert again == [r["prediction"] for r in records]
    return metrics


def test_end_to_end_short_run(recipe, tmp_path, capsys):
    _check_run(recipe, tmp_path, capsys, "--stream_enabled", "False")


def test_end_to_end_short_run_streaming(recipe, tmp_path, capsys):
    _check_run(recipe, tmp_path, capsys)  # the recipe's defaults: streaming on, Hybrid 8-bit optimizer


def test_end_to_end_short_run_state_on_nvme(recipe, tmp_path, capsys):
    """`--state_nvme_dir` (every unit's training state on NVMe): trains, evaluates the units left on disk, saves
    a model that reloads and reproduces its predictions."""
    (tmp_path / "state").mkdir()
    _check_run(recipe, tmp_path, capsys, "--state_nvme_dir", str(tmp_path / "state"), "--state_nvme_layers", "all")
    plan = json.loads((tmp_path / "run" / "lazytrain_plan.json").read_text())
    assert plan["state_nvme"] and plan["predicted"]["bytes_per_step"]["nvme_write"] > 0


@pytest.mark.slow
def test_accelerate_launch_two_cpu_processes(tmp_path, evaluate_cache):
    """``accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/qwen_metamath.py`` (embedded
    model and data, 4 steps, checkpoints every 2, one thread per rank) runs 2 ranks, gloo on the CPU: the plan is
    made for world_size 2; each rank wrote its own partition of checkpoint-4 with world_size 2, their units disjoint
    and together every unit; the traced steps sent gradients over the ``net`` lane as the plan predicts; the
    checkpoint verifies and its model.safetensors loads, equal to the model the recipe saved after training."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lazytrain_hf.training.checkpoints import verify_checkpoint
    from lazytrain_hf.training.partition_files import layout_name, partition_name

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "cpu_2proc.yaml"), str(RECIPE), "--output_dir", str(run),
           "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--num_train_samples", "48",
           "--num_eval_samples", "2", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "2",
           "--eval_max_new_tokens", "4", "--logging_steps", "1", "--warmup_steps", "0"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HOME=str(evaluate_cache))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "steps=4" in proc.stdout and proc.stdout.count("[qwen_metamath] model=") == 1, proc.stdout[-2000:]

    plan = json.loads((run / "lazytrain_plan.json").read_text())
    assert (plan["world_size"], plan["nodes"]) == (2, 1)
    ckpt = run / "checkpoint-4"
    verify_checkpoint(str(ckpt))
    layouts = [json.loads((ckpt / layout_name(r, 2)).read_text()) for r in range(2)]
    units = [set(layout["units"]) for layout in layouts]
    for r, layout in enumerate(layouts):
        assert (layout["world_size"], layout["rank"]) == (2, r) and (ckpt / partition_name(r, 2)).is_file()
        assert units[r] == {k for k, owner in layout["owners"].items() if owner == r} and units[r], layout
        assert (ckpt / f"rng_state_{r}.pth").is_file()
    assert units[0].isdisjoint(units[1]) and units[0] | units[1] == {"0", "1", "2", "3"}, units
    trace = json.loads((run / "lazytrain_trace.json").read_text())
    predicted = plan["predicted"]["bytes_per_step"]
    assert predicted["net"] > 0 and all(step["bytes"]["net"] == predicted["net"] for step in trace["steps"])

    model = AutoModelForCausalLM.from_pretrained(ckpt)
    saved = load_file(run / "model.safetensors")
    state = model.state_dict()
    for k, v in saved.items():
        assert torch.equal(state[k], v), k


def test_hub_names_offline_say_how_to_pass_a_local_path(recipe, tmp_path):
    from lazytrain_hf.data import HubUnavailableError

    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest: a real Hub request fails fast here
    with pytest.raises(HubUnavailableError, match=r"dataset_name='meta-math/MetaMathQA'.*local-dir"):
        recipe.main(_short_run_args(tmp_path, "--dataset_name", "meta-math/MetaMathQA"))
    with pytest.raises(HubUnavailableError, match=r"--model_name_or_path='Qwen/Qwen2.5-3B'.*--model_name_or_path=DIR"):
        recipe.main(_short_run_args(tmp_path, "--model_name_or_path", "Qwen/Qwen2.5-3B"))


class _RecordingHubApi:
    """Stands in for the Hub client at the network boundary (the Hub is unreachable here); records each call."""

    def __init__(self):
        self.uploads: list[dict] = []
        self.repos: list[str] = []

    def create_repo(self, repo_id, **kwargs):
        self.repos.append(repo_id)
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, folder_path, **kwargs):
        self.uploads.append(dict(kwargs, files=sorted(os.listdir(folder_path))))


def test_push_to_hub_is_honoured(recipe, tmp_path, monkeypatch, capsys):
    import transformers.trainer

    api = _RecordingHubApi()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: api)
    recipe.main(_short_run_args(tmp_path, "--push_to_hub", "--hub_model_id", "me/tiny", "--stream_enabled", "False"))
    assert api.repos == ["me/tiny"]
    assert len(api.uploads) == 1, api.uploads  # one commit: model, tokenizer, evaluation record, model card
    upload = api.uploads[0]
    assert upload["repo_id"] == "me/tiny"
    assert re.match(r"exact match \d+\.\d\d% -> \d+\.\d\d%", upload["commit_message"])
    for name in ("model.safetensors", "config.json", "tokenizer.json", "eval_results.json", "README.md"):
        assert name in upload["files"], upload["files"]
    assert "embedded" in (tmp_path / "run" / "README.md").read_text()


def test_dataset_rows_missing_fields_are_named(recipe, tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"query": f"What is {i} + 1?", "response": f"The answer is: {i + 1}"} for i in range(8)]
    rows[5] = {"query": "What is 5 + 1?", "answer": "6"}
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match=r"row 5 lacks field 'response' \(has: query, answer\)"):
        recipe.main(_short_run_args(tmp_path, "--dataset_name", str(path)))
