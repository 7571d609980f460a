"""Host memory: the footprint `lazytrain_hf.planner.hostmem` predicts is what a run's RSS shows, over a training
step and over a save, and `check_host_memory` refuses a run over its budget before anything is allocated.

The RSS measurements run in a fresh process per case with ``MALLOC_MMAP_THRESHOLD_=65536`` (every buffer of 64 KiB
or more is its own mapping, so freed memory leaves the RSS and VmHWM follows live bytes) and VmHWM reset through
``/proc/self/clear_refs``. The model is a qwen3 of 23M parameters (92 MB fp32), with 16 tokens per step so that
activations (not predicted on a CPU device, ~1%) stay in the noise. On a CPU device the "device" is host RAM, so
the prediction includes the `device_on_host` term (resident parameters and their gradients, slots, one layer's
device gradients); on CUDA those live on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_config, tiny_model

from lazytrain_hf.planner import hostmem
from lazytrain_hf.planner.plan import Plan
from lazytrain_hf.streaming import attach
from lazytrain_hf.training import planning

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------- accounting = the store's own byte count
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stream_embeddings", [False, True])
def test_streamed_terms_equal_the_store(dtype, stream_embeddings):
    model = tiny_model("qwen3").to(dtype)
    kinds = ["full_attention"] * 4
    plan = Plan.default(4, kinds, stream_embeddings=stream_embeddings)
    fp = hostmem.run_footprint(model, plan, device="cpu")
    with attach(model, plan=plan, device="cpu") as handle:
        hb = handle.store.host_bytes()
        assert fp.compute == hb["compute"] and fp.masters - _resident_masters(handle) == hb["master"]
        assert fp.grads == hb["grad"]
        from lazytrain_hf.optim import HybridAdamW8bit
        from lazytrain_hf.training.updater import LayerwiseUpdater

        up = LayerwiseUpdater(handle)
        opt = HybridAdamW8bit([m for _, m in up.named_masters()])
        assert fp.optimizer == opt.state_bytes()
        up.close()


def _resident_masters(handle) -> int:
    """fp32 host masters of resident parameters that are not the parameter itself (updater.py)."""
    n = 0
    for _, p in handle.resident_parameters():
        if not (p.device.type == "cpu" and p.dtype == torch.float32):
            n += 4 * p.numel()
    return n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_arena_sized_by_the_footprint_holds_the_store(dtype):
    """`HostStore.reserve(fp.pinned_bytes)`: every compute copy and gradient accumulator is a view of one block
    (one pinned registration on CUDA, no rounding), bit-equal to the per-buffer store, and the block is used up to
    its last alignment padding."""
    from lazytrain_hf.streaming.store import ALIGN_BYTES, HostStore

    model = tiny_model("qwen3").to(dtype)
    plan = Plan.default(4, ["full_attention"] * 4)
    fp = hostmem.run_footprint(model, plan, device="cpu")
    names = {id(p): n for n, p in model.named_parameters()}
    layers = [[(names[id(p)], p) for p in layer.parameters()] for layer in model.model.layers]
    plain = HostStore()
    for i, ps in enumerate(layers):
        plain.add_layer(i, "full_attention", ps)
    arena_store = HostStore()
    arena = arena_store.reserve(fp.pinned_bytes)
    for i, ps in enumerate(layers):
        arena_store.add_layer(i, "full_attention", ps)
    block = arena.block.untyped_storage().data_ptr()
    for i, ls in arena_store.layers.items():
        ref = plain.layers[i]
        for a, b in ((ls.compute_bytes, ref.compute_bytes), (ls.grad, ref.grad)):
            assert a.untyped_storage().data_ptr() == block and torch.equal(a, b)
        if ref.master is not None:
            assert torch.equal(ls.master, ref.master)
    assert fp.pinned_bytes - ALIGN_BYTES < arena.used <= fp.pinned_bytes
    with pytest.raises(ValueError, match="cannot hold"):
        arena.carve(fp.pinned_bytes, torch.uint8)


def test_check_host_memory_counts_every_term_and_names_the_budget():
    model = tiny_model("qwen3")
    fp = planning.host_footprint(None, model)
    need = max(fp.total, fp.save_peak)
    planning.check_host_memory(None, model, hybrid_8bit=True, budget=need)  # exactly fits
    with pytest.raises(ValueError) as e:
        planning.check_host_memory(None, model, hybrid_8bit=True, budget=need - 1)
    msg = str(e.value)
    for term in ("fp32 masters", "gradients", "optimizer state", "checkpoint-save transient", f"{need} bytes"):
        assert term in msg, (term, msg)
    assert "planner_host_budget" in msg


def test_check_host_memory_reads_only_shapes(tmp_path):
    """Runs before anything is allocated: on a meta model (`from_pretrained`), no weight is read."""
    import lazytrain_hf

    tiny_model("qwen3").save_pretrained(tmp_path)
    lm = lazytrain_hf.from_pretrained(str(tmp_path))
    ref = planning.host_footprint(None, tiny_model("qwen3"))
    assert planning.host_footprint(None, lm).as_dict() == ref.as_dict()


def test_cost_model_host_state_uses_the_same_terms():
    from lazytrain_hf.planner.costmodel import CostModel

    cfg = tiny_config("qwen3")
    cm = CostModel.from_config(cfg, "h800", seq_len=16, micro_batch_size=1, dtype_bytes=2)
    fp = hostmem.counts_footprint([lc.params for lc in cm.layers], cm.embed_params, cm.head_params, 2)
    assert cm.host_state_bytes == max(fp.total, fp.save_peak) and fp.staging > 0 and fp.checkpoint > 0
    # bf16: compute 2 + master 4 + grad 4 + 8-bit moments 2 + scales per streamed parameter
    n = sum(lc.params for lc in cm.layers)
    assert fp.compute >= 2 * n and fp.masters >= 4 * n and fp.grads >= 4 * n


# ---------------------------------------------------------------------- measured RSS
RSS_SCRIPT = textwrap.dedent(
    """
    import gc, json, os, sys
    import torch
    from conftest import tiny_config
    from trainer_fixtures import token_dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from lazytrain_hf import LazyTrainer, LazyTrainingArguments
    from lazytrain_hf.optim import HybridAdamW8bit
    from lazytrain_hf.training import planning

    dtype, stream_embeddings, out = sys.argv[1], sys.argv[2] == "1", sys.argv[3]

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    def reset_peak():
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return status("VmRSS")

    # oneDNN caches packed bf16 weights for CPU matmuls (16 MiB here): the compute library's workspace, which on a
    # GPU is device memory, not the run's host footprint; the reference kernels keep none
    torch.backends.mkldnn.enabled = False
    # the optimizer kernel loaded (and built, if needed) before anything is measured
    w = torch.nn.Parameter(torch.zeros(8192))
    w.grad = torch.ones(8192)
    HybridAdamW8bit([w]).step()
    del w

    cfg = tiny_config("qwen3", hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=64, num_hidden_layers=6, vocab_size=4096, attn_implementation="eager")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    args = LazyTrainingArguments(
        output_dir=out, per_device_train_batch_size=1, max_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[],
        use_cpu=True, planner_policy="default", save_strategy="no", stream_embeddings=stream_embeddings,
    )
    ds = token_dataset(n=4, T=16, vocab=4096)
    result = {}

    class Measure(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if state.global_step != 2:
                return
            result["step_hwm"] = status("VmHWM")
            rss = reset_peak()
            trainer._save(os.path.join(out, "saved"))
            result["save_hwm"] = status("VmHWM")
            result["before_save"] = rss

    trainer = LazyTrainer(model=model, args=args, train_dataset=ds, callbacks=[Measure()])
    fp = planning.host_footprint(None, model, hybrid_8bit=True, args=args)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    base = reset_peak() - model_bytes  # the model's own weights are replaced by (or are) the run's state
    trainer.train()
    print(json.dumps({"fp": fp.as_dict(), "base": base, "model_bytes": model_bytes, **result}))
    """
)


def _measure(tmp_path, dtype: str, stream_embeddings: bool) -> dict:
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="65536",
        LAZYTRAIN_SIMULATE_ASYNC="0",
        OMP_NUM_THREADS="2",
        PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    cmd = [sys.executable, "-c", RSS_SCRIPT, dtype, "1" if stream_embeddings else "0", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=HERE)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("stream_embeddings", [False, True])
def test_measured_peak_rss_matches_the_footprint(tmp_path, dtype, stream_embeddings):
    r = _measure(tmp_path, dtype, stream_embeddings)
    fp = r["fp"]
    step = r["step_hwm"] - r["base"]
    save = r["save_hwm"] - r["base"]
    mib = 1 << 20
    print(
        f"{dtype} stream_embeddings={stream_embeddings}: step peak measured {step / mib:.1f} MiB, predicted "
        f"{fp['total'] / mib:.1f} MiB ({step / fp['total'] - 1:+.1%}); save peak measured {save / mib:.1f} MiB, "
        f"predicted {fp['save_peak'] / mib:.1f} MiB ({save / fp['save_peak'] - 1:+.1%}); terms "
        + ", ".join(f"{k}={v / mib:.1f}" for k, v in fp.items() if v and k not in ("total", "save_peak"))
    )
    assert abs(step / fp["total"] - 1) <= 0.10, (step, fp)
    assert abs(save / fp["save_peak"] - 1) <= 0.10, (save, fp)
    # the save adds at most one unit's tensors (Note: [Checkpoints are streamed from the host store])
    assert r["save_hwm"] - r["before_save"] <= fp["checkpoint"] + 8 * mib, r


@pytest.mark.gpu
def test_pinned_store_is_registered_at_its_exact_size():
    """On CUDA the store's compute copy and grads are page-locked (asynchronous copies) without the caching host
    allocator: no power-of-two block is taken for them, the masters stay pageable."""
    model = tiny_model("qwen3").to(torch.bfloat16)
    before = torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)
    with attach(model, device="cuda") as handle:
        ls = handle.store.layers[0]
        assert ls.compute_bytes.is_pinned() and ls.grad.is_pinned() and not ls.master.is_pinned()
        after = torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)
        assert after - before < sum(x.compute_bytes.numel() for x in handle.store.layers.values())
        dev = torch.empty(ls.nbytes, dtype=torch.uint8, device="cuda")
        dev.copy_(ls.compute_bytes, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), ls.compute_bytes)
