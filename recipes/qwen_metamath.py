"""Fine-tune a Qwen model on MetaMathQA with `LazyTrainer`; report answer exact match before and after training.

With no arguments it trains a tiny Qwen3 (built from a config) on the bundled offline sample of arithmetic word
problems, on CPU, in a few minutes, and needs no network. The embedded default plans under a tight device budget
(`EMBEDDED_PLANNER_DEFAULTS`), so the printed plan streams layers, offloads activations to the CPU and recomputes
others, and the run trains through those paths; the simulated timeline is written next to the plan:

    python recipes/qwen_metamath.py
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/qwen_metamath.py

Data parallel over 2 CPU processes (gloo; each rank holds and updates the training state of its own layers):

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/qwen_metamath.py

A real model on a GPU (needs the Hub, or local paths for both names):

    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/qwen_metamath.py \\
        --model_name_or_path Qwen/Qwen2.5-3B --dataset_name meta-math/MetaMathQA --bf16 True \\
        --max_seq_length 512 --num_train_samples 20000 --per_device_train_batch_size 8 --max_steps 2500 \\
        --learning_rate 1e-5 --warmup_steps 100 --num_eval_samples 500 --per_device_eval_batch_size 32 \\
        --output_dir runs/qwen2.5-3b-metamath

Override example (any `LazyTrainingArguments` / `TrainingArguments` field is a flag):

    python recipes/qwen_metamath.py --max_steps 300 --learning_rate 1e-3 --stream_enabled False \\
        --dataset_name data/metamath_subset.jsonl --output_dir runs/short

The recipe evaluates exact match (greedy generation, left padding, answers normalised by the bundled `evaluate`
module) on the eval split before and after training, saves model + tokenizer to ``output_dir`` with
``trainer.save_model`` (and ``eval_results.json``), pushes to the Hub when ``--push_to_hub`` is given, and prints a
one-line summary.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

# the recipe runs from a checkout as well as from an installed package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    set_seed,
)
from transformers.utils import logging  # noqa: E402

from lazytrain_hf import LazyTrainer, LazyTrainingArguments  # noqa: E402
from lazytrain_hf import from_pretrained as lazy_from_pretrained  # noqa: E402
from lazytrain_hf.data import (  # noqa: E402
    EMBEDDED,
    CausalLMCollator,
    build_embedded_tokenizer,
    format_dataset,
    hub_unavailable,
    is_offline_error,
    load_splits,
)
from lazytrain_hf.metrics import evaluate_exact_match, load_exact_match  # noqa: E402
from lazytrain_hf.training.planning import TIMELINE_FILE  # noqa: E402

logger = logging.get_logger("lazytrain_hf.recipes.qwen_metamath")

# The embedded model: a tiny Qwen3 that learns the bundled two-digit word problems in a few CPU minutes.
EMBEDDED_MODEL_CONFIG = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)

# Planner defaults of the embedded model (each applies unless its flag is given): a device budget just above the
# least that fits (56.8 MiB at the first micro-batch, 32 x 87 tokens, under `planner/memmodel.py`), so the MILP has to
# stream weights, put activations or recompute inputs on the CPU and recompute; the bundled `cpu` profile and the cost
# model's layer times (no timed warm-up) make that plan the same on every machine. The host budget (the ~14 MiB
# training state and room for about 2.5 layers' offloaded activations) matters on the synchronous CPU engine, where an
# offloaded tensor is copied out as it is saved and costs the device nothing in the forward: without it the MILP
# would offload every layer and keep all weights resident. `--planner_hardware auto --planner_warmup_steps 2`
# measures this machine instead.
EMBEDDED_PLANNER_DEFAULTS: dict[str, Any] = dict(
    planner_gpu_budget="57.5MiB",
    planner_host_budget="110MiB",
    planner_hardware="cpu",
    planner_warmup_steps=0,
)

# TrainingArguments defaults this recipe changes: CPU-friendly, sized for the embedded model and sample.
RECIPE_DEFAULTS: dict[str, Any] = dict(
    output_dir="runs/qwen_metamath",
    report_to="none",
    max_steps=400,
    per_device_train_batch_size=32,
    per_device_eval_batch_size=64,
    learning_rate=1e-3,
    lr_scheduler_type="cosine",
    warmup_steps=20,
    weight_decay=0.0,
    logging_steps=50,
    save_strategy="no",
    seed=0,
)


@dataclass
class ScriptArguments:
    """Recipe options; every `LazyTrainingArguments` field is accepted alongside these."""

    model_name_or_path: str = field(
        default=EMBEDDED,
        metadata={"help": "Hub name or local directory of a Qwen-family causal LM, or 'embedded' for a tiny Qwen3 "
                  "built from a config (no download)."},
    )  # fmt: skip
    dataset_name: str = field(
        default=EMBEDDED,
        metadata={"help": "'embedded' (bundled offline arithmetic sample), a Hub dataset such as "
                  "'meta-math/MetaMathQA', or a local .json/.jsonl file with 'query' and 'response' fields."},
    )  # fmt: skip
    max_seq_length: int = field(default=512, metadata={"help": "Longest training sequence (prompt + response)."})
    overlong: str = field(
        default="truncate",
        metadata={"help": "Rows longer than max_seq_length: 'truncate' the response, 'drop' the row or 'error'."},
    )
    num_train_samples: int | None = field(
        default=None, metadata={"help": "Training rows to use (default: all rows not held out for evaluation)."}
    )
    num_eval_samples: int = field(default=200, metadata={"help": "Held-out rows for exact-match evaluation."})
    eval_max_new_tokens: int | None = field(
        default=None,
        metadata={"help": "Generation length for evaluation (default: longest eval reference response + 16 tokens)."},
    )
    dtype: str = field(
        default="auto", metadata={"help": "dtype to load a pretrained model in: auto, float32, bfloat16, float16."}
    )
    num_threads: int | None = field(
        default=None,
        metadata={"help": "torch CPU threads. Default: 1 for the embedded model on CPU unless OMP_NUM_THREADS is set "
                  "(its matrices are too small to gain from more, and spinning threads stall on a shared CPU), "
                  "else torch's default."},
    )  # fmt: skip
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow model code from the Hub repository to run (off by default)."}
    )

    def __post_init__(self) -> None:
        if self.max_seq_length < 2:
            raise ValueError(f"--max_seq_length={self.max_seq_length} must be >= 2 (e.g. 512).")
        if self.num_eval_samples < 1:
            raise ValueError(f"--num_eval_samples={self.num_eval_samples} must be >= 1 (e.g. 200).")
        if self.num_train_samples is not None and self.num_train_samples < 1:
            raise ValueError(f"--num_train_samples={self.num_train_samples} must be >= 1 (or omitted for all rows).")
        if self.eval_max_new_tokens is not None and self.eval_max_new_tokens < 1:
            raise ValueError(f"--eval_max_new_tokens={self.eval_max_new_tokens} must be >= 1 (e.g. 256).")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num_threads={self.num_threads} must be >= 1 (or omitted).")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype={self.dtype!r} is not supported; use auto, float32, bfloat16 or float16.")


def make_parser() -> HfArgumentParser:
    """`HfArgumentParser` over (`ScriptArguments`, `LazyTrainingArguments`) with the recipe's defaults."""
    parser = HfArgumentParser((ScriptArguments, LazyTrainingArguments))
    parser.set_defaults(**RECIPE_DEFAULTS, use_cpu=not torch.cuda.is_available())
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, LazyTrainingArguments]:
    """Parse ``argv`` (default ``sys.argv[1:]``); the embedded model gets `EMBEDDED_PLANNER_DEFAULTS` where its
    flags are not given."""
    parser = make_parser()
    script_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    if script_args.model_name_or_path == EMBEDDED:
        parser.set_defaults(**EMBEDDED_PLANNER_DEFAULTS)
        script_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    return script_args, training_args


