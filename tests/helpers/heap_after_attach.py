"""Body of tests/test_given_back.py's heap test, run in a process of its own (its malloc settings are the process's):
build an in-memory model, attach the executor (the store build frees every streamed parameter's own storage), then
print, as JSON, the bytes an explicit ``malloc_trim(0)`` still gives back (freed heap pages the build left resident)
and one decoder layer's bytes. Run with ``MALLOC_MMAP_THRESHOLD_`` set, so that a layer's matrices are heap blocks
whatever glibc's dynamic threshold did before."""

from __future__ import annotations

import ctypes
import json

import torch
import transformers

from lazytrain_hf import models
from lazytrain_hf.planner.plan import Plan
from lazytrain_hf.streaming import attach


def heap_rss() -> int:
    """Resident bytes of the process's ``[heap]`` mapping (glibc's main arena)."""
    total, heap = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                heap = len(head) > 5 and head[5] == "[heap]"
            elif heap and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def main() -> None:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, vocab_size=1024, tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    later = [torch.ones(1 << 16) for _ in range(8)]  # allocated after the model: its blocks are not the heap top
    kinds = models.layer_kinds(model)
    handle = attach(model, plan=Plan.default(len(kinds), kinds=kinds), device="cpu")
    before = heap_rss()
    ctypes.CDLL(None).malloc_trim(0)
    released = before - heap_rss()
    layer = sum(p.numel() * p.element_size() for p in models.decoder_layers(model)[0].parameters())
    handle.remove()
    print(json.dumps({"released": released, "layer_bytes": layer, "kept": len(later)}))


if __name__ == "__main__":
    main()
