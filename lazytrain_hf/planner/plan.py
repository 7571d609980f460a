"""The `Plan`: what the planner decides and what the runtime executes.

A plan is pure data (no torch, no solver), so the planner, the simulator, the streaming executor, the activation
engine and the trainer all speak the same language and a plan can be saved next to a checkpoint and reloaded.

Stages of one training step, in order (``L`` decoder layers):

    F0, F1, ..., F(L-1), H, B(L-1), ..., B0

``F i`` is the forward of layer ``i``, ``H`` the head (final norm, lm_head, chunked cross entropy, its backward) and
``B i`` the backward of layer ``i`` (including the recomputation of layer ``i`` when its policy is ``recompute``).
The CPU optimizer runs after ``B0`` and overlaps the next step's forward.

Transfers are *slotted*: each one is issued at the start of a stage some number of stages ahead of the stage that
needs it (``*_ahead``); ``issue_schedule()`` turns the per-layer offsets into "at stage s issue these transfers",
which is what the executor follows.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from .world import World

# Where a layer's saved activations live between its forward and its backward.
POLICIES: tuple[str, ...] = ("keep", "offload_cpu", "offload_nvme", "recompute")
# Where the saved *input* of a recomputed layer lives (the only tensor a recomputed layer saves).
INPUT_TIERS: tuple[str, ...] = ("gpu", "cpu", "nvme")
# Tier each policy needs (recompute: the tier of its input).
POLICY_TIER: dict[str, str] = {"keep": "gpu", "offload_cpu": "cpu", "offload_nvme": "nvme"}

# Where a data-parallel world reduces each unit's gradient to its owner (`Plan.dp_reduce`)
DP_REDUCE: tuple[str, ...] = ("host", "device")
# How often it does so with gradient accumulation (`Plan.dp_reduce_every`)
DP_REDUCE_EVERY: tuple[str, ...] = ("micro_batch", "step")

# How a checkpointed block is recomputed in backward (`Plan.block_graphs`)
BLOCK_GRAPHS: tuple[str, ...] = ("block", "layer")

PREDICTION_KEYS: tuple[str, ...] = ("step_time_s", "tflops", "tokens_per_s", "peak_gpu_bytes", "peak_host_bytes")


class PlanError(ValueError):
    """A plan that is malformed or does not fit the model it is applied to."""


@dataclass
class LayerPlan:
    """Decisions for one decoder layer.

    Args:
        index: layer index in the model (0-based).
        kind: layer kind from `lazytrain_hf.models` (e.g. ``"full_attention"``, ``"linear_attention"``,
            ``"full_attention+moe"``).
        policy: one of `POLICIES`.
        input_tier: for ``policy == "recompute"``: where the saved layer input lives, one of `INPUT_TIERS`.
            Ignored (kept ``"gpu"``) for other policies.
        resident: the layer's weights stay on the device for the whole step (no fetches).
        fetch_fwd_ahead: the weight fetch for ``F i`` is issued at the start of stage ``F (i - fetch_fwd_ahead)``
            (stage 0 when that is negative, i.e. before the step). 0 means on demand.
        fetch_bwd_ahead: the weight fetch for ``B i`` is issued this many stages before ``B i``.
        reload_ahead: the reload of offloaded activations (or of an offloaded recompute input) for ``B i`` is
            issued this many stages before ``B i``.
    """

    index: int
    kind: str = "full_attention"
    policy: str = "keep"
    input_tier: str = "gpu"
    resident: bool = False
    fetch_fwd_ahead: int = 1
    fetch_bwd_ahead: int = 1
    reload_ahead: int = 1

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise PlanError(f"layer {self.index}: policy={self.policy!r} is not one of {POLICIES}.")
        if self.input_tier not in INPUT_TIERS:
            raise PlanError(f"layer {self.index}: input_tier={self.input_tier!r} is not one of {INPUT_TIERS}.")
        for name in ("fetch_fwd_ahead", "fetch_bwd_ahead", "reload_ahead"):
            if getattr(self, name) < 0:
                raise PlanError(f"layer {self.index}: {name}={getattr(self, name)} must be >= 0.")

    @property
    def tier(self) -> str:
        """The storage tier this layer's saved tensors use ("gpu", "cpu" or "nvme")."""
        return self.input_tier if self.policy == "recompute" else POLICY_TIER[self.policy]