def _load_tokenizer(args: ScriptArguments):
    if args.model_name_or_path == EMBEDDED:
        return build_embedded_tokenizer()
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    except OSError as e:
        if not os.path.isdir(args.model_name_or_path) and is_offline_error(e):
            raise hub_unavailable("model", args.model_name_or_path, "--model_name_or_path", e) from e
        raise
    if tokenizer.pad_token is None:
        # Labels come from the formatted rows, not from pad ids, so pad == eos does not hide the real eos.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_model(args: ScriptArguments, tokenizer, seed: int, weights_on_disk: bool = False):
    """The model to train. ``weights_on_disk`` (``--state_nvme_dir``: a model whose state may not fit in RAM): its
    decoder layers are left on disk (`lazytrain_hf.from_pretrained`) and read layer by layer into the host store."""
    if args.model_name_or_path == EMBEDDED:
        config = AutoConfig.for_model(
            "qwen3",
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **EMBEDDED_MODEL_CONFIG,
        )
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    if weights_on_disk:
        return lazy_from_pretrained(args.model_name_or_path, dtype=dtype, trust_remote_code=args.trust_remote_code)
    try:
        return AutoModelForCausalLM.from_pretrained(
            args.model_name_or_path, dtype=dtype, trust_remote_code=args.trust_remote_code
        )
    except OSError as e:
        if not os.path.isdir(args.model_name_or_path) and is_offline_error(e):
            raise hub_unavailable("model", args.model_name_or_path, "--model_name_or_path", e) from e
        raise


