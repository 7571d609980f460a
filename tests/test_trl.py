"""LazySFTTrainer / LazySFTConfig: TRL's SFTTrainer streamed by LazyTrain, against the unmodified SFTTrainer.

Tolerances. Streaming only moves data; the chunked loss (`stream_loss_chunk_tokens` per chunk) and TRL's fused LM head
sum the same fp32 terms in another order, so per-step losses and the logged entropy agree to a relative 1e-5 (measured:
<= 2e-7) with an SFTTrainer run that uses the same HybridAdamW8bit; weights as in test_trainer_lazy. Token accuracy
and `num_tokens` are counts: equal (an arg-max tie flipped by the last fp32 digit would show up here).
"""

from __future__ import annotations

import dataclasses
import random
import re
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import tiny_model
from trainer_fixtures import RUN_ARGS, LossRecorder

LOSS_RTOL = 1e-5
# bytes: forces layers to stream (tiny qwen3, vocab 260, 2 x 61 tokens, gradient accumulation 2, whose resident
# gradients are held through both micro-batches: memmodel.carried_grad_bytes), whatever layer times the warm-up
# measures: below the least peak of any plan that keeps every layer resident (874816 B: every layer recomputed, the
# first two inputs on the CPU; at 1.0 MB such a plan fits, 0.97 MB, and the MILP took it when a loaded machine timed
# the warm-up), above the least peak of all plans (800832 B)
TIGHT_BUDGET = 840_000
STEPS = 3
SFT_LOGS = ("mean_token_accuracy", "entropy", "num_tokens")
HINT = "pip install 'lazytrain-hf[trl]'"


@pytest.fixture(scope="module")
def trl():
    return pytest.importorskip("trl", minversion="1.16", reason=f"the TRL tests need the trl extra: {HINT}")


@pytest.fixture(scope="module")
def tokenizer():
    from lazytrain_hf.data import build_embedded_tokenizer

    return build_embedded_tokenizer(vocab_size=256, num_samples=300)  # offline, ~0.5 s


@pytest.fixture(scope="module")
def sft_dataset():
    """Conversational prompt-completion rows (SFT masks the prompt: completion_only_loss defaults to on)."""
    from datasets import Dataset

    rng = random.Random(0)
    rows = []
    for _ in range(16):
        a, b = rng.randint(1, 99), rng.randint(1, 999)
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
                "completion": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}],
            }
        )
    return Dataset.from_list(rows)


def _common(out) -> dict:
    return dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-3,
        **RUN_ARGS,
        max_length=64,
        bf16=False,
    )


def _spy_fused_head(trainer) -> list[bool]:
    """Record, per model call, whether TRL's fused LM head was asked for (`fused_lm_head=True`). A forward pre-hook,
    not a wrapper of `forward`: LazyTrainer honours a user's forward by computing the loss through it."""
    calls: list[bool] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(bool(kwargs.get("fused_lm_head", False))), with_kwargs=True
    )
    return calls


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(trl, tokenizer, sft_dataset, tmp_path_factory):
    """The unmodified `trl.SFTTrainer` with the same HybridAdamW8bit as LazyTrainer builds (Trainer's decay groups)."""
    from lazytrain_hf import HybridAdamW8bit

    model = tiny_model("qwen3", seed=1, vocab_size=len(tokenizer))
    args = trl.SFTConfig(**_common(tmp_path_factory.mktemp("ref")), activation_checkpointing=False)
    rec = LossRecorder()
    opt = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, block_size=256, min_8bit_size=4096)
    tr = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=sft_dataset,
        processing_class=tokenizer,
        callbacks=[rec],
        optimizer_cls_and_kwargs=(HybridAdamW8bit, opt),
    )
    fused = _spy_fused_head(tr)
    tr.train()
    assert any(fused), "the reference must compute its loss with TRL's fused LM head"
    return rec.logs, _weights(model)


