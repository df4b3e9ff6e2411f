"""Types every TransformerLayer shares: per-layer state views, the per-pass ForwardContext, the
attention metadata a pass hands its layers, and the capability mixins of a layer.

This is the layer module of the seed (`shared/seeds/`) in Python. Its names are the vocabulary of
the engine; where Python makes a Rust-side construct unnecessary (`as_any` downcasts, raw device
pointer tables) the type keeps its name and role and drops the mechanism.

Layers own no per-request Python objects: a LayerState is a view of pooled device memory, indexed
by the block tables and state slots that the pass's metadata carries.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .kernels.gdn.fixed_captures import FixedCaptures
from .kernels.gdn.state import StateCaptures, VerifyTable
from .kernels.lora import LoraRows
from .kernels.options import KernelOptions

if TYPE_CHECKING:
    from .config import ModelConfig
    from .parallel import ParallelLayout

# Catch-up stash rows per sequence for speculative decoding with the MTP head: the batched verify
# keeps at most this many accepted drafts per sequence. (Speculative decoding is a later issue.)
MTP_CATCHUP_MAX = 4


# ---------------------------------------------------------------------------------------------
# Per-layer state: views of pooled device memory
# ---------------------------------------------------------------------------------------------
class LayerState:
    """One layer's state across all sequences of the worker: views of the pools, indexed by the
    pass metadata (block tables for attention, state slots for GDN)."""


@dataclass
class EmptyLayerState(LayerState):
    """State of a layer that keeps nothing per sequence."""


@dataclass
class AttnLayerState(LayerState):
    """A gated attention layer's paged KV: [num_blocks, block_size, kv_heads_local, head_dim] for K
    and for V. `indexer_carry` is the QSA sparse-attention indexer's carry, created on first use
    and only on a layer that has a QSA indexer (qwen4_exp; not built yet)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    indexer_carry: torch.Tensor | None = None


@dataclass
class SsmLayerState(LayerState):
    """A GDN layer's state slots: recurrent h [slots, v_heads_local, k_dim, v_dim] (float32 by
    default) and the conv window [slots, conv_channels_local, kernel - 1]. Slots past the running
    ones are prefix-cache snapshots (same shape; the driver names them in a pass's copies and captures).

    Speculative decoding (the seed's write-on-accept): `verify` is the layer's verify table (each
    draft position's recurrent step, kernels/gdn/state.py) for up to `rows` verify rows,
    `verify_conv_inputs` [rows, L, C] what the conv window is rebuilt from once the accepted count is
    known (with the slot's window, which the verify leaves), and `verify_has_initial` [rows] (all
    true) the verify rows' conv flag, made once. None until speculative decoding is enabled."""

    recurrent: torch.Tensor
    conv: torch.Tensor
    verify: VerifyTable | None = None
    verify_conv_inputs: torch.Tensor | None = None
    verify_has_initial: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------
