from __future__ import annotations

import dataclasses
import pickle
from typing import ClassVar

import pytest
from transformers import Seq2SeqTrainingArguments, TrainingArguments

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
        (dict(planner_dp_reduce="nccl"), ["planner_dp_reduce", "'nccl'", "auto", "host", "device"]),
        (
            dict(planner_dp_reduce_every="epoch"),
            ["planner_dp_reduce_every", "'epoch'", "auto", "micro_batch", "step"],
        ),
        (
            dict(planner_dp_reduce_every="step", planner_dp_reduce="device"),
            ["planner_dp_reduce_every='step'", "planner_dp_reduce='device'", "planner_dp_reduce='host'"],
        ),
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
    )  # fmt: skip
    up = LazyTrainingArguments.from_training_arguments(plain)
    assert isinstance(up, LazyTrainingArguments)
    for name in ("output_dir", "learning_rate", "max_steps", "seed", "gradient_accumulation_steps", "weight_decay",
                 "logging_steps", "lr_scheduler_type", "optim"):  # fmt: skip
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
    )  # fmt: skip
    assert a.planner_gpu_budget == 24 * 2**30
    assert a.activation_tiers == ["gpu", "cpu"]
    assert a.stream_enabled is False


# ---------------------------------------------------------------------------------------- refused at construction
def _profile_json(tmp_path, text: str | None = None, **changes) -> str:
    """A profile JSON: the bundled h800 with ``changes`` (json writes float('nan') as NaN), or ``text`` as is."""
    import json

    from lazytrain_hf.planner.hardware import get_profile

    path = tmp_path / "hw.json"
    path.write_text(text if text is not None else json.dumps({**get_profile("h800").to_dict(), **changes}))
    return str(path)


def _regular_file(tmp_path) -> str:
    path = tmp_path / "a_file"
    path.write_text("")
    return str(path)


@pytest.mark.parametrize(
    "kw,words",
    [
        # planner_hardware: a bundled name, "auto" or a profile JSON that exists and parses
        (dict(planner_hardware="h999"), ["planner_hardware='h999'", "h800", "'auto'"]),
        (lambda t: dict(planner_hardware=str(t / "missing.json")), ["planner_hardware=", "missing.json", "measure"]),
        (lambda t: dict(planner_hardware=_profile_json(t, peak_tflops=float("nan"))), ["planner_hardware=", "nan"]),
        (lambda t: dict(planner_hardware=_profile_json(t, h2d_gbps=-1.0)), ["planner_hardware=", "h2d_gbps=-1.0"]),
        (lambda t: dict(planner_hardware=_profile_json(t, nvme_capacity_bytes=float("nan"))), ["nvme_capacity"]),
        (lambda t: dict(planner_hardware=_profile_json(t, text="{")), ["planner_hardware=", "not valid JSON"]),
        (lambda t: dict(planner_hardware=_profile_json(t, text="[1, 2]")), ["planner_hardware=", "JSON object"]),
        (dict(planner_hardware=7), ["planner_hardware=7"]),
        (dict(activation_tiers=5), ["activation_tiers=5", "list"]),
        (dict(activation_tiers=[]), ["activation_tiers=[]", "gpu, cpu, nvme"]),
        # activation_nvme_dir: an existing, writable directory
        (dict(activation_nvme_dir="/proc/nope"), ["activation_nvme_dir='/proc/nope'", "mkdir -p"]),
        (lambda t: dict(activation_nvme_dir=_regular_file(t)), ["activation_nvme_dir=", "not a directory"]),
        (dict(activation_nvme_dir=5), ["activation_nvme_dir=5", "path"]),
        # types: HfArgumentParser converts, Python callers can pass anything
        (dict(stream_prefetch_depth=1.5), ["stream_prefetch_depth=1.5", "int"]),
        (dict(stream_prefetch_depth=True), ["stream_prefetch_depth=True", "int"]),
        (dict(stream_enabled="yes"), ["stream_enabled='yes'", "bool", "True or False"]),
        (dict(stream_embeddings=1), ["stream_embeddings=1", "bool"]),
        (dict(stream_loss_chunk_tokens=True), ["stream_loss_chunk_tokens=True", "int"]),
        (dict(planner_time_limit="30"), ["planner_time_limit='30'", "number"]),
        (dict(planner_time_limit=float("nan")), ["planner_time_limit=nan"]),
        (dict(planner_mip_gap=False), ["planner_mip_gap=False", "number"]),
        (dict(planner_auto_batch_size="no"), ["planner_auto_batch_size='no'", "bool"]),
        (dict(planner_max_batch_size=8.0), ["planner_max_batch_size=8.0", "int"]),
        (dict(planner_warmup_steps=None), ["planner_warmup_steps=None", "int"]),
        (dict(optim_block_size=256.0), ["optim_block_size=256.0", "int"]),
        (dict(optim_min_8bit_size="4096"), ["optim_min_8bit_size='4096'", "int"]),
        (dict(optim_hybrid_8bit="true"), ["optim_hybrid_8bit='true'", "bool", "None"]),
        (dict(optim_overlap_forward=1), ["optim_overlap_forward=1", "bool", "None"]),
        # what streaming cannot do
        (dict(fp16=True), ["fp16=True", "stream_enabled=True", "bf16=True", "stream_enabled=False"]),
        (dict(optim="sgd"), ["optim='sgd'", "HybridAdamW8bit", "optim_", "stream_enabled=False"]),
        (dict(optim="adafactor"), ["optim='adafactor'", "HybridAdamW8bit"]),
    ],
)
def test_construction_refuses_with_option_value_and_fix(tmp_path, kw, words):
    kw = kw(tmp_path) if callable(kw) else kw
    with pytest.raises((ValueError, TypeError)) as e:
        make(**kw)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_nvme_dir_not_writable_is_refused(tmp_path, monkeypatch):
    """Simulated: tests run as root, which writes through permission bits, so `os.access` is made to say no."""
    import lazytrain_hf.args as args_mod

    monkeypatch.setattr(args_mod.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match="not writable") as e:
        make(activation_nvme_dir=str(tmp_path))
    assert f"activation_nvme_dir={str(tmp_path)!r}" in str(e.value)


