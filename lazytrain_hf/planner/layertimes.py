"""Timed decoder layers: build a model of the config's first layer of each kind (only as many layers as that needs)
and time one layer's forward and backward at a batch shape, on the probes' clock (`timing`)."""

from __future__ import annotations

from typing import Any

from .timing import median_time, now


def measure_layer_times(
    config: Any, device: str, micro_batch_size: int, seq_len: int, repeats: int = 3
) -> dict[str, list[float]]:
    """Forward and backward seconds of one decoder layer per layer kind of ``config`` (timed, median)."""
    import torch

    from ..models import layer_kinds
    from .zoo import as_hf_config

    hf_config = as_hf_config(config)
    kinds = layer_kinds(hf_config)
    first_of_kind: dict[str, int] = {}
    for i, k in enumerate(kinds):
        first_of_kind.setdefault(k, i)
    from transformers import AutoModelForCausalLM

    # Build only as many layers as needed to reach one of every kind, so large configs stay cheap to time.
    n_build = max(first_of_kind.values()) + 1
    fields = {**hf_config.to_dict(), "num_hidden_layers": n_build, "use_cache": False}
    if getattr(hf_config, "layer_types", None) is not None:
        fields["layer_types"] = list(hf_config.layer_types[:n_build])  # validated against num_hidden_layers
    small = hf_config.__class__(**fields)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    model = AutoModelForCausalLM.from_config(small).to(device=device, dtype=dtype)
    model.train()
    inner = model.model
    ids = torch.randint(0, small.vocab_size, (micro_batch_size, seq_len), device=device)
    with torch.no_grad():
        x0 = inner.embed_tokens(ids)
    pos = torch.arange(seq_len, device=device).unsqueeze(0).expand(micro_batch_size, -1)
    pos_emb = inner.rotary_emb(x0, pos)

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize(device)

    out: dict[str, list[float]] = {}
    for kind, idx in first_of_kind.items():
        layer = inner.layers[idx]

        def fwd(layer=layer):
            x = x0.detach().requires_grad_(True)
            y = layer(x, attention_mask=None, position_embeddings=pos_emb, position_ids=pos)
            y = y[0] if isinstance(y, tuple) else y
            sync()
            return x, y

        fwd()
        t_f = median_time(fwd, repeats)
        times_b = []
        for _ in range(repeats):
            _, y = fwd()
            g = torch.ones_like(y)
            t0 = now()
            y.backward(g)
            sync()
            times_b.append(now() - t0)
        times_b.sort()
        out[kind] = [t_f, times_b[len(times_b) // 2]]
    return out