@pytest.mark.parametrize(
    "name,extra",
    [
        ("milp", dict(planner_gpu_budget=TIGHT_BUDGET, stream_loss_chunk_tokens=64)),
        ("stream_embeddings", dict(stream_embeddings=True, planner_policy="all_recompute")),
        ("off", dict(stream_enabled=False)),
    ],
)
def test_lazy_sft_matches_sft_trainer(trl, tokenizer, sft_dataset, reference, tmp_path, name, extra):
    from lazytrain_hf import LazySFTConfig, LazySFTTrainer

    ref_logs, ref_w = reference
    model = tiny_model("qwen3", seed=1, vocab_size=len(tokenizer))
    args = LazySFTConfig(
        **_common(tmp_path),
        optim_hybrid_8bit=True,
        planner_hardware="cpu",
        planner_warmup_steps=1,
        planner_time_limit=10,
        **extra,
    )
    rec = LossRecorder()
    tr = LazySFTTrainer(model=model, args=args, train_dataset=sft_dataset, processing_class=tokenizer, callbacks=[rec])
    fused = _spy_fused_head(tr)
    tr.train()

    streamed = args.stream_enabled
    if streamed:
        assert not any(fused), "while streaming, the loss is the chunked loss, never TRL's fused head"
        assert not all(lp.resident for lp in tr.lazy_plan.layers), tr.lazy_plan.table()
    assert len(rec.logs) == len(ref_logs) == STEPS
    for step, (got, ref) in enumerate(zip(rec.logs, ref_logs), start=1):
        for key in SFT_LOGS:
            assert key in got, f"step {step}: {key} not logged: {got}"
        assert ("tokens_per_s" in got) == streamed, got
        assert got["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL), f"step {step}: {got} vs {ref}"
        assert got["entropy"] == pytest.approx(ref["entropy"], rel=LOSS_RTOL), f"step {step}: {got} vs {ref}"
        assert got["mean_token_accuracy"] == ref["mean_token_accuracy"], f"step {step}: {got} vs {ref}"
        assert got["num_tokens"] == ref["num_tokens"], f"step {step}: {got} vs {ref}"
    w = _weights(model)
    for k in ref_w:
        torch.testing.assert_close(w[k], ref_w[k], rtol=1e-4, atol=1e-6, msg=k)


def _trl_statistics(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(valid tokens, top-1 hits, entropy sum) from TRL's own fused-head kernel, as SFTTrainer.compute_loss logs them."""
    from trl.kernels import ChunkedLogProbFunction

    D = hidden.shape[-1]
    h, y = hidden[:, :-1].reshape(-1, D), labels[:, 1:].reshape(-1)
    mask = y != -100
    out = ChunkedLogProbFunction.apply(h[mask], weight, None, y[mask], 1.0, 4, None, 1.0, ("entropy", "is_top1"))
    _, entropy, _, _, is_top1 = out
    return int(mask.sum()), int(is_top1.sum()), entropy.sum()


def test_token_statistics_match_trl_fused_head(trl):
    """The chunked statistics equal TRL's own kernel: chunk sizes that do not divide the tokens, ignored labels, an
    arg-max tie (the first maximum wins, as TRL's `is_top1`), a prompt-learning adapter's virtual tokens."""
    from lazytrain_hf.trl import token_statistics

    g = torch.Generator().manual_seed(0)
    B, T, D, V = 3, 9, 16, 37
    weight = torch.randn(V, D, generator=g)
    weight[5] = weight[3] = 10 * weight[3] / weight[3].norm()  # rows 3 and 5 tie, above every other logit below
    hidden = torch.randn(B, T, D, generator=g)
    hidden[0, 0] = hidden[0, 1] = 5 * weight[3]
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 1], labels[0, 2] = 5, 3  # targets of the tied positions 0 and 1: the later and the earlier row
    labels[1, :4] = -100
    labels[2, 7] = -100

    valid, correct, entropy = _trl_statistics(hidden, weight, labels)
    # position 0 predicts rows 3 and 5 equally: target 5 (the later) is no top-1 hit, target 3 (the first) is
    assert [int(x) for x in token_statistics(hidden[:1, :2], weight, torch.tensor([[-100, 5]]))[:2]] == [1, 0]
    assert [int(x) for x in token_statistics(hidden[:1, :2], weight, torch.tensor([[-100, 3]]))[:2]] == [1, 1]
    for chunk in (1, 4, 7, 1000):
        got = token_statistics(hidden, weight, labels, chunk_tokens=chunk)
        assert [int(got[0]), int(got[1])] == [valid, correct], f"chunk {chunk}"
        torch.testing.assert_close(got[2], entropy, rtol=1e-5, atol=1e-5, msg=f"chunk {chunk}")

    # virtual tokens come first and PEFT pads the labels on the left with -100 (the last virtual token then predicts
    # the first real one): token_statistics pads labels shorter than the hidden states the same way
    virtual = torch.cat([torch.randn(B, 2, D, generator=g), hidden], 1)
    peft_labels = torch.cat([torch.full((B, 2), -100), labels], 1)
    valid, correct, entropy = _trl_statistics(virtual, weight, peft_labels)
    got = token_statistics(virtual, weight, labels, chunk_tokens=4)
    assert [int(got[0]), int(got[1])] == [valid, correct]
    torch.testing.assert_close(got[2], entropy, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- configuration
def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return out


CHANGED = {"gradient_checkpointing"}  # LazySFTConfig's documented change to SFTConfig's defaults


def test_config_keeps_sft_and_lazytrain_defaults(trl, tmp_path):
    from transformers import TrainingArguments

    from lazytrain_hf import LazySFTConfig, LazyTrainingArguments

    lazy, sft, lta = _defaults(LazySFTConfig), _defaults(trl.SFTConfig), _defaults(LazyTrainingArguments)
    different = sorted(n for n in sft if n not in CHANGED and lazy[n] != sft[n])
    assert not different, [(n, lazy[n], sft[n]) for n in different]
    lazy_only = set(lta) - {f.name for f in dataclasses.fields(TrainingArguments)}
    assert lazy_only and all(lazy[n] == lta[n] for n in lazy_only), [(n, lazy[n], lta[n]) for n in lazy_only]
    # SFTConfig's own fields and the TrainingArguments defaults it changes, as trl 1.16 defines them
    cfg = LazySFTConfig(output_dir=str(tmp_path), use_cpu=True)
    assert (cfg.max_length, cfg.completion_only_loss, cfg.assistant_only_loss) == (1024, None, False)
    assert (cfg.loss_type, cfg.packing, cfg.dataset_text_field, cfg.model_init_kwargs) == ("nll", False, "text", None)
    assert (cfg.learning_rate, cfg.logging_steps, cfg.bf16) == (2e-5, 10, True)
    # LazyTrain's
    assert cfg.stream_enabled and cfg.optim_hybrid_8bit and cfg.planner_policy == "milp"
    assert cfg.stream_loss_chunk_tokens == 1024 and cfg.activation_tiers == ["gpu", "cpu"]


def test_config_changed_default(trl, tmp_path):
    from lazytrain_hf import LazySFTConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = LazySFTConfig(output_dir=str(tmp_path), use_cpu=True)
    assert not [w for w in caught if "checkpointing" in str(w.message)], [str(w.message) for w in caught]
    sft = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True)
    # SFTConfig turns it on (Note: [SFT defaults LazySFTConfig changes] in lazytrain_hf/trl.py)
    assert sft.gradient_checkpointing and sft.activation_checkpointing
    assert cfg.gradient_checkpointing is False and cfg.activation_checkpointing is False
    off = LazySFTConfig(output_dir=str(tmp_path), use_cpu=True, stream_enabled=False, activation_checkpointing=True)
    assert off.gradient_checkpointing  # available again with streaming off


def test_config_runs_both_validations(trl, tmp_path):
    from lazytrain_hf import LazySFTConfig, LazyTrainingArguments

    with pytest.raises(ValueError, match="stream_prefetch_depth=-1"):  # LazyTrainingArguments'
        LazySFTConfig(output_dir=str(tmp_path), use_cpu=True, stream_prefetch_depth=-1)
    with pytest.warns(FutureWarning, match="chunked_nll"):  # SFTConfig's
        cfg = LazySFTConfig(output_dir=str(tmp_path), use_cpu=True, loss_type="chunked_nll", planner_gpu_budget="1GiB")
    assert cfg.loss_type == "nll" and cfg.pad_to_multiple_of is None  # SFTConfig's normalisations
    assert cfg.planner_gpu_budget == 2**30  # LazyTrainingArguments'
    assert isinstance(cfg, trl.SFTConfig) and isinstance(cfg, LazyTrainingArguments)


@pytest.mark.parametrize(
    "option",
    [
        dict(gradient_checkpointing=True),
        dict(activation_checkpointing=True),
        dict(activation_offloading=True),
        dict(loss_type="dft"),
    ],
)
def test_config_refuses_what_streaming_replaces(trl, tmp_path, option):
    from lazytrain_hf import LazySFTConfig

    name = next(iter(option))
    with pytest.raises(ValueError, match=name):
        LazySFTConfig(output_dir=str(tmp_path), use_cpu=True, **option)
    LazySFTConfig(output_dir=str(tmp_path), use_cpu=True, stream_enabled=False, **option)  # allowed unstreamed


def test_other_arguments_are_upgraded(trl, tmp_path, tokenizer, sft_dataset):
    from lazytrain_hf import LazySFTConfig, LazySFTTrainer, LazyTrainingArguments
    from lazytrain_hf.trl import as_lazy_sft_config

    sft = trl.SFTConfig(output_dir=str(tmp_path), max_length=77, learning_rate=3e-4, report_to=[], use_cpu=True)
    up = as_lazy_sft_config(sft)
    assert isinstance(up, LazySFTConfig) and (up.max_length, up.learning_rate, up.bf16) == (77, 3e-4, True)
    assert up.stream_enabled and not up.gradient_checkpointing  # turned off for streaming
    lta = LazyTrainingArguments(output_dir=str(tmp_path), stream_prefetch_depth=2, report_to=[])
    up = as_lazy_sft_config(lta)
    assert (up.stream_prefetch_depth, up.max_length, up.logging_steps, up.bf16) == (2, 1024, lta.logging_steps, False)
    off = LazyTrainingArguments(output_dir=str(tmp_path), stream_enabled=False, activation_checkpointing=True)
    assert as_lazy_sft_config(off).gradient_checkpointing  # kept: nothing streams

    model = tiny_model("qwen3", seed=1, vocab_size=len(tokenizer))
    tr = LazySFTTrainer(model=model, args=sft, train_dataset=sft_dataset, processing_class=tokenizer)
    assert isinstance(tr.args, LazySFTConfig) and tr.args.max_length == 77


def test_streams_with_sft_defaults(trl, tmp_path, tokenizer, sft_dataset):
    """SFTConfig's defaults (bf16 on: a bf16 compute copy of the fp32 model) train streamed and log SFT's metrics."""
    from lazytrain_hf import LazySFTConfig, LazySFTTrainer

    model = tiny_model("qwen3", seed=1, vocab_size=len(tokenizer))
    args = LazySFTConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=2,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        max_length=64,
        planner_hardware="cpu",
        planner_warmup_steps=1,
    )
    rec = LossRecorder()
    tr = LazySFTTrainer(model=model, args=args, train_dataset=sft_dataset, processing_class=tokenizer, callbacks=[rec])
    tr.train()
    assert args.bf16 and len(rec.logs) == 2
    for logs in rec.logs:
        assert all(key in logs for key in (*SFT_LOGS, "tokens_per_s")), logs
        assert torch.isfinite(torch.tensor(logs["loss"])) and 0 < logs["entropy"] <= torch.log(torch.tensor(260.0))
    assert rec.logs[-1]["num_tokens"] > rec.logs[0]["num_tokens"] > 0