def test_accepted_values(tmp_path):
    from lazytrain_hf.planner.hardware import get_profile

    measured = tmp_path / "measured.json"
    get_profile("rtx3090").to_json(str(measured))
    for kw in (
        dict(planner_hardware="h800"),
        dict(planner_hardware="auto"),
        dict(planner_hardware=str(measured)),
        dict(activation_nvme_dir=str(tmp_path)),
        dict(planner_time_limit=5, planner_mip_gap=0, stream_prefetch_depth=0),
        dict(optim_hybrid_8bit=None, optim_overlap_forward=False),
        dict(fp16=True, stream_enabled=False),
        dict(optim="sgd", stream_enabled=False),
        dict(bf16=True, use_cpu=True),
    ):
        make(**kw)
    a = make(planner_time_limit=5)
    assert isinstance(a.planner_time_limit, float) and a.planner_time_limit == 5.0


def test_upgrade_refuses_a_non_default_optimizer():
    plain = TrainingArguments(output_dir="o", optim="adafactor", report_to=[])
    with pytest.raises(ValueError, match="optim='adafactor'"):
        LazyTrainingArguments.from_training_arguments(plain)
    up = LazyTrainingArguments.from_training_arguments(plain, stream_enabled=False)
    assert up.optim == plain.optim
    default = TrainingArguments(output_dir="o", report_to=[])
    assert LazyTrainingArguments.from_training_arguments(default).optim == default.optim


# ---------------------------------------------------------------------------------------------- subclass upgrade
@dataclasses.dataclass
class _OwnArgs(Seq2SeqTrainingArguments):
    """A user's TrainingArguments subclass: its own field, its own default for a TrainingArguments field and its
    own __post_init__ (counted)."""

    calls: ClassVar[int] = 0
    extra_flag: int = dataclasses.field(default=7)
    learning_rate: float = dataclasses.field(default=1e-3)

    def __post_init__(self):
        _OwnArgs.calls += 1
        if self.extra_flag < 0:
            raise ValueError("extra_flag must be >= 0")
        super().__post_init__()


def test_upgrade_keeps_a_training_arguments_subclass_and_its_fields():
    s2s = Seq2SeqTrainingArguments(
        output_dir="o", predict_with_generate=True, generation_max_length=17, learning_rate=3e-4, report_to=[]
    )
    up = LazyTrainingArguments.from_training_arguments(s2s)
    assert isinstance(up, LazyTrainingArguments) and isinstance(up, Seq2SeqTrainingArguments)
    assert up.predict_with_generate is True and up.generation_max_length == 17 and up.learning_rate == 3e-4
    assert up.stream_enabled is True and up.activation_tiers == ["gpu", "cpu"] and up.optim_hybrid_8bit is True
    # one class per user class; an upgraded object is returned as is, overrides make a new one of the same class
    again = LazyTrainingArguments.from_training_arguments(Seq2SeqTrainingArguments(output_dir="p", report_to=[]))
    assert type(again) is type(up)
    assert LazyTrainingArguments.from_training_arguments(up) is up
    over = LazyTrainingArguments.from_training_arguments(up, stream_prefetch_depth=2)
    assert type(over) is type(up) and over.stream_prefetch_depth == 2 and over.generation_max_length == 17
    # LazyTrainingArguments' checks run on the upgraded object
    with pytest.raises(ValueError, match="stream_prefetch_depth=-1"):
        LazyTrainingArguments.from_training_arguments(s2s, stream_prefetch_depth=-1)
    # Trainer pickles args into every checkpoint (training_args.bin)
    back = pickle.loads(pickle.dumps(up))
    assert type(back) is type(up) and back.to_dict() == up.to_dict()


def test_upgraded_subclass_defaults_and_post_init_run_once():
    own = _OwnArgs(output_dir="o", extra_flag=3, report_to=[])
    _OwnArgs.calls = 0
    up = LazyTrainingArguments.from_training_arguments(own)
    assert _OwnArgs.calls == 1
    assert isinstance(up, _OwnArgs) and isinstance(up, LazyTrainingArguments)
    assert up.extra_flag == 3 and up.learning_rate == 1e-3
    defaults = {f.name: f.default for f in dataclasses.fields(type(up))}
    assert defaults["learning_rate"] == 1e-3 and defaults["extra_flag"] == 7  # the user's class
    assert defaults["stream_enabled"] is True and defaults["optim_block_size"] == 256  # LazyTrainingArguments
    fresh = type(up)(output_dir="o", report_to=[])
    assert fresh.learning_rate == 1e-3 and fresh.stream_prefetch_depth == 1
    # both validations run: the user's and LazyTrainingArguments'
    with pytest.raises(ValueError, match="extra_flag"):
        LazyTrainingArguments.from_training_arguments(own, extra_flag=-1)
    with pytest.raises(ValueError, match="optim_block_size=100"):
        LazyTrainingArguments.from_training_arguments(own, optim_block_size=100)


def test_planner_dp_reduce_every_choices():
    assert make().planner_dp_reduce_every == "auto"
    assert make(planner_dp_reduce_every="step").planner_dp_reduce_every == "step"
    assert make(planner_dp_reduce_every="micro_batch", planner_dp_reduce="device").planner_dp_reduce == "device"
