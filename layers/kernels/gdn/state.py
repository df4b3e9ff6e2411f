"""GDN state at positions other than "after the last token": what prefix caching and speculative
decoding share.

Captures (prefix caching, the seed's MidchunkCapture): a prefill pass also writes the recurrent state
after `offset` tokens of one of its sequences into another pool slot (a snapshot slot). The chunked
kernel stores the state at the 64-token boundary at or before the offset; the tokens after that
boundary are replayed from there (the kernels: all of a pass's replays in one launch on the chunked
op's own WY rows, advance.py; the reference: token by token), so a capture never changes how the
sequence itself is chunked (its outputs are the same with and without captures). The conv window
at the offset is the last W - 1 inputs before it (`conv_windows_at`), taken before the conv kernel
updates the slot.

Verify tables (speculative decoding, the seed's VERIFY_WY tables): a verify over L = k + 1 tokens
leaves each slot's state as it was and writes, per token, what one recurrent step adds: the
l2-normalised key, the delta (beta (v - S'^T k) with S' the decayed state) and the log decay. With
S_0 the slot's state, the state after token a is
    S_a = exp(g_a) S_{a-1} + k_a delta_a^T,
so accepting a + 1 tokens replays a + 1 rank-one steps on the slot (`accept_states`, the seed's
write-on-accept): no recomputation, and no table of full [K, V] states (L x K x V floats a head).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# the verify tables hold the slot's state plus up to this many intermediates (k <= 15 drafts)
VERIFY_MAX_TOKENS = 16


@dataclass(frozen=True)
class StateCapture:
    """Write the state after `offset` tokens of sequence `seq` (counted from its first token in this
    pass; 0 <= offset <= its length here) into pool slot `slot`."""

    seq: int
    offset: int
    slot: int


@dataclass(frozen=True)
class StateCaptures:
    """The captures of one prefill op call, with the host-side length of each of its sequences (so
    that the kernels locate chunks without reading cu_seqlens back from the device)."""

    items: tuple[StateCapture, ...]
    seq_lens: tuple[int, ...]
    # the chunked kernels' device-side plan, built once per pass and shared by every GDN layer
    _prepared: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for c in self.items:
            if not 0 <= c.seq < len(self.seq_lens):
                raise ValueError(f"capture sequence {c.seq} is outside the pass's {len(self.seq_lens)} sequences")
            if not 0 <= c.offset <= self.seq_lens[c.seq]:
                raise ValueError(f"capture offset {c.offset} is outside [0, {self.seq_lens[c.seq]}]")
        slots = [c.slot for c in self.items]
        if len(set(slots)) != len(slots):  # the kernels would write one slot from several programs at once
            raise ValueError("capture slots must be distinct within a pass")

    def prepared(self, chunk: int, device: torch.device) -> PreparedCaptures:
        """plan_captures(self, chunk) with its chunk stores as a device array (one int per chunk: the
        slot to store the state after that chunk in, or -1), the replays (each one's chunk start row,
        token count and slot) and the conv windows (each capture's stream, its first row, the capture
        row and slot) as device tensors: uploaded once (pinned, non-blocking), then reused by every
        layer of the pass."""
        key = (chunk, str(device))
        if key not in self._prepared:
            plan = plan_captures(self, chunk)
            num_chunks = max(1, sum(-(-n // chunk) for n in self.seq_lens))
            starts = self.starts()
            first = [starts[seq] + start for seq, start, _, _ in plan.replays]
            count = [n for _, _, n, _ in plan.replays]
            slots = [slot for *_, slot in plan.replays]
            chunk_slots = [-1] * num_chunks
            for index, slot in plan.chunk_stores.items():
                chunk_slots[index] = slot
            windows = [(c.seq, starts[c.seq], starts[c.seq] + c.offset, c.slot) for c in self.items]
            parts = (first, count, slots, *(list(column) for column in zip(*windows, strict=True)))
            dev = [_upload(chunk_slots, torch.int32, device)]
            dev += _upload([x for part in parts for x in part], torch.int64, device).split([len(p) for p in parts])
            self._prepared[key] = PreparedCaptures(plan, *dev)
        return self._prepared[key]

    def starts(self) -> list[int]:
        """Each sequence's first token row in the op's inputs."""
        out, total = [], 0
        for n in self.seq_lens:
            out.append(total)
            total += n
        return out


@dataclass
class VerifyTable:
    """One GDN layer's verify table for N rows of L tokens: k [N, L, Hv, K] (l2-normalised keys,
    expanded to the value heads), delta [N, L, Hv, V], g [N, L, Hv] (log decay); all float32."""

    k: torch.Tensor
    delta: torch.Tensor
    g: torch.Tensor

    @classmethod
    def empty(
        cls, num_rows: int, length: int, num_v_heads: int, key_dim: int, value_dim: int, device: torch.device | str
    ) -> VerifyTable:
        if not 1 <= length <= VERIFY_MAX_TOKENS:
            raise ValueError(f"verify length {length} is outside [1, {VERIFY_MAX_TOKENS}]")
        f32 = torch.float32
        return cls(
            k=torch.empty((num_rows, length, num_v_heads, key_dim), dtype=f32, device=device),
            delta=torch.empty((num_rows, length, num_v_heads, value_dim), dtype=f32, device=device),
            g=torch.empty((num_rows, length, num_v_heads), dtype=f32, device=device),
        )


@dataclass
class VerifyStack:
    """Every GDN layer's verify buffers as one tensor each (leading dim: the layers of the state
    pools, in order), with the pools they accept into, so that write-on-accept covers the whole model
    in two launches (accept_all). table: a VerifyTable with a leading layer dim; conv_inputs
    [layers, rows, L, C]; has_initial [rows] (all true: the verify rows' conv flag); recurrent
    [layers, S, Hv, K, V] and conv [layers, S, C, W - 1]: the pools."""

    table: VerifyTable
    conv_inputs: torch.Tensor
    has_initial: torch.Tensor
    recurrent: torch.Tensor
    conv: torch.Tensor

    @classmethod
    def empty(cls, recurrent: torch.Tensor, conv: torch.Tensor, rows: int, length: int) -> VerifyStack:
        if not 1 <= length <= VERIFY_MAX_TOKENS:
            raise ValueError(f"verify length {length} is outside [1, {VERIFY_MAX_TOKENS}]")
        layers, _, num_v_heads, key_dim, value_dim = recurrent.shape
        f32, device = torch.float32, recurrent.device
        table = VerifyTable(
            k=torch.empty((layers, rows, length, num_v_heads, key_dim), dtype=f32, device=device),
            delta=torch.empty((layers, rows, length, num_v_heads, value_dim), dtype=f32, device=device),
            g=torch.empty((layers, rows, length, num_v_heads), dtype=f32, device=device),
        )
        conv_inputs = torch.zeros((layers, rows, length, conv.shape[2]), dtype=conv.dtype, device=device)
        has_initial = torch.ones(rows, dtype=torch.bool, device=device)
        return cls(table, conv_inputs, has_initial, recurrent, conv)

    def layer(self, i: int) -> dict:
        """Layer i's SsmLayerState verify fields (views)."""
        t = self.table
        return {
            "verify": VerifyTable(t.k[i], t.delta[i], t.g[i]),
            "verify_conv_inputs": self.conv_inputs[i],
            "verify_has_initial": self.has_initial,
        }


def accept_all(*, stack: VerifyStack, state_slots: torch.Tensor, last_accepted: torch.Tensor) -> None:
    """accept_states and conv_accept for every layer of the stack, after a verify of the first
    len(state_slots) rows: two launches on CUDA. No host sync."""
    n = state_slots.shape[0]
    table = VerifyTable(stack.table.k[:, :n], stack.table.delta[:, :n], stack.table.g[:, :n])
    inputs = stack.conv_inputs[:, :n]
    if stack.recurrent.is_cuda:
        from .accept import accept_states_layers, conv_accept_layers

        accept_states_layers(
            state_pools=stack.recurrent, state_slots=state_slots, table=table, last_accepted=last_accepted
        )
        conv_accept_layers(conv_state_pools=stack.conv, state_slots=state_slots, x=inputs, last_accepted=last_accepted)
        return
    for i in range(stack.recurrent.shape[0]):
        layer_table = VerifyTable(table.k[i], table.delta[i], table.g[i])
        accept_states_naive(
            state_pool=stack.recurrent[i], state_slots=state_slots, table=layer_table, last_accepted=last_accepted
        )
        conv_accept_naive(
            conv_state_pool=stack.conv[i], state_slots=state_slots, x=inputs[i], last_accepted=last_accepted
        )


def replay_steps(state: torch.Tensor, k: torch.Tensor, delta: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The state after the given recurrent steps, in order: state [..., Hv, K, V] float32; k [L, ..., Hv,
    K]; delta [L, ..., Hv, V]; g [L, ..., Hv]."""
    for t in range(k.shape[0]):
        state = state * g[t].exp()[..., None, None] + k[t][..., :, None] * delta[t][..., None, :]
    return state


def accept_states_naive(
    *,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    table: VerifyTable,
    last_accepted: torch.Tensor,
) -> None:
    """Write-on-accept in plain torch: each row's slot becomes the state after token
    `last_accepted[n]` (0 .. L - 1) of its verify; -1 leaves the slot as it is."""
    slots = state_slots.long()
    state = state_pool[slots].double()  # [N, Hv, K, V]: as the naive recurrence accumulates
    last = last_accepted.long()
    for t in range(table.k.shape[1]):
        k, delta, g = table.k[:, t].double(), table.delta[:, t].double(), table.g[:, t].double()
        step = state * g.exp()[..., None, None] + k[:, :, :, None] * delta[:, :, None, :]
        keep = (t <= last)[:, None, None, None]
        state = torch.where(keep, step, state)
    state_pool[slots] = state.to(state_pool.dtype)


def accept_states(
    *,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    table: VerifyTable,
    last_accepted: torch.Tensor,
) -> None:
    """Write-on-accept: replay each row's accepted verify steps on its slot.

    state_pool: [S, Hv, K, V] float32; state_slots: [N]; table: the layer's VerifyTable of N rows;
    last_accepted: [N] int, the index of the last accepted token of each row's verify (-1: none, the
    slot keeps its state). Reads the device tensor: no host sync."""
    if state_pool.is_cuda:
        from .accept import accept_states as impl
    else:
        impl = accept_states_naive
    impl(state_pool=state_pool, state_slots=state_slots, table=table, last_accepted=last_accepted)


def conv_windows_at(
    *,
    x: torch.Tensor,
    conv_state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    captures: StateCaptures,
) -> None:
    """For each capture, the conv window after `offset` tokens of its sequence (the last W - 1 inputs
    before that point: the slot's old window, or zeros without initial state, then x's rows) written
    into the capture's slot of conv_state_pool. Call it BEFORE the conv op updates the slots.

    x: [T, C] the conv inputs of the op's sequences; conv_state_pool: [S, C, W - 1]."""
    if not captures.items:
        return
    starts = captures.starts()
    width_1 = conv_state_pool.shape[-1]
    for c in captures.items:
        start = starts[c.seq]
        rows = x[max(start, start + c.offset - width_1) : start + c.offset].t()  # [C, <= W - 1]
        missing = width_1 - rows.shape[1]
        if missing:  # device ops only: no host read of the slot id or the flag
            old = conv_state_pool[state_slots[c.seq].long()][:, width_1 - missing :]
            old = torch.where(has_initial_state[c.seq].bool(), old, torch.zeros_like(old))
            rows = torch.cat([old, rows.to(conv_state_pool.dtype)], dim=1)
        conv_state_pool[c.slot] = rows.to(conv_state_pool.dtype)


def conv_accept_naive(
    *, conv_state_pool: torch.Tensor, state_slots: torch.Tensor, x: torch.Tensor, last_accepted: torch.Tensor
) -> None:
    """conv_accept in plain torch (the reference and the CPU path)."""
    slots = state_slots.long()
    old_windows = conv_state_pool[slots]
    width_1 = old_windows.shape[-1]
    seq = torch.cat([old_windows, x.transpose(1, 2).to(old_windows.dtype)], dim=2)  # [N, C, W - 1 + L]
    idx = last_accepted.long()[:, None, None] + 1 + torch.arange(width_1, device=x.device)[None, None, :]
    window = seq.gather(2, idx.clamp(min=0).expand(-1, seq.shape[1], -1))
    conv_state_pool[slots] = window.to(conv_state_pool.dtype)


def conv_accept(
    *,
    conv_state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    x: torch.Tensor,
    last_accepted: torch.Tensor,
) -> None:
    """Write-on-accept for the conv windows: each row's slot, still holding its window from before
    the verify (the verify's conv leaves it: causal_conv1d_varlen(update_state=False)), becomes the
    last W - 1 of (that window, then the verify's inputs up to token last_accepted[n]); -1 keeps the
    window. x: [N, L, C] (channels contiguous); last_accepted: [N] int. No host sync."""
    if conv_state_pool.is_cuda:
        from .accept import conv_accept as impl
    else:
        impl = conv_accept_naive
    impl(conv_state_pool=conv_state_pool, state_slots=state_slots, x=x, last_accepted=last_accepted)


def _upload(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values as a device tensor of dtype (pinned and non-blocking to CUDA)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


@dataclass(frozen=True)
class PreparedCaptures:
    """A CapturePlan with what the kernels read on the device: chunk_slots [num_chunks] int32 (the slot
    to store the state after each chunk in, -1: none); int64, the dtype of a prefill graph's
    FixedCaptures fields, so that the replay and window kernels compile one variant for eager passes
    and graphs: for the R replays, replay_first [R] (the row of the op's inputs their chunk starts at),
    replay_count [R] (tokens), replay_slots [R]; for the C captures' conv windows, win_seq, win_start
    (the stream's first row), win_end (the capture's row), win_slot [C]."""

    plan: CapturePlan
    chunk_slots: torch.Tensor
    replay_first: torch.Tensor
    replay_count: torch.Tensor
    replay_slots: torch.Tensor
    win_seq: torch.Tensor
    win_start: torch.Tensor
    win_end: torch.Tensor
    win_slot: torch.Tensor

    def window_fields(self) -> dict:
        """The conv windows as a triton_conv1d.capture_windows takes them: seq, start, end, dst."""
        return dict(seq=self.win_seq, start=self.win_start, end=self.win_end, dst=self.win_slot)


@dataclass(frozen=True)
class CapturePlan:
    """How a chunked kernel serves a set of captures."""

    # global chunk index -> slot: the kernel stores the state after that chunk there
    chunk_stores: dict[int, int]
    # (sequence, slot): the sequence's initial state is copied there before the kernel runs
    initial_stores: tuple[tuple[int, int], ...]
    # (source slot, destination slot): copies after the kernel, for captures that share a stored state
    copies: tuple[tuple[int, int], ...]
    # (sequence, first token (sequence-relative: a chunk's start), count, slot): replays after the copies
    replays: tuple[tuple[int, int, int, int], ...]


def plan_captures(captures: StateCaptures, chunk: int) -> CapturePlan:
    """Split captures into what the chunked kernel stores and what is replayed after it."""
    chunk_stores: dict[int, int] = {}
    initial: dict[int, int] = {}
    copies, replays = [], []
    first_chunk = []
    total = 0
    for n in captures.seq_lens:
        first_chunk.append(total)
        total += -(-n // chunk)
    for c in captures.items:
        length = captures.seq_lens[c.seq]
        if c.offset == length:  # the final state: the sequence's last chunk
            base_chunks, rest = -(-length // chunk), 0
        else:
            base_chunks, rest = divmod(c.offset, chunk)
        if base_chunks == 0:
            holder = initial.setdefault(c.seq, c.slot)
        else:
            holder = chunk_stores.setdefault(first_chunk[c.seq] + base_chunks - 1, c.slot)
        if holder != c.slot:
            copies.append((holder, c.slot))
        if rest:
            replays.append((c.seq, base_chunks * chunk, rest, c.slot))
    return CapturePlan(chunk_stores, tuple(initial.items()), tuple(copies), tuple(replays))