def test_model_id_is_loaded_on_the_host(trl, tmp_path, tokenizer, sft_dataset, monkeypatch):
    """SFTTrainer loads a model id with device_map="auto" on a GPU machine; streamed, it stays on the host."""
    import lazytrain_hf.trl as lazy_trl
    from lazytrain_hf import LazySFTConfig, LazySFTTrainer

    path = tmp_path / "tiny"
    tiny_model("qwen3", seed=1, vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    loads = []

    def spy(model_id, **kwargs):
        loads.append(kwargs)
        return trl.trainer.utils.create_model_from_path(model_id, **kwargs)

    monkeypatch.setattr(lazy_trl, "create_model_from_path", spy)
    init = {"dtype": "float32"}
    args = LazySFTConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, model_init_kwargs=init)
    tr = LazySFTTrainer(model=str(path), args=args, train_dataset=sft_dataset)  # tokenizer loaded from the path
    assert len(loads) == 1 and loads[0]["device_map"] is None and loads[0]["dtype"] == "float32", loads
    assert tr.model.device.type == "cpu" and tr.model.dtype == torch.float32
    assert tr.args.model_init_kwargs == init  # kept in the arguments the checkpoints record


# ---------------------------------------------------------------------------------------------------- the extra
@pytest.mark.parametrize("name", ["LazySFTTrainer", "LazySFTConfig"])
def test_import_error_names_the_extra(monkeypatch, name):
    monkeypatch.setitem(sys.modules, "trl", None)  # as if trl were not installed
    monkeypatch.delitem(sys.modules, "lazytrain_hf.trl", raising=False)
    with pytest.raises(ImportError, match=re.escape(HINT)):
        exec(f"from lazytrain_hf import {name}", {})
    assert "lazytrain_hf.trl" not in sys.modules
    namespace: dict = {}
    exec("from lazytrain_hf import *", namespace)  # the rest of the package works without trl
    assert "LazyTrainer" in namespace and name not in namespace


def test_import_lazytrain_hf_does_not_import_trl():
    code = "import sys, lazytrain_hf; assert 'trl' not in sys.modules, 'trl imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
