"""`benchmarks/bench_state_nvme.py`'s `write_random_checkpoint`: a checkpoint transformers and `lazytrain_hf` load with
no missing or unexpected keys, HF's initialisation (std, ones, zeros), the names and files `save_pretrained` writes,
bit-identical files for the same seed, and a peak RSS of a few blocks, not the model, while writing."""

from __future__ import annotations

import filecmp
import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_state_nvme.py")

_spec = importlib.util.spec_from_file_location("bench_state_nvme", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# ~0.7M parameters; Qwen2 has q/k/v biases and the default padding-free embedding, Qwen3 has q/k norms.
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=8192,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
)


def small_config(model_type: str, **kw):
    base = bench.QWEN25_3B if model_type == "qwen2" else bench.QWEN3_300M
    return bench.make_config({**base, **SMALL, "max_window_layers": 2, **kw})


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_checkpoint_loads_with_hf_init(tmp_path, model_type):
    """Sharded (max_shard_params below the model), it loads in transformers with every key matched and shaped as the model's; weights have std initializer_range and mean 0 (within 5 standard
    errors), norms are ones and biases zeros; the keys are those `save_pretrained` writes for the same model."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    config = small_config(model_type)
    out = tmp_path / "ckpt"
    summary = bench.write_random_checkpoint(config, out, dtype=torch.bfloat16, seed=3, max_shard_params=300_000)
    assert len(summary["files"]) > 1 and (out / "model.safetensors.index.json").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(summary["files"])
    assert index["metadata"]["total_size"] == summary["bytes"] == 2 * summary["params"]

    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.dtype == torch.bfloat16  # the config's dtype
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, written once
    assert summary["params"] == model.num_parameters()

    reference = AutoModelForCausalLM.from_config(config)
    reference.save_pretrained(tmp_path / "ref")
    with safe_open(str(tmp_path / "ref" / "model.safetensors"), framework="pt") as f:
        ref_keys = set(f.keys())
    assert set(index["weight_map"]) == ref_keys
    ref_shapes = {n: tuple(t.shape) for n, t in reference.state_dict().items()}

    std = config.initializer_range
    for name, p in model.state_dict().items():
        assert tuple(p.shape) == ref_shapes[name], name
        x = p.float()
        if name.endswith("norm.weight"):
            assert torch.equal(x, torch.ones_like(x)), name
        elif name.endswith(".bias"):
            assert torch.equal(x, torch.zeros_like(x)), name
        else:
            # 5 standard errors of the sample std / mean of n normal draws, plus 1% for the bf16 rounding
            n = x.numel()
            assert abs(x.std().item() - std) < (5 / math.sqrt(2 * n) + 0.01) * std, (name, n, x.std().item())
            assert abs(x.mean().item()) < 5 / math.sqrt(n) * std, (name, n, x.mean().item())
    assert model_type != "qwen2" or any(n.endswith("q_proj.bias") for n in ref_keys)
    assert model_type != "qwen3" or any(n.endswith("q_norm.weight") for n in ref_keys)


@pytest.mark.parametrize("tied", [False, True])
def test_lazytrain_from_pretrained_reads_it(tmp_path, tied):
    """`lazytrain_hf.from_pretrained` keeps the decoder layers on disk and reads them as transformers loads them,
    tied embeddings included (the file has no lm_head.weight)."""
    from transformers import AutoModelForCausalLM

    import lazytrain_hf

    config = small_config("qwen2", tie_word_embeddings=tied)
    bench.write_random_checkpoint(config, tmp_path, seed=1, max_shard_params=300_000)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    lazy = lazytrain_hf.from_pretrained(str(tmp_path))
    assert (lazy.lm_head.weight is lazy.model.embed_tokens.weight) == tied
    loaded = dict(model.named_parameters())
    assert {n for n, _ in lazy.named_parameters()} == set(loaded)
    on_disk = [n for n, p in lazy.named_parameters() if p.device.type == "meta"]
    assert on_disk and all(".layers." in n for n in on_disk)
    got = lazy.lazytrain_weights.read(on_disk)
    bad = [n for n in on_disk if not torch.equal(got[n], loaded[n].detach())]
    bad += [n for n, p in lazy.named_parameters() if n not in on_disk and not torch.equal(p, loaded[n])]
    assert not bad, bad[:5]


def test_same_seed_same_bits_and_one_file_when_it_fits(tmp_path):
    config = small_config("qwen3")
    a = bench.write_random_checkpoint(config, tmp_path / "a", seed=7)
    b = bench.write_random_checkpoint(config, tmp_path / "b", seed=7)
    bench.write_random_checkpoint(config, tmp_path / "c", seed=8)
    assert a["files"] == b["files"] == ["model.safetensors"]
    assert not (tmp_path / "a" / "model.safetensors.index.json").exists()
    assert filecmp.cmp(tmp_path / "a" / "model.safetensors", tmp_path / "b" / "model.safetensors", shallow=False)
    assert not filecmp.cmp(tmp_path / "a" / "model.safetensors", tmp_path / "c" / "model.safetensors", shallow=False)
    # rewriting into a directory with shards replaces them
    bench.write_random_checkpoint(config, tmp_path / "a", seed=7, max_shard_params=300_000)
    files = sorted(f for f in os.listdir(tmp_path / "a") if f.endswith(".safetensors"))
    assert "model.safetensors" not in files and len(files) > 1


def test_unsupported_dtype_is_refused(tmp_path):
    with pytest.raises(ValueError, match="torch.bfloat16"):
        bench.write_random_checkpoint(small_config("qwen3"), tmp_path, dtype=torch.int8)


# What the child measures: VmHWM (peak resident set, /proc/self/status) after a write, the peak first reset to the
# current RSS by writing 5 to /proc/self/clear_refs (Linux >= 4.0), after imports, the config and a warm-up write of a
# tiny model, so the growth is what writing the ~33M-parameter checkpoint itself adds.
_RSS_CHILD = textwrap.dedent(
    """
    import importlib.util, json, math, sys, tempfile
    spec = importlib.util.spec_from_file_location("bench_state_nvme", sys.argv[1])
    bench = importlib.util.module_from_spec(spec); spec.loader.exec_module(bench)
    config = bench.make_config(json.loads(sys.argv[2]))
    warm = bench.make_config({**json.loads(sys.argv[2]), "num_hidden_layers": 1, "vocab_size": 512})
    bench.write_random_checkpoint(warm, tempfile.mkdtemp())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = bench.proc_status("VmRSS")
    summary = bench.write_random_checkpoint(config, sys.argv[3])
    layer = sum(math.prod(t["shape"]) for t in bench.checkpoint_tensors(config) if t["name"].startswith("model.layers.0."))
    print(json.dumps({"before": before, "peak": bench.proc_status("VmHWM"), "layer_bytes": 2 * layer,
                      "model_bytes": summary["bytes"]}))
    """
)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs /proc/self/clear_refs (Linux)")
@pytest.mark.slow  # 35-60 s under load: kept out of CI's default run
def test_peak_rss_while_writing_is_under_two_layers(tmp_path):
    spec = {
        **bench.QWEN3_300M,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 16384,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, SCRIPT, json.dumps(spec), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = r["peak"] - r["before"]
    print(
        f"model {r['model_bytes'] / 2**20:.1f} MiB (bf16), one layer {r['layer_bytes'] / 2**20:.1f} MiB, "
        f"peak RSS growth while writing {growth / 2**20:.1f} MiB"
    )
    assert r["model_bytes"] > 50 * 2**20  # ~33M parameters
    assert growth < 2 * r["layer_bytes"], (growth, r)
    assert math.isclose(os.path.getsize(tmp_path / "ckpt" / "model.safetensors"), r["model_bytes"], rel_tol=1e-3)
