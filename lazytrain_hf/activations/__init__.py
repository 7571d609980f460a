"""Activation placement engine: keep / offload to (pinned) CPU / offload to NVMe / recompute, per layer, as planned.

The streaming executor calls `ActivationEngine.begin_layer` from the forward pre-hook of every decoder layer and
`ActivationEngine.end_layer` from its forward post-hook. In between, every tensor autograd saves for the layer's
backward goes through `torch.autograd.graph.saved_tensors_hooks` installed by the engine and is routed by the layer's
`LayerPlan`:

- ``keep``: the tensor stays where it is (on the compute device);
- ``offload_cpu``: copied into a reusable host buffer (pinned when the device is CUDA; the device-to-host copy runs
  on a side stream) and released on the device; reloaded before the layer's backward (`ActivationEngine.prefetch`)
  or, at the latest, when autograd unpacks it;
- ``offload_nvme``: copied into a host staging buffer and written to a spill file by a background writer; read back
  by a background reader when the reload is issued;
- ``recompute``: nothing is saved but the layer input (which itself goes to ``LayerPlan.input_tier``); the first
  unpack in backward re-runs ``module.forward`` with the RNG and autocast state of the original forward under
  recording hooks and serves the recomputed tensors by index: the non-reentrant mechanism of
  ``torch.utils.checkpoint(use_reentrant=False)``.
- block checkpointing (``Plan.checkpoint_every = K > 1``, every layer ``recompute`` with its input on the gpu tier):
  only the input of the first layer of each block ``[s, s + K)`` (``s = 0, K, 2K, ...``; the last block may be
  shorter) is saved, on the device; the other layers of the block save nothing at all. At the start of the block's
  backward (`ActivationEngine.begin_backward` of its top layer, or the first unpack of any of its tensors) the whole
  block is recomputed layer by layer from that input, each layer with its own RNG / autocast state and keyword
  arguments, its weights bound for the recomputation by the executor (`RecomputeWeights`) and released afterwards;
  every layer's recomputed tensors are served to its backward by index (See Note: [Block recomputation]). With
  ``Plan.block_graphs == "layer"`` (MegaTrain's executor) that start instead runs the block's layers below the top
  under ``no_grad``, keeping each output as the next layer's input on the device, and each layer's backward
  recomputes that one layer with grad from its kept input (See Note: [A block's layers are recomputed one graph at
  a time]).

Weights are never offloaded: a streamed weight is handed to the executor's `ParamPacker` (a small reference is stored
and the view is rebuilt on the layer's current device slot at unpack); without a packer, tensors whose storage is a
parameter of the layer are kept by reference. Shared inputs of the layer (rotary cos/sin, masks, position ids) are
kept by reference too.

On a machine without a GPU the "device" is the CPU: the gpu tier keeps tensors as they are, the cpu tier copies into
the host buffer pool, the nvme tier writes real files, so every path runs in CPU tests. Saved tensors come back with
the same dtype, shape, strides, storage-offset alignment and values, so gradients are bit-identical to plain autograd
under any policy vector.

Modules (each says what it owns and what it may not touch):

- `engine.py`: the saved-tensor router, `ActivationEngine` (pack / unpack, view dedup, the step's entries);
- `tiers.py`: the tier backends behind one store / prefetch / materialize / release interface (`gpu`, `cpu`);
- `nvme.py`: the NVMe tier (spill directory, I/O threads, write failures);
- `recompute.py`: recompute frames, block checkpointing, RNG and autocast replay;
- `layout.py`, `pool.py`, `accounting.py`: saved-tensor layouts, the host buffer pool, bytes per tier.

The Notes below and the tests that exercise them (every test runs under the simulated asynchronous engine of
`lazytrain_hf.streams` unless marked ``sync_engine``, so a missing wait shows as NaN or a wrong gradient):

| Note | tests |
| --- | --- |
| [D2H waits for the producer], [Offload source stays alive until its copy completes] | ``test_activations.py::test_policy_vector_bit_exact``, ``test_activations_property.py``, ``test_plan_space.py`` |
| [Reload waits for the offload copy], [H2D waits for the block's previous users] | the same (a reload issued before its offload copy landed reads the poisoned host buffer) |
| [Pool buffers carry their last copy] | ``test_policy_vector_bit_exact``, ``test_host_pool_does_not_grow_after_first_step`` (a buffer reused before its copy finished is poisoned) |
| [Saved tensors are restored with their layout] | ``test_saved_tensor_round_trip_layout`` |
| [Saved tensors are not written in place while their copy runs] | ``test_modified_storage_is_copied_again`` (synchronous engine) |
| [Pool buffers are keyed by rounded size] | ``test_host_pool_buckets_and_reuse``, ``test_host_pool_does_not_grow_after_first_step`` |
| [Offloaded storages are copied once] | ``test_views_of_one_storage_are_copied_once`` |
| [Weights are never offloaded] | ``test_param_packer_references_weights`` |
| [Spill files never outlive the process] | ``test_spill_files_*``, ``test_activations_process.py`` |
| [Spilled bytes leave RAM] | ``test_nvme_io.py`` (page-cache residency of spill files, bit-exact round trips per I/O mode) |
| [Released reloads free behind their copy] | ``test_activations.py::test_release_does_not_block_on_reload_events``, ``test_plan_space.py`` |
| [Recompute replays RNG and autocast state] | ``test_recompute_with_dropout_matches_keep``, ``test_recompute_leaves_training_rng_and_module_hooks_alone`` |
| [Recompute serves tensors by index, per backward], [Block recomputation] | ``test_retain_graph_second_backward``, ``test_block_recompute.py``, ``test_plan_space.py`` (``checkpoint_every``) |
"""

from .engine import ActivationEngine, ParamPacker, RecomputeWeights
from .nvme import ActivationSpillError, remove_stale_spill_dirs
from .pool import HostBufferPool

__all__ = [
    "ActivationEngine",
    "ActivationSpillError",
    "HostBufferPool",
    "ParamPacker",
    "RecomputeWeights",
    "remove_stale_spill_dirs",
]
