"""Prefix-cache captures of a pass whose shapes are fixed (a prefill CUDA graph, workers/prefill_graphs.py).

The same captures as `StateCaptures` and served the same way (state.plan_captures: the chunked
kernel stores the state at a chunk boundary, the tokens after it are replayed on the capture's
slot), but every position and slot sits in a device tensor of fixed size that the host fills
before each replay, so that one captured graph serves any capture points of its pass.

Up to `capacity` entries of each kind. An entry a pass does not use names the scratch slot and
a stream without initial state and replays no token: it changes nothing but scratch (the copies
skip it, the replay kernel's program for it returns). The kernels replay an entry on the chunked
op's own intermediates (advance.py), the reference as recurrent steps (the recurrent op's
`lengths`, over CHUNK - 1 gathered rows of which it keeps the entry's count).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .state import StateCaptures, plan_captures

CHUNK = 64  # the chunked kernels' chunk (chunk.CHUNK, naive's default)

# rows of `fields`: initial stores (stream, slot), copies (source, destination), replays (first
# token row of the pass, token count, slot), conv windows (stream, its first row, the capture row, slot),
# and whether each initial store and copy entry is used (the slot copies skip the others)
INIT_SEQ, INIT_SLOT, COPY_SRC, COPY_DST, REPLAY_FIRST, REPLAY_COUNT, REPLAY_SLOT = range(7)
WIN_SEQ, WIN_START, WIN_END, WIN_SLOT = range(7, 11)
INIT_USED, COPY_USED = range(11, 13)
NUM_FIELDS = 13


def max_chunks(num_tokens: int, num_seqs: int) -> int:
    """An upper bound on the chunks of num_tokens tokens over num_seqs streams (the kernels' grid)."""
    return num_tokens // CHUNK + num_seqs


@dataclass
class FixedCaptures:
    """chunk_slots [chunks] int32: the slot to store the state after each (pass-global) chunk in,
    -1: none. fields [NUM_FIELDS, capacity] int64 (the rows above). Both device tensors, views
    of a graph's static buffers."""

    chunk_slots: torch.Tensor
    fields: torch.Tensor
    # index tensors derived from `fields`, made by the first GDN layer and reused by the others
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def capacity(self) -> int:
        return int(self.fields.shape[1])

    # ---- host side -----------------------------------------------------------------------------
    @staticmethod
    def stage(
        fields: np.ndarray, chunk_slots: np.ndarray, captures: StateCaptures | None, scratch_slot: int, idle_seq: int
    ) -> bool:
        """Fill host arrays (fields [NUM_FIELDS, capacity], chunk_slots [chunks]) with `captures`
        (None: none). idle_seq: a stream without initial state (unused entries point at it).
        False, arrays unspecified, when the captures need more entries than there are."""
        capacity = fields.shape[1]
        starts = [0] if captures is None else captures.starts()
        idle_start = 0 if captures is None else starts[idle_seq]
        fields[INIT_SEQ], fields[INIT_SLOT] = idle_seq, scratch_slot
        fields[COPY_SRC], fields[COPY_DST] = scratch_slot, scratch_slot
        fields[REPLAY_FIRST], fields[REPLAY_COUNT], fields[REPLAY_SLOT] = 0, 0, scratch_slot
        fields[WIN_SEQ], fields[WIN_START], fields[WIN_END] = idle_seq, idle_start, idle_start
        fields[WIN_SLOT] = scratch_slot
        fields[INIT_USED], fields[COPY_USED] = 0, 0
        chunk_slots[:] = -1
        if captures is None or not captures.items:
            return True
        plan = plan_captures(captures, CHUNK)
        if max(len(captures.items), len(plan.initial_stores), len(plan.copies), len(plan.replays)) > capacity:
            return False
        for index, slot in plan.chunk_stores.items():
            chunk_slots[index] = slot
        for i, (seq, slot) in enumerate(plan.initial_stores):
            fields[INIT_SEQ, i], fields[INIT_SLOT, i], fields[INIT_USED, i] = seq, slot, 1
        for i, (src, dst) in enumerate(plan.copies):
            fields[COPY_SRC, i], fields[COPY_DST, i], fields[COPY_USED, i] = src, dst, 1
        for i, (seq, first, count, slot) in enumerate(plan.replays):
            fields[REPLAY_FIRST, i], fields[REPLAY_COUNT, i], fields[REPLAY_SLOT, i] = starts[seq] + first, count, slot
        for i, c in enumerate(captures.items):
            start = starts[c.seq]
            fields[WIN_SEQ, i], fields[WIN_START, i], fields[WIN_END, i], fields[WIN_SLOT, i] = (
                c.seq, start, start + c.offset, c.slot,
            )  # fmt: skip
        return True

    # ---- device side: device ops only (no host sync), the same on every GDN layer ----------------
    def _index(self, name: str, num_tokens: int, width: int) -> torch.Tensor:
        """Index tensors shared by the layers: 'replay' [C, CHUNK - 1] token rows (the reference's);
        'window' [C, W - 1] token rows, whether each is the stream's own, and the column of the slot's
        old window otherwise."""
        key = (name, num_tokens, width)
        if key not in self._derived:
            f = self.fields
            if name == "replay":
                steps = torch.arange(CHUNK - 1, device=f.device)
                self._derived[key] = (f[REPLAY_FIRST, :, None] + steps).clamp(max=num_tokens - 1)
            else:
                j = torch.arange(width, device=f.device)
                rows = f[WIN_END, :, None] - width + j
                own = rows >= f[WIN_START, :, None]
                col = (rows - f[WIN_START, :, None] + width).clamp(0, width - 1)
                self._derived[key] = (rows.clamp(0, num_tokens - 1), own, col)
        return self._derived[key]

    def store_initial(
        self, state_pool: torch.Tensor, state_slots: torch.Tensor, has_initial: torch.Tensor, copy_slots
    ) -> None:
        """Before the chunked kernel: captures inside a stream's first chunk start from its initial
        state (`copy_slots`: a copy_state_slots, naive.py's or slot_copy.py's)."""
        f = self.fields
        copy_slots(pool=state_pool, dst=f[INIT_SLOT], used=f[INIT_USED], src=f[INIT_SEQ], slots=state_slots,
                   keep=has_initial)  # fmt: skip

    def copies(self, state_pool: torch.Tensor, copy_slots) -> None:
        """After the chunked kernel: copies of boundary states shared by several captures."""
        f = self.fields
        copy_slots(pool=state_pool, dst=f[COPY_DST], used=f[COPY_USED], src=f[COPY_SRC])

    def finish(
        self, q, k, v, g, beta, state_pool: torch.Tensor, scale, use_qk_l2norm: bool, recurrent, copy_slots
    ) -> None:
        """After the chunked kernel: copies of shared boundary states, then every replay in one
        recurrent call, token by token (inputs as the chunked op's: q, k [T, Hk, K], v [T, Hv, V], g,
        beta [T, Hv]; `recurrent`: a fused_recurrent_gated_delta_rule, the reference's here)."""
        f = self.fields
        self.copies(state_pool, copy_slots)
        rows = self._index("replay", q.shape[0], 0)
        flat = rows.reshape(-1)
        c, n = rows.shape

        def take(x: torch.Tensor) -> torch.Tensor:
            return x.index_select(0, flat).view(c, n, *x.shape[1:])

        recurrent(
            q=take(q), k=take(k), v=take(v), g=take(g), beta=take(beta), state_pool=state_pool,
            state_slots=f[REPLAY_SLOT], scale=scale, use_qk_l2norm=use_qk_l2norm, lengths=f[REPLAY_COUNT],
        )  # fmt: skip

    def replay_fields(self) -> dict:
        """The replay entries as advance.advance_within_chunks takes them: first, count, slots
        (unused entries: count 0)."""
        f = self.fields
        return dict(first=f[REPLAY_FIRST], count=f[REPLAY_COUNT], slots=f[REPLAY_SLOT])

    def window_fields(self) -> dict:
        """The conv window entries as a triton_conv1d.capture_windows takes them: seq, start, end, dst."""
        f = self.fields
        return dict(seq=f[WIN_SEQ], start=f[WIN_START], end=f[WIN_END], dst=f[WIN_SLOT])

    def conv_windows(
        self, x: torch.Tensor, conv_state_pool: torch.Tensor, state_slots: torch.Tensor, has_initial: torch.Tensor
    ) -> None:
        """state.conv_windows_at for these captures (call it before the conv op updates the slots),
        with torch ops (the reference and the CPU path; triton_conv1d.capture_windows on CUDA)."""
        width = conv_state_pool.shape[-1]
        rows, own, col = self._index("window", x.shape[0], width)
        c, channels = rows.shape[0], x.shape[1]
        new = x.index_select(0, rows.reshape(-1)).view(c, width, channels).transpose(1, 2)
        seq = self.fields[WIN_SEQ]
        old = conv_state_pool.index_select(0, state_slots.long().index_select(0, seq))
        old = torch.where(has_initial.bool().index_select(0, seq)[:, None, None], old, torch.zeros_like(old))
        old = old.gather(2, col[:, None, :].expand(-1, channels, -1))
        window = torch.where(own[:, None, :], new.to(conv_state_pool.dtype), old)
        conv_state_pool.index_copy_(0, self.fields[WIN_SLOT], window)