# Pass metadata
# ---------------------------------------------------------------------------------------------
@dataclass
class AttnMetadata:
    """Decode rows of a pass: each row is one sequence with `tokens_per_row` new tokens (1 for
    decode; k for verifying k speculative drafts). One entry (or one block-table row) per row.

    positions, slot_mapping: [N * tokens_per_row]; block_tables: [N, max_pages];
    seq_lens: [N] tokens cached after this pass; state_slots: [N] GDN slots."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    state_slots: torch.Tensor
    tokens_per_row: int = 1

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.tokens_per_row

    def row_starts(self) -> torch.Tensor:
        """[N + 1] int32, where each row's tokens start (cu_seqlens of rows of tokens_per_row tokens):
        a view of a buffer kept for the process (no launch), made outside any CUDA graph capture."""
        return row_starts(self.num_seqs, self.tokens_per_row, self.seq_lens.device)


# (tokens a row, device) -> [0, L, 2 L, ...] int32; outgrown buffers stay alive: graphs captured
# on them read them at every replay
_ROW_STARTS: dict[tuple[int, str], list[torch.Tensor]] = {}


def row_starts(num_rows: int, tokens_per_row: int, device: torch.device) -> torch.Tensor:
    """[num_rows + 1] int32 multiples of tokens_per_row on the device. Made eagerly once (a capture
    that finds no buffer long enough records its own arange instead)."""
    key = (tokens_per_row, str(device))
    bufs = _ROW_STARTS.setdefault(key, [])
    if not bufs or bufs[-1].shape[0] < num_rows + 1:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.arange(0, (num_rows + 1) * tokens_per_row, tokens_per_row, dtype=torch.int32, device=device)
        size = max(num_rows + 1, 257, 2 * bufs[-1].shape[0] if bufs else 0)
        with torch.inference_mode(False), torch.no_grad():
            bufs.append(torch.arange(0, size * tokens_per_row, tokens_per_row, dtype=torch.int32, device=device))
    return bufs[-1][: num_rows + 1]


@dataclass
class BatchedAttnMetadata:
    """One kernel-batched prefill chunk over several streams, stacked in cu_seqlens order.

    positions, slot_mapping: [T]; cu_seqlens: [N + 1] int32 query starts; block_tables:
    [N, max_pages]; seq_lens: [N] tokens cached after this chunk; state_slots: [N];
    has_initial_state: [N] bool (the stream has earlier tokens, so its GDN slot holds state);
    max_query_len / max_seq_len: host ints, for kernel grids; one_fresh_stream: the first stream has
    no cached tokens and every later one is padding (a prefill graph's idle stream), so causal
    attention over all of the chunk's tokens is exact for the first stream's queries."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    state_slots: torch.Tensor
    has_initial_state: torch.Tensor
    max_query_len: int
    max_seq_len: int
    one_fresh_stream: bool = False

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


# The seed's MidchunkCapture: a prefill pass's GDN snapshot captures, each a prefill stream, the split
# point in that stream's pass-local tokens, and the snapshot slot (prefix caching fills it).
MidchunkCapture = StateCaptures


class MoeLoraRoute(enum.Enum):
    """MoE-LoRA fold decision for one pass, from the adapter slots its rows name (layers/lora.py's
    resolve_moe_lora_route): FOLD applies the rows' expert adapters inside the routed experts (any
    number of adapters per batch, grouped per slot and expert), SKIP runs the base experts (no row's
    adapter touches them), REFUSE is an error naming the adapter (it cannot be served in this pass)."""

    FOLD = "fold"
    SKIP = "skip"
    REFUSE = "refuse"


@dataclass
class LoraBatch:
    """The pass's adapters: token_slots [T] int32 on the device (each token's adapter slot, -1: none),
    `active` the slots its rows name (host), `capture` True while a CUDA graph is captured (every
    projection then runs its adapters: the replays read their slots from token_slots). `rows`: the
    tokens grouped by slot, made at the start of the model's forward (inside a captured graph)."""

    token_slots: torch.Tensor
    num_slots: int
    active: frozenset[int]
    capture: bool = False
    rows: LoraRows | None = None


@dataclass
class ForwardContext:
    """What one forward pass hands every layer: config, device, the pass's token ids and metadata.

    Token order in a pass: the `decode` rows first (num_decode_tokens of them), then the `prefill`
    chunk. input_ids, positions, slot_mapping: [T] over the whole pass (the metadata hold views of
    their parts). `logits_indices` picks the token rows whose logits the pass returns."""

    config: ModelConfig
    layout: ParallelLayout
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    decode: AttnMetadata | None
    prefill: BatchedAttnMetadata | None
    logits_indices: torch.Tensor
    # FixedCaptures: a prefill CUDA graph's captures, from device tensors (workers/prefill_graphs.py)
    midchunk_capture: MidchunkCapture | FixedCaptures | None = None
    moe_lora_route: MoeLoraRoute = MoeLoraRoute.SKIP
    lora: LoraBatch | None = None  # None: no row of the pass has an adapter
    # the kernel choices the layers hand their ops (a captured graph keeps those of its capture)
    kernels: KernelOptions = field(default_factory=KernelOptions)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        return 0 if self.decode is None else self.decode.num_tokens


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------
class LazyTensor:
    """A checkpoint tensor not yet read: its full shape, and reads of just the slice a rank needs.

    A block-FP8 checkpoint tensor (float8 values) comes with `scale`, its `weight_scale_inv`
    (one float per `block` of rows x columns of the last two dims): `get` then returns the
    dequantized float32 values, `get_raw` the stored ones (layers/quant.py writes those into FP8
    weights). `block` is also the block a higher-precision tensor is quantized in for an FP8 weight."""

    def __init__(
        self,
        name: str,
        shape: tuple[int, ...],
        read: Callable[[tuple], torch.Tensor],
        scale: LazyTensor | None = None,
        block: tuple[int, int] = (128, 128),
    ):
        self.name = name
        self.shape = tuple(shape)
        self._read = read
        self.scale = scale
        self.block = block

    def get_raw(self, *index: slice) -> torch.Tensor:
        """The stored values under `index` (slices per leading dim); no index: the whole tensor."""
        return self._read(tuple(index))

    def get(self, *index: slice) -> torch.Tensor:
        """The tensor under `index` (slices per leading dim); no index: the whole tensor. FP8
        values come dequantized (float32)."""
        value = self._read(tuple(index))
        if self.scale is None:
            return value
        full = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        r0 = full[-2].indices(self.shape[-2])[0]
        c0 = full[-1].indices(self.shape[-1])[0]
        r1, c1 = r0 + value.shape[-2], c0 + value.shape[-1]
        bn, bk = self.block
        scale = self.scale.get(*full[:-2], slice(r0 // bn, -(-r1 // bn)), slice(c0 // bk, -(-c1 // bk))).float()
        rows = torch.arange(r0, r1) // bn - r0 // bn
        cols = torch.arange(c0, c1) // bk - c0 // bk
        return value.float() * scale[..., rows, :][..., :, cols].to(value.device)


@dataclass
class CheckpointTensor:
    """One tensor a layer expects in a checkpoint. `load` copies this rank's shard into the
    parameter (None: the tensor belongs to another rank and need not be read).

    `targets` names the pieces of parameter memory the tensor fills (by default just its own name).
    Alternative layouts cover the same targets: a fused `experts.gate_up_proj` covers every
    `experts.N.gate_proj.weight` and `experts.N.up_proj.weight`; such an `alternative` entry only
    covers targets, it never makes one required. Every target of a non-alternative entry this
    rank loads must be covered. `init` says how the random load format fills it: normal, zeros,
    ones, a_log, or computed (the parameter already holds its value, derived from the config)."""

    name: str
    shape: tuple[int, ...]
    load: Callable[[LazyTensor], None] | None
    targets: tuple[str, ...] = ()
    init: str = "normal"
    alternative: bool = False

    def __post_init__(self) -> None:
        if not self.targets:
            self.targets = (self.name,)


def copy_into(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy a checkpoint slice into a parameter; a shape mismatch names the tensor."""
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(
            f"checkpoint tensor '{name}' slice has shape {tuple(value.shape)}, expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(value.to(dtype=param.dtype, device=param.device))


# ---------------------------------------------------------------------------------------------
# Capability mixins of TransformerLayer
# ---------------------------------------------------------------------------------------------
class LayerWeightSetup:
    """A layer lists the checkpoint tensors it loads (names relative to the layer's prefix)."""

    def checkpoint_tensors(self, prefix: str) -> list[CheckpointTensor]:
        raise NotImplementedError


class LayerCapabilities:
    """What kind of per-sequence state a layer keeps, so the worker sizes the right pools."""

    state_kind: str = "none"  # "attention" (paged KV), "ssm" (state slots) or "none"


class LayerAuxState:
    """The pools a layer needs: shapes per block (attention) or per slot (GDN)."""

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """name -> (shape of one block or one slot, dtype or None for the model dtype)."""
        return {}


class LayerGraphHooks:
    """CUDA-graph hooks: capture happens with static metadata buffers, so layers that keep
    per-pass device tensors of their own refresh them here before a replay. The current layers
    keep none; the hooks exist so that a layer that does (QSA indexer) has a place."""

    def before_capture(self, ctx: ForwardContext) -> None:  # noqa: B027 - optional hook
        pass

    def before_replay(self, ctx: ForwardContext) -> None:  # noqa: B027 - optional hook
        pass


class LayerSplitPrefill:
    """Split SSM prefill (projections, recurrence over the whole prompt, output phase) for very long
    prompts. Declared for a later issue: no layer implements it, and `supports_split_prefill` is
    False everywhere."""

    supports_split_prefill: bool = False


class LayerWriteOnAccept:
    """Speculative decoding's write-on-accept: after a verify pass over k + 1 tokens per row, a layer
    with per-sequence state keeps the state after each row's last accepted token (`last_accepted`
    [N]: 0 .. k, or -1 to keep the state from before the verify). Layers without such state (paged
    attention: rejected KV rows are simply overwritten later) do nothing."""

    def write_on_accept(self, state: LayerState, slots: torch.Tensor, last_accepted: torch.Tensor) -> None:  # noqa: B027
        pass


class TransformerLayer(
    torch.nn.Module,
    LayerWeightSetup,
    LayerCapabilities,
    LayerAuxState,
    LayerGraphHooks,
    LayerSplitPrefill,
    LayerWriteOnAccept,
):
    """One decoder layer: token mixer (gated attention or GDN) and feed-forward (MoE or dense),
    each behind a zero-centred RMSNorm with a residual connection."""

    layer_id: int

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext, state: LayerState):
        raise NotImplementedError