def plan_summary(plan) -> str:
    """How many layers the plan streams, offloads to the CPU (activations, or a recomputed layer's input) and
    recomputes, e.g. ``"4/4 layers streamed, 2 offload to cpu, 2 recomputed"``."""
    layers = plan.layers
    streamed = sum(not lp.resident for lp in layers)
    to_cpu = sum(lp.tier == "cpu" for lp in layers)
    recomputed = sum(lp.policy == "recompute" for lp in layers)
    return f"{streamed}/{len(layers)} layers streamed, {to_cpu} offload to cpu, {recomputed} recomputed"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the recipe; ``argv`` defaults to ``sys.argv[1:]``. Returns the metrics it printed and saved."""
    script_args, training_args = parse_args(argv)
    t_start = time.perf_counter()
    set_seed(training_args.seed)
    threads = script_args.num_threads
    if threads is None and script_args.model_name_or_path == EMBEDDED and training_args.use_cpu:
        threads = None if "OMP_NUM_THREADS" in os.environ else 1
    if threads is not None:
        torch.set_num_threads(threads)
    is_main = training_args.process_index == 0

    # ---- data first: a bad dataset or an unreachable Hub fails before any model is built
    tokenizer = _load_tokenizer(script_args)
    data_seed = training_args.data_seed if training_args.data_seed is not None else training_args.seed
    train_rows, eval_rows = load_splits(
        script_args.dataset_name, script_args.num_train_samples, script_args.num_eval_samples, seed=data_seed
    )
    train_dataset = format_dataset(
        train_rows, tokenizer, script_args.max_seq_length, script_args.overlong, source=script_args.dataset_name
    )
    max_new_tokens = script_args.eval_max_new_tokens
    if max_new_tokens is None:
        longest = max(
            len(ids) for ids in tokenizer(list(eval_rows["response"]), add_special_tokens=False)["input_ids"]
        )
        max_new_tokens = longest + 16
    on_disk = bool(training_args.stream_enabled and training_args.state_nvme_dir)
    model = _load_model(script_args, tokenizer, training_args.seed, weights_on_disk=on_disk)

    trainer = LazyTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        data_collator=CausalLMCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
    )
    metric = load_exact_match(experiment_id=f"qwen_metamath-{os.getpid()}")

    def exact_match() -> tuple[float, list[str], float]:
        t0 = time.perf_counter()
        result = evaluate_exact_match(
            trainer.model, tokenizer, eval_rows, max_new_tokens, training_args.per_device_eval_batch_size, metric
        )
        return result["exact_match"], result["predictions"], time.perf_counter() - t0

    # ---- exact match before training
    em_before, _, eval_s_before = exact_match()
    if is_main:
        print(f"[qwen_metamath] exact match before training: {em_before:.2%} on {len(eval_rows)} eval problems "
              f"({eval_s_before:.1f} s)", flush=True)  # fmt: skip

    # ---- train
    train_output = trainer.train()

    plan = trainer.lazy_plan
    if is_main and plan is not None:
        print(f"[qwen_metamath] the plan it trained with ({plan_summary(plan)}):\n{plan.table()}", flush=True)
        timeline = os.path.join(training_args.output_dir, TIMELINE_FILE)
        if os.path.isfile(timeline):
            print(f"[qwen_metamath] timeline of one step, as the simulator replays the plan: {timeline}", flush=True)

    # ---- exact match after training
    em_after, predictions, eval_s_after = exact_match()
    if is_main:
        print(f"[qwen_metamath] exact match after training: {em_after:.2%} on {len(eval_rows)} eval problems "
              f"({eval_s_after:.1f} s)", flush=True)  # fmt: skip
    metrics = {
        "exact_match_before": em_before,
        "exact_match_after": em_after,
        "num_eval_samples": len(eval_rows),
        "num_train_samples": len(train_dataset),
        "train_loss": train_output.training_loss,
        "train_runtime": train_output.metrics.get("train_runtime"),
        "global_step": train_output.global_step,
        "eval_max_new_tokens": max_new_tokens,
        "eval_seconds_before": eval_s_before,
        "eval_seconds_after": eval_s_after,
        "train_losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }
    trainer.log({"eval_exact_match_before": em_before, "eval_exact_match": em_after})

    # ---- save: the evaluation record, then model + tokenizer; with --push_to_hub, `push_to_hub` saves them and
    # uploads output_dir (evaluation record and model card included) in one commit
    if trainer.is_world_process_zero():
        os.makedirs(training_args.output_dir, exist_ok=True)
        trainer.save_metrics("eval", metrics)
        samples = [
            {"query": q, "reference": r, "prediction": p}
            for q, r, p in zip(eval_rows["query"][:20], eval_rows["response"][:20], predictions[:20])
        ]
        with open(os.path.join(training_args.output_dir, "eval_predictions.json"), "w", encoding="utf-8") as f:
            json.dump(samples, f, indent=2)
    if training_args.push_to_hub:
        card: dict[str, Any] = {"tags": ["lazytrain", "metamath"], "dataset": script_args.dataset_name}
        if script_args.model_name_or_path != EMBEDDED:
            card["finetuned_from"] = script_args.model_name_or_path
        trainer.push_to_hub(commit_message=f"exact match {em_before:.2%} -> {em_after:.2%}", **card)
    else:
        trainer.save_model(training_args.output_dir)

    metrics["wall_seconds"] = time.perf_counter() - t_start
    if is_main:
        print(
            f"[qwen_metamath] model={script_args.model_name_or_path} dataset={script_args.dataset_name} "
            f"steps={train_output.global_step} train_loss={train_output.training_loss:.4f} "
            f"exact_match before={em_before:.2%} after={em_after:.2%} (n={len(eval_rows)}) "
            f"wall={metrics['wall_seconds']:.0f}s saved={training_args.output_dir}",
            flush=True,
        )
    return metrics


if __name__ == "__main__":
    main()
