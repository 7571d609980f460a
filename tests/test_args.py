from __future__ import annotations

import pytest
from transformers import TrainingArguments

from lazytrain_hf.args import LazyTrainingArguments
from lazytrain_hf.units import format_bytes, parse_bytes


def make(**kw):
    return LazyTrainingArguments(output_dir="unused", report_to=[], **kw)


@pytest.mark.parametrize(
    "value,expected",
    [("70GiB", 70 * 2**30), ("512MB", 512 * 10**6), ("1.5G", int(1.5 * 2**30)), (4096, 4096), ("2048", 2048)],
)
def test_parse_bytes(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["0GiB", -5, "lots", "12 parsecs", True])
def test_parse_bytes_rejects(value):
    with pytest.raises(ValueError, match="budget"):
        parse_bytes(value, "budget")


def test_format_bytes():
    assert format_bytes(3 * 2**30) == "3.00GiB"
    assert format_bytes(12) == "12B"


def test_budgets_are_parsed():
    a = make(planner_gpu_budget="24GiB", planner_host_budget=10**9)
    assert a.planner_gpu_budget == 24 * 2**30 and a.planner_host_budget == 10**9


@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(planner_gpu_budget="0GiB"), ["planner_gpu_budget", "0GiB"]),
        (dict(planner_host_budget="many"), ["planner_host_budget", "many"]),
        (dict(activation_tiers=["gpu", "ssd"]), ["activation_tiers", "ssd", "nvme"]),
        (dict(activation_tiers=["gpu", "nvme"]), ["activation_nvme_dir"]),
        (dict(planner_policy="fastest"), ["planner_policy", "fastest", "megatrain"]),
        (dict(planner_solver="gurobi"), ["planner_solver", "gurobi"]),
        (dict(planner_time_limit=0), ["planner_time_limit"]),
        (dict(planner_mip_gap=1.5), ["planner_mip_gap"]),
        (dict(optim_block_size=100), ["optim_block_size", "100"]),
        (dict(optim_block_size=8192), ["optim_block_size", "8192", "4096"]),
        (dict(optim_min_8bit_size=0), ["optim_min_8bit_size", ">= 1"]),
        (dict(optim_hybrid_8bit=False), ["optim_hybrid_8bit=False", "stream_enabled"]),
        (dict(stream_prefetch_depth=-1), ["stream_prefetch_depth"]),
        (dict(stream_loss_chunk_tokens=0), ["stream_loss_chunk_tokens"]),
        (dict(planner_hardware=""), ["planner_hardware"]),
    ],
)
def test_validation_errors_name_option_value_and_fix(kw, words):
    with pytest.raises(ValueError) as e:
        make(**kw)
    for w in words:
        assert w in str(e.value)


def test_tiers_from_comma_string_and_nvme_dir(tmp_path):
    a = make(activation_tiers="gpu,cpu,nvme", activation_nvme_dir=str(tmp_path))
    assert a.activation_tiers == ["gpu", "cpu", "nvme"]
    assert a.activation_nvme_dir == str(tmp_path)


def test_derived_optimizer_default():
    assert make().optim_hybrid_8bit is True
    assert make(stream_enabled=False).optim_hybrid_8bit is False
    assert make(stream_enabled=False, optim_hybrid_8bit=True).optim_hybrid_8bit is True


def test_upgrade_keeps_every_field():
    plain = TrainingArguments(
        output_dir="o", learning_rate=3e-4, lr_scheduler_type="cosine", max_steps=7, seed=11, report_to=[],
        gradient_accumulation_steps=3, weight_decay=0.1, logging_steps=2,
    )
    up = LazyTrainingArguments.from_training_arguments(plain)
    assert isinstance(up, LazyTrainingArguments)
    for name in ("output_dir", "learning_rate", "max_steps", "seed", "gradient_accumulation_steps", "weight_decay",
                 "logging_steps", "lr_scheduler_type", "optim"):
        assert getattr(up, name) == getattr(plain, name), name
    assert up.stream_enabled is True


def test_tiers_comma_list_on_the_command_line():
    from transformers import HfArgumentParser

    (a,) = HfArgumentParser(LazyTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "o", "--activation_tiers", "gpu,cpu", "--report_to", "none"]
    )
    assert a.activation_tiers == ["gpu", "cpu"]


def test_every_help_string_formats():
    """argparse %-formats help strings: a stray '%' breaks `--help`."""
    from transformers import HfArgumentParser

    text = HfArgumentParser(LazyTrainingArguments).format_help()
    assert "--planner_gpu_budget" in text and "10 percent reserve" in text


def test_hf_argument_parser_round_trip():
    from transformers import HfArgumentParser

    (a,) = HfArgumentParser(LazyTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "o", "--planner_gpu_budget", "24GiB", "--activation_tiers", "gpu", "cpu",
         "--stream_enabled", "false", "--report_to", "none"]
    )
    assert a.planner_gpu_budget == 24 * 2**30
    assert a.activation_tiers == ["gpu", "cpu"]
    assert a.stream_enabled is False
