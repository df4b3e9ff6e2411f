"""Start-up warm-up: eager passes that make Triton compile the kernel variants a server meets before
its first request (a first-use compile stalls every running request for seconds; compile_watch.py
logs the ones missed). They run on the profiling pool, or on the new pools before any request,
outputs dropped, and leave nothing behind: no sampler request, adapter slots and runner state as
they were.

- `WARMUP_BATCHES` and a prompt of the whole token budget: prefill tiles of several prompt lengths
  and mixed batches, the sampler's kernels on their logits, prefix-cache captures; with speculation
  the MTP head's catch-up over each.
- With LoRA: the same batches with adapter rows, once all on one slot and once on several slots
  beside base rows (`AdapterSlots.warmup_adapters`: the slots count as holding an adapter on every
  target, their weights untouched), so the prefill-sized adapter kernels (shrink / expand, the row
  grouping, the MoE's low-rank deltas) compile; decode sizes compile in the LoRA decode graphs.
- With speculation: small speculative steps (`SPEC_WARMUP_ROWS` requests) through the runner's own
  execute path: prompts that draft, eager verify rows (seeded sampled rows with logprobs beside
  greedy ones), verify rows beside a plain decode row and a new prompt, plain decode rows; each
  followed by the sampler's verify and rejection, write-on-accept, the head's catch-up and drafts.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

from deltaserve.workers.plan import NewRequestData, PassPlan, PoolSizes, SamplingSpec
from deltaserve.workers.spec_decode import SpecDecoder
from deltaserve.workers.state_pool import StatePool

if TYPE_CHECKING:
    from deltaserve.workers.runner import ModelRunner

# Batches run once at start-up, besides the profiling pass (one prompt of max_num_batched_tokens), so
# that the kernel variants a server meets are compiled before its first requests: Triton compiles a
# kernel per tile config (the MoE grouped GEMMs pick tiles by rows per expert: 256 experts x top-8
# give ~8 / 32 / 96 rows at these lengths) and per integer-argument class (1, a multiple of 16,
# other). Each batch is a list of streams (cached tokens, new tokens); decode rows (1 new token on a
# cache) come first. A first-use compile in a serving run stalls every running request for seconds.
WARMUP_BATCHES = (
    ((0, 256),),
    ((0, 1024),),
    ((0, 3072),),
    ((0, 100), (0, 333), (0, 568)),  # 3 prompts, 1,001 tokens
    tuple((0, 61) for _ in range(17)),  # 17 prompts, 1,037 tokens
    tuple((0, 64) for _ in range(16)),  # 16 prompts, 1,024 tokens
    ((40, 1), (17, 1), (300, 200), (0, 99)),  # decode rows, a continued chunk, a new prompt
    ((30, 1), (0, 50)),  # one decode row: the prefill rows' inputs start at an odd row offset
    tuple((20 + i, 1) for i in range(16)) + ((0, 77),),  # 16 decode rows and a short prompt
    ((0, 2100), (0, 2100), (0, 2100)),  # several long prompts: the GDN chunk kernels' third variant
    ((3000, 64),),  # a prefix-cache hit's few tokens over a long context: split-K attention and its merge
    # a decode row beside a short prompt, at each token-count class small mixed passes fall in, in two
    # slots (an engine of few sequences captures no decode graph that reaches them): the skinny GEMM's
    # 16-row tiles (5..16 rows), the MoE align's pair blocks (a power of two: 128 / 256 / 512 / 1,024
    # pairs), the sorted path's row blocks, the W8A8 GEMM's rows (17..127), each as a multiple of 16 and not
    *(((30, 1), (0, total - 1)) for total in (5, 12, 16, 24, 32, 40, 64, 100, 128)),
)

# warm-up batches (by row count) that also run with captures: one per chunk-kernel variant they pick
CAPTURE_WARMUP_ROWS = (1, 3)

# adapter slots the LoRA warm-up's several-slot passes spread their adapter rows over
LORA_WARMUP_SLOTS = 4

# requests of the speculative warm-up steps: Triton's row-count classes (1, other, a multiple of 16)
# for the verify rows, their k + 1 tokens each and the head's draft steps
SPEC_WARMUP_ROWS = (1, 3, 16)


def warmup_plan(streams: tuple[tuple[int, int], ...], block_size: int) -> PassPlan:
    """A prefill/decode plan over scratch pages and slots 0..N-1 (token ids 0): what runs matters,
    not the values. streams: (cached tokens, new tokens) per row, decode rows first."""
    pages_per_row = [-(-(cached + new) // block_size) for cached, new in streams]
    block_tables = np.zeros((len(streams), max(pages_per_row)), np.int32)
    positions, slot_mapping, first_page = [], [], 0
    for row, ((cached, new), pages) in enumerate(zip(streams, pages_per_row, strict=True)):
        block_tables[row, :pages] = np.arange(first_page, first_page + pages)
        pos = np.arange(cached, cached + new)
        positions.append(pos)
        slot_mapping.append(block_tables[row, pos // block_size].astype(np.int64) * block_size + pos % block_size)
        first_page += pages
    new_tokens = np.array([new for _, new in streams])
    cached = np.array([cached for cached, _ in streams])
    num_rows = len(streams)
    return PassPlan(
        pass_id=-1,
        req_ids=[f"warmup-{i}" for i in range(num_rows)],
        num_decode_rows=int(((new_tokens == 1) & (cached > 0)).sum()),
        input_ids=np.zeros(int(new_tokens.sum()), np.int32),
        positions=np.concatenate(positions).astype(np.int32),
        slot_mapping=np.concatenate(slot_mapping),
        query_start_loc=np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32),
        seq_lens=(cached + new_tokens).astype(np.int32),
        block_tables=block_tables,
        state_slots=np.arange(num_rows, dtype=np.int32),
        has_initial_state=cached > 0,
        sample_rows=np.ones(num_rows, bool),
        prompt_logprob_rows=np.zeros(num_rows, bool),
    )


def warmup_batches(max_tokens: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """WARMUP_BATCHES, then one prompt of the whole token budget: the profiling pass's shape, run again
    for its capture, adapter and catch-up variants (and at all with given pool sizes, which skip the
    profiling pass)."""
    full = ((0, max_tokens),)
    return WARMUP_BATCHES if full in WARMUP_BATCHES else (*WARMUP_BATCHES, full)


def warmup_fits(streams: tuple[tuple[int, int], ...], max_tokens: int, sizes: PoolSizes) -> bool:
    """Whether a warm-up batch fits the token budget and the profiling pool's pages and slots."""
    pages = sum(-(-(cached + new) // sizes.block_size) for cached, new in streams)
    return sum(new for _, new in streams) <= max_tokens and pages < sizes.num_blocks and len(streams) < sizes.num_slots


def profile_plan(tokens: int, block_size: int) -> PassPlan:
    return warmup_plan(((0, tokens),), block_size)


def warmup_slots() -> int:
    """GDN state slots the profiling pool needs for every warm-up batch (one more is scratch)."""
    return 1 + max(max(len(batch) for batch in WARMUP_BATCHES), max(SPEC_WARMUP_ROWS) + 2)


def lora_layouts(num_rows: int, num_slots: int) -> list[np.ndarray]:
    """The adapter slots of a warm-up batch's rows in its LoRA passes: every row on slot 0, then (two
    rows or more) even rows over up to LORA_WARMUP_SLOTS distinct slots beside odd base rows (-1)."""
    layouts = [np.zeros(num_rows, np.int32)]
    if num_rows > 1:
        spread = min(num_slots, LORA_WARMUP_SLOTS)
        layouts.append(np.array([-1 if i % 2 else (i // 2) % spread for i in range(num_rows)], np.int32))
    return layouts


# ---- one speculative warm-up sequence ------------------------------------------------------------
def spec_warmup_plans(n: int, k: int, block_size: int) -> list[PassPlan]:
    """The passes of one speculative warm-up over n requests (pages and slots from 0, distinct per
    request), as the scheduler would plan them for k drafts: (1) the n prompts, each drafting after
    it; (2) their verify rows; (3) verify rows again beside a plain decode row of a request that does
    not speculate (a repetition penalty) and a new prompt that drafts; (4) plain decode rows, every
    other one drafting. Request i < n samples greedily when i is odd, else a seeded draw with top-k /
    top-p and logprobs (an eager verify). Positions assume no draft is accepted: the values written
    are scratch, only the shapes matter (LoRA is not served with speculation: no adapter rows)."""
    prompts = [3 + 2 * i for i in range(n)] + [20, 9]  # request n: cached tokens of its decode row
    # last position each request writes: prompt, a verify row, a second one, a decode row and drafts
    ends = [p + 2 * k + 2 for p in prompts[:n]] + [prompts[n] + 1, prompts[n + 1] + k]
    pages, first = [], 0
    for end in ends:
        count = -(-end // block_size)
        pages.append(list(range(first, first + count)))
        first += count
    greedy = SamplingSpec(temperature=0.0)
    sampled = [SamplingSpec(temperature=0.8, top_k=8, top_p=0.9, seed=1 + i, logprobs=2) for i in range(n)]
    specs = [greedy if i % 2 else sampled[i] for i in range(n)]
    specs += [SamplingSpec(temperature=0.0, repetition_penalty=1.2), greedy]
    ids = [f"warmup-spec-{n}-{i}" for i in range(n + 2)]

    def plan(rows: list[tuple[int, int, int]], verify: int, drafting: list[bool], new: list[int]) -> PassPlan:
        """rows: (request, cached tokens, new tokens); the first `verify` are verify rows."""
        positions = [np.arange(c, c + t) for _, c, t in rows]
        width = max(len(pages[r]) for r, _, _ in rows)
        tables = np.array([pages[r] + [0] * (width - len(pages[r])) for r, _, _ in rows], np.int32)
        slots = [np.asarray(pages[r], np.int64)[p // block_size] * block_size + p % block_size
                 for (r, _, _), p in zip(rows, positions, strict=True)]  # fmt: skip
        num_rows = len(rows)
        return PassPlan(
            pass_id=-1,
            req_ids=[ids[r] for r, _, _ in rows],
            num_decode_rows=verify if verify else sum(t == 1 and c > 0 for _, c, t in rows),
            input_ids=np.zeros(sum(t for _, _, t in rows), np.int32),
            positions=np.concatenate(positions).astype(np.int32),
            slot_mapping=np.concatenate(slots),
            query_start_loc=np.concatenate([[0], np.cumsum([t for _, _, t in rows])]).astype(np.int32),
            seq_lens=np.array([c + t for _, c, t in rows], np.int32),
            block_tables=tables,
            state_slots=np.array([r for r, _, _ in rows], np.int32),
            has_initial_state=np.array([c > 0 for _, c, _ in rows], bool),
            sample_rows=np.ones(num_rows, bool),
            prompt_logprob_rows=np.zeros(num_rows, bool),
            next_prompt_token=np.full(num_rows, -1, np.int32),
            num_spec_tokens=k if verify else 0,
            draft_rows=np.array(drafting, bool),
            new_requests=[NewRequestData(ids[r], [0] * prompts[r], [], specs[r]) for r in new],
        )

    own = range(n)
    return [
        plan([(i, 0, prompts[i]) for i in own], 0, [True] * n, list(own)),
        plan([(i, prompts[i], k + 1) for i in own], n, [True] * n, []),
        plan(
            [(i, prompts[i] + 1, k + 1) for i in own] + [(n, prompts[n], 1), (n + 1, 0, prompts[n + 1])],
            n,
            [True] * n + [False, True],
            [n, n + 1],
        ),
        plan([(i, prompts[i] + 2, 1) for i in own], 0, [i % 2 == 0 for i in own], []),
    ]


def spec_fits(plans: list[PassPlan], max_tokens: int, max_rows: int, sizes: PoolSizes) -> bool:
    """Whether every pass of a speculative warm-up fits the token budget, the running requests and
    the pool's pages and slots (one of each is scratch)."""
    return all(
        p.num_tokens <= max_tokens
        and p.num_rows <= max_rows
        and int(p.block_tables.max()) < sizes.num_blocks - 1
        and int(p.state_slots.max()) < sizes.num_slots - 1
        for p in plans
    )


# ---- the warm-up ---------------------------------------------------------------------------------
def compile_warmup(runner: ModelRunner, pool: StatePool) -> int:
    """Run the warm-up passes that fit on `pool`'s scratch pages and slots; returns how many ran."""
    k = runner.config.runner.num_speculative_tokens
    head = _spec_decoder(runner, pool, k) if k else None
    passes, budget = 0, runner.config.max_num_batched_tokens
    for streams in warmup_batches(budget):
        if not warmup_fits(streams, budget, pool.sizes):
            continue
        plan = warmup_plan(streams, pool.sizes.block_size)
        logits, _, forward = runner._forward(plan, pool)
        passes += 1
        if logits is not None:
            runner.sampler.compile_warmup(logits)
        if head is not None and forward is not None:
            _catch_up(head, plan, *forward)
        if pool.sizes.num_snapshots >= 2 and len(streams) in CAPTURE_WARMUP_ROWS:
            # again with prefix-cache captures: a chunk-boundary store and a replayed remainder
            # (the chunk kernel variant this batch picks, compiled with its capture store, and the
            # replay kernel of that design, gdn/advance.py)
            first = plan.num_decode_rows
            new = int(plan.query_start_loc[first + 1] - plan.query_start_loc[first])
            plan.captures = np.array(
                [
                    [first, min(64, new), pool.sizes.num_slots],
                    [first, max(1, new - 5), pool.sizes.num_slots + 1],
                ],
                dtype=np.int32,
            )
            runner._forward(plan, pool)
            passes += 1
    if runner.lora is not None:
        passes += _lora_warmup(runner, pool)
    if head is not None:
        passes += _spec_warmup(runner, pool, head)
    return passes


def _lora_warmup(runner: ModelRunner, pool: StatePool) -> int:
    """The warm-up batches again with adapter rows (lora_layouts), on slots flagged for the warm-up."""
    lora, passes, budget = runner.lora, 0, runner.config.max_num_batched_tokens
    with lora.warmup_adapters(range(min(lora.num_slots, LORA_WARMUP_SLOTS))):
        for streams in warmup_batches(budget):
            if not warmup_fits(streams, budget, pool.sizes):
                continue
            plan = warmup_plan(streams, pool.sizes.block_size)
            for slots in lora_layouts(plan.num_rows, lora.num_slots):
                runner._forward(dataclasses.replace(plan, lora_slots=slots), pool)
                passes += 1
    return passes


def _spec_decoder(runner: ModelRunner, pool: StatePool, k: int) -> SpecDecoder:
    """The runner's SpecDecoder when it works on `pool`, else one over the profiling pool (given verify
    buffers for the warm-up's rows)."""
    if runner.spec is not None and runner.spec.pool is pool:
        return runner.spec
    rows = min(runner.config.max_num_seqs, max(SPEC_WARMUP_ROWS) + 2)
    pool.enable_verify(runner.model, rows=rows, length=k + 1)
    return SpecDecoder(runner.model, pool, k)


def _catch_up(head: SpecDecoder, plan: PassPlan, ctx, hidden: torch.Tensor) -> None:
    """The MTP head's catch-up over a warm-up pass (every row sampled token 0), without drafts (the
    warm-up plans hold no lookahead pages)."""
    n = plan.num_rows
    plan = dataclasses.replace(plan, next_prompt_token=np.full(n, -1, np.int32), draft_rows=None)
    tokens = torch.zeros(n, dtype=torch.long, device=hidden.device)
    head.after_sampling(plan, ctx, hidden, None, None, tokens, list(range(n)))


def _spec_warmup(runner: ModelRunner, pool: StatePool, head: SpecDecoder) -> int:
    """The speculative warm-up sequences that fit, each pass run and read as a served one."""
    passes, config = 0, runner.config
    with _serving_on(runner, pool, head):
        for n in SPEC_WARMUP_ROWS:
            plans = spec_warmup_plans(n, head.k, pool.sizes.block_size)
            # verify rows never outnumber the pool's verify buffers (max_num_seqs, or more than the plans' rows)
            if not spec_fits(plans, config.max_num_batched_tokens, config.max_num_seqs, pool.sizes):
                continue
            try:
                for plan in plans:
                    runner.execute(plan)
                    passes += 1
            finally:
                for plan in plans:
                    for data in plan.new_requests:
                        runner.sampler.remove(data.req_id)
    return passes


_MISSING = object()


@contextmanager
def _serving_on(runner: ModelRunner, pool: StatePool, head: SpecDecoder) -> Iterator[None]:
    """Inside the block the runner's execute path serves from `pool` with `head`, eagerly (no CUDA
    graph) and with no pass in flight before; its pools, graphs, sizes and pass bookkeeping are put
    back after (before `allocate` the runner has no pool and no sizes yet)."""
    names = ("pool", "sizes", "spec", "graphs", "verify_graphs", "_unresolved", "_prev", "_last_pass_end")
    saved = {name: getattr(runner, name, _MISSING) for name in names}
    runner.pool, runner.sizes, runner.spec = pool, pool.sizes, head
    runner.graphs = runner.verify_graphs = runner._prev = runner._last_pass_end = None
    runner._unresolved = deque()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                delattr(runner, name)
            else:
                setattr(runner, name, value)