@dataclass
class Plan:
    """A full per-step plan.

    Args:
        layers: one `LayerPlan` per decoder layer, in order.
        micro_batch_size: sequences per micro-batch the plan was made for.
        seq_len: tokens per sequence the plan was made for.
        stream_embeddings: stream the embedding / final norm / lm_head instead of keeping them resident.
        loss_chunk_tokens: tokens per chunk of the chunked loss (final norm + lm_head + cross entropy).
        source: who made it: ``"default"``, ``"milp"``, ``"heuristic"`` or ``"baseline:<name>"``.
        predicted: predictions, keys `PREDICTION_KEYS` (plus anything else the planner reports).
        solver: solver report: ``status``, ``seconds``, ``gap``.
        hardware: name of the hardware profile the plan was made for.
        model: model name or type the plan was made for.
        checkpoint_every: ``1`` (default): every layer follows its own ``policy``. ``K > 1``: block checkpointing as
            MegaTrain does it: only the input of every K-th layer is saved (on the device) and in backward each block
            of K layers is recomputed as a whole (weights fetched once more for the recomputation) before its
            backward; every layer's ``policy`` must then be ``"recompute"`` with ``input_tier="gpu"``.
        block_graphs: how a checkpointed block (``checkpoint_every > 1``) is recomputed, one of `BLOCK_GRAPHS`:
            ``"block"`` (plan files without it): at the top layer's backward stage the whole block is recomputed
            once with grad, so all K layers' saved tensors are live until their backward. ``"layer"`` (MegaTrain's
            executor): at that stage the block's layers below the top are run forward under ``no_grad`` from the
            block input, keeping each one's output (the next layer's input) on the device; then each layer's
            backward stage recomputes only that layer with grad from its kept input, so one layer's graph and
            K - 1 hidden states are live, at the price of a third forward (and weight fetch) of the lower layers.
        optimizer_overlap: the CPU optimizer step overlaps the next step's forward (layer i is uploaded as soon as
            it is updated). ``False``: the next step starts only after the whole optimizer step.
        state_nvme: the streamed units whose training state (fp32 master, compute copy, gradient accumulator, 8-bit
            moments) lives on NVMe (`lazytrain_hf.streaming.nvmestate`), by host-store key: decoder layer ``i``,
            ``-1`` the streamed embedding, ``num_layers`` the streamed head. Their weight fetches read the compute
            copy from NVMe first, their gradients are written there, and their optimizer step reads and writes the
            state (`lazytrain_hf.planner.schedule`). Chosen by `lazytrain_hf.planner.hostmem.place_state`.
        world_size: ranks of the data-parallel world the plan was made for, every rank executes it
            (Note: [The training state is partitioned by unit] in `lazytrain_hf.planner.world`); 1: one process.
        nodes: machines those ranks run on, ``world_size // nodes`` on each.
        dp_reduce: where a data-parallel world reduces each streamed unit's gradient to its owner, one of
            `DP_REDUCE`: ``"host"`` (every rank copies it D2H, then gloo sums the fp32 copies into the owner's
            accumulator) or ``"device"`` (summed on the devices into the owner's before the D2H copy, which only the
            owner makes; Note: [Gradients reduced on the device skip the other ranks' D2H] in
            streaming/gradients.py). Chosen by `lazytrain_hf.planner.dpreduce.decide`; plan files without it: host.
        dp_reduce_every: how often, one of `DP_REDUCE_EVERY`: ``"micro_batch"`` (every micro-batch into the owner's
            accumulator) or ``"step"`` (each rank accumulates its gradient of every unit in its own fp32 accumulator,
            reduced to the owner once, after the step's last micro-batch; host path only: Note: [Gradients reduced
            once per step] in streaming/gradients.py). Chosen by `dpreduce.decide`; plan files without it: micro_batch.
    """

    layers: list[LayerPlan]
    micro_batch_size: int = 1
    seq_len: int = 1024
    stream_embeddings: bool = False
    loss_chunk_tokens: int = 1024
    source: str = "default"
    predicted: dict[str, Any] = field(default_factory=dict)
    solver: dict[str, Any] = field(default_factory=dict)
    hardware: str = ""
    model: str = ""
    checkpoint_every: int = 1
    optimizer_overlap: bool = True
    state_nvme: list[int] = field(default_factory=list)
    world_size: int = 1
    nodes: int = 1
    dp_reduce: str = "host"
    dp_reduce_every: str = "micro_batch"
    block_graphs: str = "block"

    # ------------------------------------------------------------------ construction
    @classmethod
    def default(cls, num_layers: int, kinds: list[str] | None = None, prefetch_depth: int = 1, **kwargs) -> Plan:
        """All layers streamed, prefetch depth ``prefetch_depth``, every activation kept on the device."""
        kinds = kinds or ["full_attention"] * num_layers
        if len(kinds) != num_layers:
            raise PlanError(f"kinds has {len(kinds)} entries for {num_layers} layers.")
        layers = [
            LayerPlan(index=i, kind=k, fetch_fwd_ahead=prefetch_depth, fetch_bwd_ahead=prefetch_depth)
            for i, k in enumerate(kinds)
        ]
        return cls(layers=layers, **kwargs)

    @property
    def world(self) -> World:
        """The data-parallel world the plan was made for (`World`)."""
        return World(self.world_size, self.nodes)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def policies(self) -> list[str]:
        return [lp.policy for lp in self.layers]

    def validate(self, num_layers: int | None = None) -> Plan:
        if num_layers is not None and num_layers != len(self.layers):
            raise PlanError(f"plan has {len(self.layers)} layers but the model has {num_layers}.")
        for i, lp in enumerate(self.layers):
            if lp.index != i:
                raise PlanError(f"layers[{i}].index == {lp.index}; layers must be listed in order.")
            lp.validate()
        if self.micro_batch_size < 1 or self.seq_len < 1 or self.loss_chunk_tokens < 1:
            raise PlanError("micro_batch_size, seq_len and loss_chunk_tokens must be >= 1.")
        for name in ("world_size", "nodes"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise PlanError(f"{name}={getattr(self, name)!r} must be an integer >= 1.")
        if self.world_size < 1 or self.nodes < 1 or self.world_size % self.nodes:
            raise PlanError(
                f"world_size={self.world_size}, nodes={self.nodes}: both must be >= 1 and world_size a multiple of "
                "nodes (the same number of ranks on every node)."
            )
        if self.dp_reduce not in DP_REDUCE:
            raise PlanError(
                f"dp_reduce={self.dp_reduce!r} is not one of {DP_REDUCE}; write 'host' (gloo on the host copies) or "
                "'device' (reduced on the devices before the D2H copy)."
            )
        if self.dp_reduce_every not in DP_REDUCE_EVERY:
            raise PlanError(
                f"dp_reduce_every={self.dp_reduce_every!r} is not one of {DP_REDUCE_EVERY}; write 'micro_batch' "
                "(reduced to the owner every micro-batch) or 'step' (accumulated on each rank, reduced once per step)."
            )
        if self.dp_reduce_every == "step" and self.dp_reduce == "device":
            raise PlanError(
                "dp_reduce='device' with dp_reduce_every='step': a unit's gradient reduced on the devices once per "
                "step would have to stay on the device across the micro-batches; write dp_reduce='host' for 'step', "
                "or dp_reduce_every='micro_batch' with 'device'."
            )
        if self.checkpoint_every < 1:
            raise PlanError(f"checkpoint_every={self.checkpoint_every} must be >= 1 (1 = per-layer policies).")
        if self.block_graphs not in BLOCK_GRAPHS:
            raise PlanError(
                f"block_graphs={self.block_graphs!r} is not one of {BLOCK_GRAPHS}; write 'block' (each checkpointed "
                "block recomputed once with grad) or 'layer' (no_grad pass keeping each layer's input, then one "
                "layer recomputed with grad per backward stage)."
            )
        L = len(self.layers)
        for k in self.state_nvme:
            if not isinstance(k, int) or not -1 <= k <= L or (k in (-1, L) and not self.stream_embeddings):
                raise PlanError(
                    f"state_nvme lists unit {k!r}; units are decoder layers 0..{L - 1}"
                    f"{f', -1 (embedding) and {L} (head)' if self.stream_embeddings else ''}."
                )
            if 0 <= k < L and self.layers[k].resident:
                raise PlanError(f"state_nvme lists layer {k}, which the plan keeps resident on the device.")
        if self.checkpoint_every > 1 and any(lp.policy != "recompute" or lp.input_tier != "gpu" for lp in self.layers):
            raise PlanError(
                f"checkpoint_every={self.checkpoint_every} (block checkpointing) needs every layer's policy to be "
                "'recompute' with input_tier='gpu'."
            )
        return self

    def tiers_used(self) -> set[str]:
        return {lp.tier for lp in self.layers}

    # ------------------------------------------------------------------ stages and slotting
    def stages(self) -> list[str]:
        """Stage names in execution order: ``F0..F{L-1}``, ``H``, ``B{L-1}..B0``."""
        L = self.num_layers
        return [f"F{i}" for i in range(L)] + ["H"] + [f"B{i}" for i in reversed(range(L))]

    def stage_index(self, name: str) -> int:
        return self.stages().index(name)

    def issue_schedule(self) -> dict[int, list[tuple[str, int]]]:
        """Transfers to issue at the start of each stage: ``{stage_index: [(what, layer), ...]}``.

        ``what`` is ``"fetch_fwd"``, ``"fetch_bwd"`` or ``"reload"``. A transfer whose offset reaches before
        stage 0 is issued at stage 0; a reload no earlier than the stage after the layer's forward (before it there
        is nothing to reload; the planner's stage model allows it from two stages after, four for nvme); resident
        layers issue no fetches; layers whose saved tensors stay on the device issue no reloads. Within a stage,
        transfers are ordered by the stage that needs them.
        """
        L = self.num_layers
        out: dict[int, list[tuple[int, str, int]]] = {}

        def add(need: int, ahead: int, what: str, layer: int) -> None:
            out.setdefault(max(0, need - ahead), []).append((need, what, layer))

        for lp in self.layers:
            f_stage = lp.index
            b_stage = 2 * L - lp.index  # F0..F(L-1) are 0..L-1, H is L, B(L-1) is L+1, ..., B0 is 2L
            if not lp.resident:
                add(f_stage, lp.fetch_fwd_ahead, "fetch_fwd", lp.index)
                add(b_stage, lp.fetch_bwd_ahead, "fetch_bwd", lp.index)
            if lp.tier != "gpu":
                # not before the layer's forward: only then is there anything to reload (the reload itself waits
                # for its offload copy, and an NVMe read for its write)
                ahead = max(0, min(lp.reload_ahead, b_stage - (lp.index + 1)))
                add(b_stage, ahead, "reload", lp.index)
        return {s: [(w, i) for _, w, i in sorted(v)] for s, v in sorted(out.items())}

    def bwd_issue_stage(self, i: int) -> int:
        """The stage the backward fetch of layer ``i`` is issued in."""
        return max(0, 2 * self.num_layers - i - self.layers[i].fetch_bwd_ahead)

    def keeps_bound_after_forward(self, i: int) -> bool:
        """Layer ``i`` stays bound from its forward to its backward: its backward fetch would be issued at the very
        next stage (the last layers with a backward prefetch), and fetching it again right away would only cost a
        transfer. The executor and `lazytrain_hf.planner.schedule` both follow this rule."""
        return not self.layers[i].resident and self.bwd_issue_stage(i) <= i + 1

    def block_top(self, i: int) -> int:
        """The top layer of the checkpointed block holding layer ``i`` (``i`` itself when ``checkpoint_every`` is 1)."""
        K = self.checkpoint_every
        return min((i // K) * K + K, self.num_layers) - 1

    @property
    def layer_graphs(self) -> bool:
        """Block checkpointing with one layer's graph live at a time (``block_graphs == "layer"``, ``K > 1``)."""
        return self.checkpoint_every > 1 and self.block_graphs == "layer"

    def block_fetches(self, i: int) -> tuple[bool, bool]:
        """``(recompute fetch, backward fetch)`` of a streamed layer ``i`` in backward.

        With block checkpointing the block's top layer recomputes the block at its backward stage: a lower layer
        whose backward fetch was issued by then keeps that slot through its recomputation and backward; any other
        is fetched for the recomputation, released, and fetched again for its backward (Note: [Block recomputation
        binds its layers one by one] in streaming/binder.py). A layer kept bound after its forward is fetched for
        neither. The same for both `block_graphs` modes: ``"layer"`` binds the layers below the top the same way
        for its ``no_grad`` pass, and each layer's with-grad recomputation runs at its backward stage, bound by its
        backward fetch."""
        if self.keeps_bound_after_forward(i):
            return False, False
        top = self.block_top(i)
        if self.checkpoint_every == 1 or i == top:
            return False, True
        return self.bwd_issue_stage(i) > 2 * self.num_layers - top, True

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        data = dict(data)
        try:
            layers = [LayerPlan(**lp) for lp in data.pop("layers")]
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = set(data) - known
            if unknown:
                raise PlanError(f"unknown plan keys {sorted(unknown)}; known keys are {sorted(known)}.")
            return cls(layers=layers, **data).validate()
        except (KeyError, TypeError) as e:
            raise PlanError(f"malformed plan: {e}") from e

    def to_json(self, path: str | None = None, indent: int = 2) -> str:
        text = json.dumps(self.to_dict(), indent=indent, sort_keys=False)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str) -> Plan:
        """Load from a JSON string or a file path. Errors name the file."""
        src = "<string>"
        text = text_or_path
        if not text_or_path.lstrip().startswith("{"):
            src = text_or_path
            with open(text_or_path) as f:
                text = f.read()
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise PlanError(f"plan file {src} is not valid JSON ({e}); it may be truncated or corrupted.") from e
        except PlanError as e:
            raise PlanError(f"plan file {src}: {e}") from e

    # ------------------------------------------------------------------ display
    def table(self) -> str:
        """A readable per-layer table plus the predictions."""
        head = f"{'layer':>5}  {'kind':<26} {'policy':<12} {'input':<5} {'resident':<8} {'ahead f/b/r':<11}"
        rows = [head, "-" * len(head)]
        for lp in self.layers:
            inp = lp.input_tier if lp.policy == "recompute" else "-"
            ahead = f"{lp.fetch_fwd_ahead}/{lp.fetch_bwd_ahead}/{lp.reload_ahead}"
            rows.append(
                f"{lp.index:>5}  {lp.kind:<26} {lp.policy:<12} {inp:<5} {'yes' if lp.resident else 'no':<8} {ahead:<11}"
            )
        rows.append(
            f"source={self.source} micro_batch_size={self.micro_batch_size} seq_len={self.seq_len} "
            f"hardware={self.hardware or '-'} stream_embeddings={self.stream_embeddings}"
            + (
                f" checkpoint_every={self.checkpoint_every} block_graphs={self.block_graphs}"
                if self.checkpoint_every > 1
                else ""
            )
            + (
                f" world_size={self.world_size} nodes={self.nodes} dp_reduce={self.dp_reduce}/{self.dp_reduce_every}"
                if self.world_size > 1
                else ""
            )
        )
        if self.predicted:
            pred = ", ".join(
                f"{k}={_fmt(self.predicted[k])}" for k in PREDICTION_KEYS if self.predicted.get(k) is not None
            )
            rows.append(f"predicted: {pred}")
        if self.solver:
            rows.append("solver: " + ", ".join(f"{k}={_fmt(v)}" for k, v in self.solver.items()))
        return "\n".join(rows)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and v >= 1 << 20:
        return f"{v / 2**30:.2f}GiB"
    return str(v)
