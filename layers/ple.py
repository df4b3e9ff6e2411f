"""Per-layer n-gram embeddings (PLE, Qwen4-Exp): hashed n-gram lookups injected into every
hyper-connection stream before a GDN layer (transformers' Qwen4ExpTextPLELayer).

For each token t and each n-gram order m = 2..N, the tokens t, t-1, .., t-m+1 (an earlier token is
EOS when an EOS lies between it and t, and before the sequence start) are hashed
(XOR of token * per-layer odd multiplier) into `heads_per_ngram` prime-sized tables; the looked-up
rows, concatenated, give the token's embedding e [ple_embed_dim]. Then, per stream i:

    gate_i  = <norm_key(key_proj e)_i, norm_query(stream)_i> / sqrt(hidden), signed sqrt
    value_i = sigmoid(gate_i) * value_proj e
    out     = value + silu(dilated causal depthwise conv(norm_conv(value)))     [T, count * hidden]

Per-sequence state (in the state pool beside the GDN slot, same slot index): the last N - 1 token
ids (the n-gram context) and the conv's last (kernel - 1) * N inputs (the conv window). Both are
rebuilt at any point of a chunk from the window before it and the chunk's own tokens, which is what
prefix-cache captures inside a chunk use.

Tensor parallel: each rank holds a column slice of every table row (head_dim / tp of each head) and
the matching input columns of key_proj / value_proj, so the projections' partial sums take one
all-reduce; the rest (norms, conv, state) is replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import CheckpointTensor, ForwardContext, LazyTensor, copy_into
from .common import empty_param, project, whole
from .config_qwen4 import PleConfig
from .hyper_connections import grouped_rms_norm
from .kernels.precision import acc_dtype
from .parallel import ParallelLayout, all_reduce
from .pass_rows import PassRows

_MASK64 = (1 << 64) - 1
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_PRIME_1 = 10007


# ---------------------------------------------------------------------------------------------
# Table sizes and hash multipliers: transformers' definitions, computed once per model
# ---------------------------------------------------------------------------------------------
def _splitmix64(value: int) -> int:
    value = (value + _SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The odd hash multiplier of each n-gram position of PLE layer `ple_index` (small enough that
    token * multiplier never overflows int64)."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base_seed = seed + _PRIME_1 * ple_index
    return [
        2 * (_splitmix64((base_seed + _SPLITMIX_GAMMA * (i + 1)) & _MASK64) % half_bound) + 1 for i in range(ngram_size)
    ]


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact below 3.3e24)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def head_vocab_sizes(ple: PleConfig, ple_index: int) -> list[int]:
    """Table rows of each head of PLE layer `ple_index`: the primes after vocab_size_base - 1, one per
    head over all PLE layers in order (transformers' _find_nth_prime_after)."""
    first = ple_index * ple.num_heads
    primes, candidate = [], ple.vocab_size_base - 1
    while len(primes) < first + ple.num_heads:
        candidate += 1
        if is_prime(candidate):
            primes.append(candidate)
    return primes[first:]


def chunk_rows(rows: int, parts: int) -> list[int]:
    """Rows of each checkpoint shard of a table of `rows` rows saved in `parts` parts (torch.chunk)."""
    size = -(-rows // parts)
    count = -(-rows // size)
    return [size] * (count - 1) + [rows - size * (count - 1)]


# ---------------------------------------------------------------------------------------------
# Per-sequence windows of a pass
# ---------------------------------------------------------------------------------------------
def extend_rows(x: torch.Tensor, window: torch.Tensor, rows: PassRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's window [R, W, ...] followed by its tokens' x [T, ...], rows one after the other:
    (ext [T + R * W, ...], each token's position in ext [T])."""
    num_rows, width = window.shape[0], window.shape[1]
    ext = torch.empty((x.shape[0] + num_rows * width, *x.shape[1:]), dtype=x.dtype, device=x.device)
    tok_pos = torch.arange(x.shape[0], device=x.device) + (rows.token_rows + 1) * width
    ext[tok_pos] = x
    offsets = torch.arange(width, device=x.device)
    win_pos = (rows.starts + torch.arange(num_rows, device=x.device) * width)[:, None] + offsets
    ext[win_pos.flatten()] = window.flatten(0, 1).to(x.dtype)
    return ext, tok_pos


def window_at(
    ext: torch.Tensor, rows: PassRows, row: torch.Tensor, offset: torch.Tensor, width: int, count: int | None = None
) -> torch.Tensor:
    """The window (of `width`, as extend_rows laid out ext) after `offset` tokens of each given row:
    [M, width, ...]; or `count` entries from the window's start."""
    start = rows.starts[row] + row * width + offset
    return ext[start[:, None] + torch.arange(count or width, device=ext.device)]


def final_windows(ext: torch.Tensor, rows: PassRows, width: int) -> torch.Tensor:
    """Each row's window after all its tokens of the pass: [R, width, ...]."""
    row = torch.arange(rows.num_rows, device=ext.device)
    return window_at(ext, rows, row, rows.ends - rows.starts, width)


@dataclass
class PleState:
    """A PLE layer's per-sequence state, indexed by the GDN state slot: tokens [slots, N - 1] int64 (the
    n-gram context), conv [slots, (kernel - 1) * N, count * hidden] (the conv window).

    Speculative decoding (write-on-accept, as the GDN layer's): a verify pass over L tokens a row leaves
    the slots as they were and keeps each row's windows followed by its L inputs, verify_tokens
    [rows, N - 1 + L] and verify_conv [rows, (kernel - 1) * N + L, count * hidden]; accepting a + 1
    tokens keeps the windows that end after them. None until speculative decoding is enabled."""

    tokens: torch.Tensor
    conv: torch.Tensor
    verify_tokens: torch.Tensor | None = None
    verify_conv: torch.Tensor | None = None


class PerLayerEmbedding(nn.Module):
    def __init__(
        self,
        ple: PleConfig,
        ple_index: int,
        vocab_size: int,
        hidden_size: int,
        count: int,
        eps: float,
        layout: ParallelLayout,
    ):
        super().__init__()
        self.ple, self.ple_index, self.layout = ple, ple_index, layout
        self.hidden_size, self.count, self.eps = hidden_size, count, eps
        self.col_start, self.cols = layout.split(ple.head_dim, "ple_embed_dim / n-gram heads")
        sizes = head_vocab_sizes(ple, ple_index)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.table_rows = -(-sum(sizes) // ple.vocab_divisor) * ple.vocab_divisor
        self.table = empty_param(self.table_rows, self.cols)
        width = count * hidden_size
        # [key_proj (count * hidden rows) | value_proj (hidden rows)] over this rank's embedding columns
        self.kv_proj = empty_param(width + hidden_size, ple.num_heads * self.cols)
        self.norm_key = empty_param(width)
        self.norm_query = empty_param(width)
        self.norm_conv = empty_param(width)
        self.conv_weight = empty_param(width, ple.conv_kernel_size)
        dev = self.table.device
        self.register_buffer(
            "multipliers", torch.tensor(layer_multipliers(vocab_size, ple.ngram_size, ple_index, ple.seed), device=dev)
        )
        self.register_buffer("head_sizes", torch.tensor(sizes, device=dev))
        self.register_buffer("head_offsets", torch.tensor(offsets, device=dev))

    # ---- weights -----------------------------------------------------------------------------
    def checkpoint_tensors(self, prefix: str) -> list[CheckpointTensor]:
        ple, width, h = self.ple, self.count * self.hidden_size, self.hidden_size
        emb = f"{prefix}ple_embedding."
        table_name = f"{emb}ngram_embedding.weight"
        shards = chunk_rows(self.table_rows, ple.split_parts)
        pieces = tuple(f"{table_name}#{i}" for i in range(len(shards)))
        c0, c1 = self.col_start, self.col_start + self.cols

        def load_rows(first: int, name: str):
            def load(t: LazyTensor) -> None:
                copy_into(self.table[first : first + t.shape[0]], t.get(slice(None), slice(c0, c1)), name)

            return load

        # the whole table, or (what save_pretrained writes) its shards concatenated in shard order
        out = [CheckpointTensor(table_name, (self.table_rows, ple.head_dim), load_rows(0, table_name), pieces)]
        first = 0
        for i, rows in enumerate(shards):
            name = f"{emb}ngram_embedding.shard_{i}.weight"
            out.append(
                CheckpointTensor(name, (rows, ple.head_dim), load_rows(first, name), (pieces[i],), alternative=True)
            )
            first += rows
        out += [
            self._proj_columns(f"{prefix}key_proj.weight", 0, width),
            self._proj_columns(f"{prefix}value_proj.weight", width, h),
            whole(f"{prefix}norm_key.weight", self.norm_key, init="zeros"),
            whole(f"{prefix}norm_query.weight", self.norm_query, init="zeros"),
            whole(f"{prefix}norm_conv.weight", self.norm_conv, init="zeros"),
            CheckpointTensor(
                f"{prefix}conv1d.weight",
                (width, 1, ple.conv_kernel_size),
                lambda t: copy_into(self.conv_weight, t.get()[:, 0], f"{prefix}conv1d.weight"),
            ),
        ]
        # the hash constants: computed from the config; a checkpoint's own values win (transformers
        # loads these buffers too)
        for name, buf in (
            ("layer_multipliers", self.multipliers),
            ("ngram_heads_vocab_sizes", self.head_sizes),
            ("ngram_heads_offsets", self.head_offsets),
        ):
            full = f"{emb}{name}"
            out.append(
                CheckpointTensor(
                    full,
                    tuple(buf.shape),
                    lambda t, b=buf, n=full: copy_into(b, t.get(), n),
                    init="computed",
                    alternative=True,
                )
            )
        return out

    def _proj_columns(self, name: str, first_row: int, rows: int) -> CheckpointTensor:
        ple, cols = self.ple, self.cols

        def load(t: LazyTensor) -> None:
            for head in range(ple.num_heads):
                src = head * ple.head_dim + self.col_start
                copy_into(
                    self.kv_proj[first_row : first_row + rows, head * cols : (head + 1) * cols],
                    t.get(slice(None), slice(src, src + cols)),
                    name,
                )

        return CheckpointTensor(name, (rows, ple.embed_dim), load)

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        return {
            "ple_tokens": ((self.ple.context_len,), torch.int64),
            "ple_conv": ((self.ple.conv_state_len, self.count * self.hidden_size), None),
        }

    def verify_buffers(self, state: PleState, rows: int, length: int) -> PleState:
        """The state with its write-on-accept buffers for up to `rows` verify rows of `length` tokens."""
        ple, width = self.ple, self.count * self.hidden_size
        return PleState(
            state.tokens,
            state.conv,
            verify_tokens=torch.zeros((rows, ple.context_len + length), dtype=torch.int64, device=state.conv.device),
            verify_conv=torch.zeros(
                (rows, ple.conv_state_len + length, width), dtype=state.conv.dtype, device=state.conv.device
            ),
        )

    def write_on_accept(self, state: PleState, slots: torch.Tensor, last_accepted: torch.Tensor) -> None:
        """After a verify pass of the first len(slots) rows: each slot keeps the windows that end after
        the row's last accepted token (-1: the windows from before the verify)."""
        n = slots.shape[0]
        first = (last_accepted.long() + 1)[:, None]
        for pool, table, width in (
            (state.tokens, state.verify_tokens, self.ple.context_len),
            (state.conv, state.verify_conv, self.ple.conv_state_len),
        ):
            if width:
                idx = first + torch.arange(width, device=slots.device)
                rows = torch.arange(n, device=slots.device)[:, None]
                pool[slots.long()] = table[:n][rows, idx].to(pool.dtype)

    # ---- forward -------------------------------------------------------------------------------
    def ngram_ids(self, ext: torch.Tensor, tok_pos: torch.Tensor) -> torch.Tensor:
        """Table rows [T, heads] of each token, from the token ids with their context (extend_rows)."""
        eos = self.ple.eos_token_id
        shifted = [ext[tok_pos]]
        for s in range(1, self.ple.ngram_size):
            earlier = ext[tok_pos - s]
            # an EOS between a token and an earlier one hides the earlier one (and all before it)
            shifted.append(earlier if s == 1 else torch.where(shifted[-1] == eos, eos, earlier))
        per = self.ple.heads_per_ngram
        mixed = shifted[0] * self.multipliers[0]
        blocks = []
        for m in range(2, self.ple.ngram_size + 1):
            mixed = torch.bitwise_xor(mixed, shifted[m - 1] * self.multipliers[m - 1])
            heads = slice((m - 2) * per, (m - 1) * per)
            blocks.append(torch.remainder(mixed[:, None], self.head_sizes[heads]) + self.head_offsets[heads])
        return torch.cat(blocks, dim=1)

    def forward(self, streams: torch.Tensor, ctx: ForwardContext, rows: PassRows, state: PleState) -> torch.Tensor:
        """streams [T, count * hidden] -> what PLE adds to them; updates the rows' state slots."""
        ple, width = self.ple, self.count * self.hidden_size
        init = rows.has_init
        old_tokens = torch.where(init[:, None], state.tokens[rows.slots], ple.eos_token_id)
        ext_tokens, tok_pos = extend_rows(ctx.input_ids.long(), old_tokens, rows)
        emb = F.embedding(self.ngram_ids(ext_tokens, tok_pos), self.table).flatten(1)
        kv = all_reduce(project(emb.to(self.kv_proj.dtype), self.kv_proj, ctx.kernels), self.layout)
        key = grouped_rms_norm(kv[:, :width], self.norm_key, self.hidden_size, self.eps)
        value = kv[:, width:]
        query = grouped_rms_norm(streams, self.norm_query, self.hidden_size, self.eps)
        gate = (key * query).unflatten(-1, (self.count, -1)).sum(-1, keepdim=True) / math.sqrt(self.hidden_size)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
        conv_in = grouped_rms_norm(gated, self.norm_conv, self.hidden_size, self.eps)

        span = ple.conv_state_len
        old_conv = state.conv[rows.slots]
        old_conv = torch.where(
            init[:, None, None], old_conv, torch.zeros((), dtype=old_conv.dtype, device=old_conv.device)
        )
        ext_conv, conv_pos = extend_rows(conv_in, old_conv, rows)
        conv = torch.zeros(conv_in.shape, dtype=acc_dtype(conv_in), device=conv_in.device)  # one rounding, as conv1d
        taps = ple.conv_kernel_size
        for j in range(taps):
            conv += self.conv_weight[:, j].to(conv.dtype) * ext_conv[conv_pos - (taps - 1 - j) * ple.ngram_size]
        out = gated + F.silu(conv.to(conv_in.dtype))

        self._capture(ctx, rows, ext_tokens, ext_conv, state)
        keep = slice(None)
        decode = ctx.decode
        if decode is not None and decode.tokens_per_row > 1 and state.verify_tokens is not None:
            # a verify keeps its rows' slots and records their windows; write_on_accept picks one
            n, length = decode.num_seqs, decode.tokens_per_row
            zero = torch.zeros(n, dtype=torch.long, device=streams.device)
            row = torch.arange(n, device=streams.device)
            state.verify_tokens[:n] = window_at(ext_tokens, rows, row, zero, ple.context_len, ple.context_len + length)
            state.verify_conv[:n] = window_at(ext_conv, rows, row, zero, span, span + length).to(state.conv.dtype)
            keep = slice(n, None)
        slots = rows.slots[keep]
        state.tokens[slots] = final_windows(ext_tokens, rows, ple.context_len)[keep]
        if span:
            state.conv[slots] = final_windows(ext_conv, rows, span)[keep].to(state.conv.dtype)
        return out

    def _capture(self, ctx, rows: PassRows, ext_tokens, ext_conv, state: PleState) -> None:
        """Prefix-cache captures inside the prefill chunk: the state after `offset` tokens of a stream
        into the capture's snapshot slot, as the GDN layer captures its own."""
        captures = ctx.midchunk_capture
        if captures is None or not captures.items:
            return
        device = ext_tokens.device
        row = torch.tensor([rows.num_decode_rows + c.seq for c in captures.items], device=device)
        offset = torch.tensor([c.offset for c in captures.items], device=device)
        slots = torch.tensor([c.slot for c in captures.items], device=device)
        state.tokens[slots] = window_at(ext_tokens, rows, row, offset, self.ple.context_len)
        if self.ple.conv_state_len:
            state.conv[slots] = window_at(ext_conv, rows, row, offset, self.ple.conv_state_len).to(state.conv.dtype)
