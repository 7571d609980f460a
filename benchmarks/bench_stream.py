"""Step time of the layer-streaming executor vs the plain model, and (on a GPU) achieved H2D bandwidth.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_stream.py            # CPU section (and GPU section if CUDA)
    PYTHONPATH=. .venv/bin/python benchmarks/bench_stream.py --reps 9 --seq 256

CPU: a ~50M-parameter Qwen3 config (8 layers, hidden 512, tied 32k vocabulary), fp32, one training step
(forward + loss + backward + zero_grad) of the plain model vs the same model with `attach` (every layer copied
host -> slot twice per step, gradients copied into the host accumulators) and vs `attach` + the chunked loss.
The variants run interleaved, one step each per round, after one warm-up round; reported: median and min step
time and the median over rounds of the per-round ratio to plain (robust to background load on shared cores).

GPU (when CUDA is available): the bandwidth of `TransferEngine.copy_in` for one layer-sized pinned buffer vs a
plain ``tensor.copy_(pinned, non_blocking=True)`` of the same bytes, and the step time streamed vs plain.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(seed: int = 0, device: str = "cpu"):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3",
        hidden_size=512,
        intermediate_size=2048,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_hidden_layers=8,
        vocab_size=32000,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).to(device)


def batch(bsz: int, seq: int, vocab: int = 32000, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (bsz, seq), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.clone().to(device)}


def median_time(step, reps: int, sync=lambda: None) -> float:
    step()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def interleaved(steps: dict[str, object], reps: int, sync=lambda: None) -> dict[str, list[float]]:
    """Time each step once per round, round after round, so that all variants see the same background load
    (the development machines are shared); one warm-up round first."""
    for fn in steps.values():
        fn()
    sync()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(reps):
        for k, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t0)
    return times


def cpu_section(reps: int, bsz: int, seq: int) -> None:
    from lazytrain_hf.streaming import attach

    b = batch(bsz, seq)
    plain = build()
    n_params = plain.num_parameters()
    streamed = build()
    h = attach(streamed, device="cpu")
    h.plan.loss_chunk_tokens = 128

    def plain_step():
        plain(**b).loss.backward()
        plain.zero_grad(set_to_none=True)

    def stream_step():
        streamed(**b).loss.backward()
        h.zero_grad()

    def chunked_step():
        h.causal_lm_loss(streamed, b).backward()
        h.zero_grad()

    times = interleaved({"plain": plain_step, "streamed": stream_step, "chunked": chunked_step}, reps)
    h.reset_peak()
    chunked_step()
    st = h.memory_stats()
    h.remove()

    print(
        f"CPU: qwen3 {n_params / 1e6:.1f}M params, fp32, batch {bsz} x {seq}, threads {torch.get_num_threads()}, "
        f"{reps} interleaved rounds"
    )
    print(f"{'variant':<34} {'median s':>9} {'min s':>7} {'median ratio':>13}")
    labels = {"plain": "plain", "streamed": "streamed (HF loss)", "chunked": "streamed + chunked loss"}
    for k, ts in times.items():
        ratio = statistics.median(t / p for t, p in zip(ts, times["plain"]))
        print(f"{labels[k]:<34} {statistics.median(ts):>9.3f} {min(ts):>7.3f} {ratio:>12.2f}x")
    weights = n_params * 4
    print(
        f"accounted device peak (streamed + chunked): {st['device_peak_bytes'] / 2**20:.1f} MiB "
        f"(slots {st['slot_bytes'] / 2**20:.1f}, resident {st['resident_bytes'] / 2**20:.1f}, "
        f"activations {st['activation_gpu_peak_bytes'] / 2**20:.1f}, loss {st['loss_chunk_peak_bytes'] / 2**20:.1f}) "
        f"vs plain weights + grads {2 * weights / 2**20:.1f} MiB + activations"
    )


def gpu_section(reps: int, bsz: int, seq: int) -> None:
    from lazytrain_hf.streaming import TransferEngine, attach

    dev = torch.device("cuda", torch.cuda.current_device())
    model = build()
    layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    n = layer_bytes  # one layer
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True).random_()
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    sync = torch.cuda.synchronize

    t_plain = median_time(lambda: dst.copy_(src, non_blocking=True), reps * 4, sync)
    eng = TransferEngine(dev)
    eng.add_pool("full_attention", n, 2)

    def fetch():
        slot = eng.acquire("full_attention", urgent=True)
        eng.copy_in(slot, src, 0)
        eng.wait_ready(slot)
        eng.release(slot)

    t_eng = median_time(fetch, reps * 4, sync)
    eng.close()
    print(f"\nGPU: {torch.cuda.get_device_name(dev)}; H2D of one layer ({n / 2**20:.1f} MiB), median of {reps * 4}")
    print(f"{'copy':<34} {'GB/s':>8} {'vs plain':>9}")
    print(f"{'plain pinned copy_':<34} {n / t_plain / 1e9:>8.2f} {1.0:>8.2f}x")
    print(f"{'TransferEngine.copy_in':<34} {n / t_eng / 1e9:>8.2f} {t_plain / t_eng:>8.2f}x")

    b = batch(bsz, seq, device=str(dev))
    plain = build(device=str(dev))

    def plain_step():
        plain(**b).loss.backward()
        plain.zero_grad(set_to_none=True)

    t_p = median_time(plain_step, reps, sync)
    streamed = build()
    h = attach(streamed, device=dev)

    def stream_step():
        h.causal_lm_loss(streamed, b).backward()
        h.zero_grad()

    t_s = median_time(stream_step, reps, sync)
    h.reset_peak()
    stream_step()
    sync()
    peak = h.memory_stats()["device_peak_bytes"]
    h.remove()
    print(f"{'step plain (all on GPU)':<34} {t_p:>8.3f}s")
    print(f"{'step streamed + chunked loss':<34} {t_s:>8.3f}s {t_s / t_p:>8.2f}x  peak {peak / 2**20:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    cpu_section(args.reps, args.batch, args.seq)
    if torch.cuda.is_available():
        gpu_section(args.reps, args.batch, args.seq)
    else:
        print("\nGPU section skipped: CUDA is not available.")


if __name__ == "__main__":
    main()
