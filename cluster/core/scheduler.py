"""Continuous batching without phases: every pass takes, in order, the running requests (each wants
`num_tokens - num_computed_tokens` tokens: 1 when decoding, a prompt chunk when prefilling) and
then waiting ones, under a token budget and a sequence cap. The plan's rows put single-token rows of
cached requests first (decode rows), then the prefill streams batched into one chunk.

When pages run out, the newest running request is preempted: its pages and slot are freed and it
is recomputed later from its prompt and the tokens it already produced.

`scheduling_policy="priority"` (vLLM's): running and waiting requests are planned in one order, by
`Request.priority` (lower first), then arrival; pages run out on the lowest running request first,
and a waiting request that does not fit (sequences, state slots, pages, adapter slots) preempts the
running ones of a lower priority.

Speculative decoding (`num_speculative_tokens` k > 0, cluster/core/speculative.py): a decoding request
with k drafts runs a verify row of k + 1 tokens; those rows become the pass's decode rows and the
other one-token rows join the prefill streams. A row after which the MTP head drafts holds pages
for k - 1 more positions (the head's draft steps write their KV there). A verify row counts one
computed token when planned and its accepted drafts when its output arrives.

Async scheduling: the engine may plan pass N+1 before pass N's sampled tokens are known. A request
whose token from the previous pass is still in flight (`num_pending_outputs`) gets a one-token decode
row whose input the worker takes on the device from that pass's sampled ids (`input_from_prev`).
When the output arrives, a token for a request that finished in the meantime is discarded.

Structured output: a constrained request's grammar travels to the workers in the next plan
(`PassPlan.grammars`), which compile it in the background; the request waits, while the requests
behind it are admitted, until a RunnerOutput reports its grammar ready, so that no pass waits for a
compile. When nothing else would run it is admitted at once (its pass waits, stalling no one).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from deltaserve.cluster.config import SchedulerConfig
from deltaserve.workers.config import short
from deltaserve.workers.grammar import MAX_CACHED_GRAMMARS
from deltaserve.workers.plan import GrammarSpec, NewRequestData, PassPlan, RunnerOutput

from .allocator import BlockAllocator, StateSlotAllocator
from .lora import AdapterRegistry
from .prefix_cache import Hit, PrefixCache, RequestHashes, Snapshot, root_hash
from .request import FinishReason, Request, RequestStatus, SampleRef
from .speculative import SpecStats

log = logging.getLogger(__name__)

READY_GRAMMARS = MAX_CACHED_GRAMMARS // 2


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_passes: int = 0
    # sampled tokens dropped because their request finished while the pass ran (async scheduling)
    num_discarded_tokens: int = 0


def rank(req: Request) -> tuple[int, float, str]:
    """A request's place under scheduling_policy="priority": priority, then arrival (the id breaks
    ties, so that the order is total)."""
    return req.priority, req.arrival_time, req.req_id


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockAllocator,
        slots: StateSlotAllocator,
        prefix: PrefixCache | None = None,
        loras: AdapterRegistry | None = None,
        num_speculative_tokens: int = 0,
    ):
        """`config.max_model_len` is the engine's effective limit (an int); `loras`: the adapter
        registry whose device slots requests on adapters pin while they run; num_speculative_tokens: the
        drafts of a verify row (0: no speculative decoding)."""
        self.config = config
        self.blocks = blocks
        self.slots = slots
        self.loras = loras
        # prefix caching (None: off): the index, snapshot saves waiting for the next plan, and this
        # plan's restores and page copies
        self.prefix = prefix if prefix is not None and prefix.enabled else None
        self._pending_saves: list[tuple[int, Snapshot]] = []
        # rows of the last plan whose newly computed full blocks are not yet in the page index: the
        # engine indexes them once the plan is launched (register_planned_blocks), while the pass runs
        self._unregistered: list[Request] = []
        self._restores: list[tuple[int, int]] = []
        self._page_copies: list[tuple[int, int]] = []
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_since_last_plan: list[str] = []
        self._failed: list[Request] = []
        self._pass_id = 0
        # pass id -> the requests of its rows, from planning until its output is applied
        self._rows_in_flight: dict[int, list[Request]] = {}
        # structured output: grammar keys the workers reported compiled (the most recently used,
        # fewer than a worker keeps: one forgotten here is sent and waited for again, never assumed
        # compiled), keys sent to them, and grammars for the next plan
        self._grammars_ready: OrderedDict[str, None] = OrderedDict()
        self._grammars_sent: set[str] = set()
        self._grammars_to_send: dict[str, GrammarSpec] = {}
        self._by_priority = config.scheduling_policy == "priority"
        self.k = num_speculative_tokens
        self.spec_stats = SpecStats(self.k) if self.k else None
        # this plan's rows by request id: verify rows, and rows after which the head drafts
        self._verify: set[str] = set()
        self._drafting: set[str] = set()
        # tests and benchmarks: an object whose propose(req, k, head_drafts) replaces the head's
        # drafts (drafts of known quality); the head still runs
        self.drafter = None

    # ---- queue -----------------------------------------------------------------------------
    def _enqueue(self, queue: deque[Request] | list[Request], req: Request) -> None:
        """Append (fcfs), or insert in (priority, arrival) order (priority)."""
        if self._by_priority:
            bisect.insort(queue, req, key=rank)
        else:
            queue.append(req)

    def add(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request_id: {short(req.req_id, 80)} is already in use")
        self.requests[req.req_id] = req
        self._enqueue(self.waiting, req)
        if req.grammar is not None and req.grammar.key not in self._grammars_sent:
            self._grammars_to_send[req.grammar.key] = req.grammar

    def _grammar_ready(self, req: Request) -> bool:
        if req.grammar is None:
            return True
        if req.grammar.key not in self._grammars_ready:
            return False
        self._grammars_ready.move_to_end(req.grammar.key)
        return True

    def reset_grammars(self) -> None:
        """The workers were replaced: they hold no compiled grammar; send the waiting ones again."""
        self._grammars_ready.clear()
        self._grammars_sent.clear()
        self._grammars_to_send = {r.grammar.key: r.grammar for r in self.waiting if r.grammar is not None}

    def _grammars_reported(self, output: RunnerOutput) -> None:
        """Grammars compiled (their requests may run) or not (their waiting requests fail)."""
        for key, error in output.grammars_ready.items():
            if error is None:
                self._grammars_ready[key] = None
                while len(self._grammars_ready) > READY_GRAMMARS:
                    self._grammars_sent.discard(self._grammars_ready.popitem(last=False)[0])
                continue
            self._grammars_sent.discard(key)  # a later request with it asks again
            for req in [r for r in self.waiting if r.grammar is not None and r.grammar.key == key]:
                self.finish(req, FinishReason.ERROR, f"structured_outputs: the grammar did not compile: {error}")
                self._failed.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a request (any state) and free what it holds."""
        if req.is_finished:
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        if req in self.running:
            self.running.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        if reason is not FinishReason.ERROR:
            self._save_state(req)
        self._release(req)
        self.requests.pop(req.req_id, None)
        self._finished_since_last_plan.append(req.req_id)

    def abort(self, req_id: str) -> Request | None:
        req = self.requests.get(req_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT)
        return req

    # ---- prefix caching ----------------------------------------------------------------------
    def _hashes(self, req: Request) -> RequestHashes:
        if req.prefix_hashes is None:
            req.prefix_hashes = RequestHashes(root_hash(req.cache_key))
        return req.prefix_hashes

    def _save_state(self, req: Request) -> None:
        """Keep a finished or preempted request's GDN state as a snapshot (its slot is copied at the
        start of the next plan, before anything can reuse it)."""
        pos = req.num_computed_tokens
        if self.prefix is None or not self.prefix.policy.finish or req.state_slot is None or pos == 0:
            return
        if pos > req.num_tokens:
            return  # a token it was fed is still in flight: its id is not known here
        snap = self._new_snapshot(req, pos)
        if snap is not None:
            self._pending_saves.append((req.state_slot, snap))

    def _new_snapshot(self, req: Request, pos: int) -> Snapshot | None:
        """A snapshot slot for `req`'s state after `pos` tokens (its partly filled page held), or None:
        one of that prefix is held already (touched: kept longer), or no slot is free of the plan."""
        key = self.prefix.snapshot_key(self._hashes(req), req.token_array(0, pos), pos)
        old = self.prefix.snapshots.get(key)
        if old is not None:
            self.prefix.snapshots.touch(old)
            return None
        bs = self.blocks.block_size
        return self.prefix.snapshots.take(key, pos, req.block_table[pos // bs] if pos % bs else None)

    def _take_saves(self) -> list[tuple[int, int]]:
        """The saves for this plan: those whose snapshot is still held (an evicted one's slot may
        be another snapshot's already)."""
        saves = [(slot, snap.slot) for slot, snap in self._pending_saves if self.prefix.snapshots.get(snap.key) is snap]
        self._pending_saves = []
        return saves

    def _admit_from_cache(self, req: Request, budget: int) -> int | None:
        """Admit a waiting request at its longest cached prefix: shared pages, its snapshot restored
        into its slot. Returns the tokens it will run in this pass, or None when its pages do not fit
        (nothing is taken then)."""
        tokens = req.all_token_ids
        if req.sampling_params.prompt_logprobs is not None:  # every prompt position needs its logits
            hit = Hit(0, [], None, False, 0)
        else:
            hashes = self._hashes(req)  # from the int32 tokens (no conversion of the list)
            hashes.extend(req.token_array(0, req.num_tokens), self.blocks.block_size, req.num_tokens)
            hit = self.prefix.lookup(hashes, tokens)
        want = req.num_tokens - hit.position
        if want > budget:
            if not self.config.enable_chunked_prefill:
                return None
            want = budget
        pages = hit.pages if hit.snapshot is not None else []
        bs = self.blocks.block_size
        taken_from_free = sum(self.blocks.cache.counts_as_free(p) for p in pages)
        free = self.blocks.num_free - self.prefix.snapshots.page_pinning_takes(hit.snapshot)
        if -(-(hit.position + want) // bs) - len(pages) + taken_from_free > free:
            return None
        if hit.snapshot is not None:
            # kept until this plan is built: its save (if it was taken in this very step) and the
            # restore from it must both reach the plan
            self.prefix.snapshots.touch(hit.snapshot)
            self.prefix.snapshots.pin(hit.snapshot)
        self.blocks.share(req, pages)
        self.slots.allocate(req)
        self.blocks.grow(req, hit.position + want)
        stats = self.prefix.stats
        if req.num_cached_tokens is None:
            req.num_cached_tokens = hit.position
            stats.queries += 1
            stats.query_tokens += req.num_prompt_tokens
            stats.hit_tokens += hit.position
            stats.hits += hit.position > 0
        if hit.snapshot is not None:
            self._restores.append((hit.snapshot.slot, req.state_slot))
            if hit.copy_tail:
                self._page_copies.append((hit.snapshot.tail_page, req.block_table[len(pages)]))
        req.num_computed_tokens = hit.position
        req.kv_shared_until = len(pages) * bs
        req.divergence = hit.divergence if hit.divergence > hit.position else 0
        return want

    def _capture_points(self, req: Request, start: int, end: int) -> list[int]:
        """Positions in (start, end] where this prefill chunk leaves a snapshot (CapturePolicy)."""
        policy, bs = self.prefix.policy, self.blocks.block_size
        points = set()
        if policy.interval:
            first = (start // policy.interval + 1) * policy.interval
            points.update(range(first, end + 1, policy.interval))
        prompt = req.num_prompt_tokens
        if policy.prompt_end:
            points.add(prompt)
        if policy.last_block:
            points.add((prompt - 1) // bs * bs)
        if policy.divergence and req.divergence:
            points.add(req.divergence)
        return sorted(p for p in points if start < p <= end and p > 0)

    def _plan_captures(self, rows: list[tuple[Request, int]], first_prefill: int) -> list[tuple[int, int, int]]:
        captures = []
        for i, (req, n) in enumerate(rows[first_prefill:], start=first_prefill):
            start = req.num_computed_tokens
            if n == 1 and start > 0 and start >= req.num_prompt_tokens:
                continue  # a decode row among the prefill streams (a speculative pass): as any decode row
            for pos in self._capture_points(req, start, start + n):
                snap = self._new_snapshot(req, pos)
                if snap is None:
                    continue
                # this pass writes the slot: no later take (or page reclaim) of this plan may reuse it
                self.prefix.snapshots.pin(snap)
                captures.append((i, pos - start, snap.slot))
        return captures

    def _save_decode_row_points(self, decode: list[tuple[Request, int]]) -> None:
        """A one-token prompt chunk planned as a decode row (the kernels capture nothing there): its
        capture point is the state its slot holds after this pass, saved at the start of the next."""
        for req, _ in decode:
            start = req.num_computed_tokens
            if start >= req.num_prompt_tokens:
                continue
            for pos in self._capture_points(req, start, start + 1):
                snap = self._new_snapshot(req, pos)
                if snap is not None:
                    self._pending_saves.append((req.state_slot, snap))

    def _register_blocks(self, req: Request) -> None:
        """Index the request's full blocks whose tokens are known and computed (by a planned pass)."""
        bs = self.blocks.block_size
        hashes = self._hashes(req)
        full = min(req.num_computed_tokens, req.num_tokens) // bs
        if full <= hashes.registered:
            return  # most decode steps complete no block
        if len(hashes.hashes) < full:
            hashes.extend(req.token_array(0, full * bs), bs, full * bs)
        cache = self.prefix.pages
        for j in range(hashes.registered, full):
            if cache.lookup(hashes.hashes[j]) is not None:
                continue  # indexed already (a hit's shared blocks: a thousand of them after a long prefix)
            block = tuple(req.token_slice(j * bs, (j + 1) * bs))
            cache.register(req.block_table[j], hashes.chain(j), hashes.hashes[j], block)
        hashes.registered = full

    def set_prefix_cache(self, prefix: PrefixCache | None) -> None:
        """Turn the cache on or off; saves not yet in a plan are dropped with their snapshots (their
        slots may be reused before the cache is used again)."""
        if self.prefix is not None and prefix is None:
            for _, snap in self._pending_saves:
                self.prefix.snapshots.discard(snap)
            self._pending_saves = []
        self.prefix = prefix

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and snapshot (requests running keep what they hold)."""
        if self.prefix is not None:
            self._pending_saves = []
            self.prefix.reset()
        return True

    def _release(self, req: Request) -> None:
        # a pass in flight may still use these pages and this slot: a later pass that reuses them runs
        # after it in stream order (one CUDA stream per worker, passes executed in plan order)
        self.blocks.free(req)
        self.slots.free(req)
        if req.lora_slot is not None:
            self.loras.release(req.lora_slot)
            req.lora_slot = None

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self._save_state(victim)  # it resumes from here (and so can any request sharing its tokens)
        self._release(victim)
        if victim.prefix_hashes is not None:
            victim.prefix_hashes.registered = 0  # its new pages are offered to the index again
        victim.kv_shared_until = 0
        victim.num_computed_tokens = 0
        victim.draft_token_ids = []
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        victim.needs_worker_state = True
        if self._by_priority:
            self._enqueue(self.waiting, victim)
        else:
            self.waiting.appendleft(victim)
        self.stats.num_preemptions += 1
        # the worker drops its sampler state; the request's token history is resent on resume
        self._finished_since_last_plan.append(victim.req_id)
        log.debug("preempted %s (%d tokens)", victim.req_id, victim.num_tokens)

    # ---- one pass ----------------------------------------------------------------------------
    def schedule(self) -> PassPlan | None:
        self.register_planned_blocks()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        self._restores, self._page_copies = [], []
        self._verify, self._drafting = set(), set()
        compiling: list[Request] = []
        if self._by_priority:
            budget = self._plan_by_priority(budget, scheduled, compiling)
        else:
            budget = self._plan_in_arrival_order(budget, scheduled, compiling)
        if compiling and not scheduled and not self.running:
            # nothing else would run: its pass waits for the compile, and stalls no one
            want = self._admit(compiling[0], budget)
            if want is not None:
                self.waiting.remove(compiling[0])
                scheduled.append((compiling[0], want))
                budget -= want

        if not scheduled:
            if self.prefix is not None:
                self.prefix.snapshots.unpin_all()
            if self.running or self.waiting:
                self._check_progress()
            return None
        return self._build_plan(scheduled)

    def _plan_in_arrival_order(
        self, budget: int, scheduled: list[tuple[Request, int]], compiling: list[Request]
    ) -> int:
        """fcfs: the running requests first, oldest first, then waiting ones in arrival order
        (preempted ones were put back in front) while they fit; those whose grammar the workers
        still compile (into `compiling`), and completions waiting for their leader's prompt, are
        passed over. Returns the budget left."""
        cfg = self.config
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            want = self._plan_running(req, budget)
            if want is None:
                break  # req itself was the newest and got preempted
            if want:
                scheduled.append((req, want))
                budget -= want
            i += 1

        passed: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and self.slots.num_free:
            req = self.waiting[0]
            if req.num_pending_outputs:
                break  # preempted with a token in flight: it resumes once that token is known
            if self._follows_leader(req):
                passed.append(self.waiting.popleft())
                continue
            if not self._grammar_ready(req):
                compiling.append(req)
                passed.append(self.waiting.popleft())
                continue
            want = self._admit(req, budget)
            if want is None:
                break
            self.waiting.popleft()
            scheduled.append((req, want))
            budget -= want
        self.waiting.extendleft(reversed(passed))
        return budget

    def _plan_by_priority(self, budget: int, scheduled: list[tuple[Request, int]], compiling: list[Request]) -> int:
        """priority: running and waiting requests in one order, by (priority, arrival), so that a
        request's tokens come before those of every lower-priority one; a waiting request that does
        not fit preempts the running ones of a lower priority, lowest first. Both lists are kept in
        that order, so the lowest running request (the victim) is never one already planned."""
        todo = list(self.running)
        ri = wi = 0
        admitting = True
        admitted: set[str] = set()
        while budget > 0:
            while ri < len(todo) and (todo[ri].status is not RequestStatus.RUNNING or todo[ri].req_id in admitted):
                ri += 1  # preempted by an earlier request of this pass (and maybe admitted again)
            run = todo[ri] if ri < len(todo) else None
            wait = self.waiting[wi] if admitting and wi < len(self.waiting) else None
            if run is None and wait is None:
                break
            if wait is None or (run is not None and rank(run) < rank(wait)):
                ri += 1
                want = self._plan_running(run, budget)
                if want:
                    scheduled.append((run, want))
                    budget -= want
                continue
            if wait.num_pending_outputs:
                admitting = False  # preempted with a token in flight: it resumes once that token is known
                continue
            if self._follows_leader(wait):
                wi += 1
                continue
            if not self._grammar_ready(wait):
                compiling.append(wait)
                wi += 1
                continue
            want = self._admit_outranking(wait, budget)
            if want is None:
                admitting = False
                continue
            del self.waiting[wi]
            admitted.add(wait.req_id)
            scheduled.append((wait, want))
            budget -= want
        return budget

    def _admit_outranking(self, req: Request, budget: int) -> int | None:
        """Admit a waiting request, preempting running ones of a lower priority (lowest first) while
        it does not fit; None when it still does not."""
        cfg = self.config
        while True:
            if len(self.running) < cfg.max_num_seqs and self.slots.num_free:
                want = self._admit(req, budget)
                if want is not None:
                    return want
            if not cfg.enable_chunked_prefill and req.num_tokens - req.num_computed_tokens > budget:
                return None  # the budget, not room, is short: preempting frees no budget
            if not self.running or self.running[-1].priority <= req.priority:
                return None
            self._preempt(self.running[-1])

    def _plan_running(self, req: Request, budget: int) -> int | None:
        """A running request's tokens in this pass (0: none), its pages grown; when pages run out the
        last running request (fcfs: the newest; priority: the lowest) is preempted, until they fit or
        `req` itself was (None)."""
        want = min(self._tokens_wanted(req), budget)
        if want <= 0:
            return 0
        if self._verifies(req, want, budget):
            want = self.k + 1
            self._verify.add(req.req_id)
        # a verify row's pages also hold the head's k - 1 draft steps after it
        need = req.num_computed_tokens + want + (self.k - 1 if req.req_id in self._verify else 0)
        if self.blocks.pages_needed(req, need):  # most decode steps need none
            while not self.blocks.can_grow(req, need):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                self._verify.discard(req.req_id)
                return None
            self.blocks.grow(req, need)
        self._plan_drafting(req, want)
        return want

    def _follows_leader(self, req: Request) -> bool:
        """A completion of an n > 1 request waits while its leader's prompt is still to be planned:
        then it starts from the leader's cached pages and snapshot (with prefix caching on)."""
        lead = req.prefill_leader
        if lead is None or self.prefix is None or lead.is_finished:
            return False
        if lead.num_computed_tokens >= lead.num_prompt_tokens:
            req.prefill_leader = None  # planned: nothing to wait for any more
            return False
        return True

    def _admit(self, req: Request, budget: int) -> int | None:
        """Take an adapter slot, pages and a state slot for a waiting request and make it running;
        returns the tokens it runs in this pass, or None when it does not fit (nothing is taken then)."""
        if req.lora is not None and req.lora_slot is None:
            req.lora_slot = self.loras.acquire(req.lora)
            if req.lora_slot is None:
                return None  # every adapter slot is pinned by running requests on other adapters
        if self.prefix is not None:
            want = self._admit_from_cache(req, budget)
            if want is None:
                self._unpin_adapter(req)
                return None
        else:
            want = req.num_tokens - req.num_computed_tokens
            cfg = self.config
            if want > budget and not cfg.enable_chunked_prefill or not self.blocks.can_grow(req, min(want, budget)):
                self._unpin_adapter(req)
                return None
            want = min(want, budget)
            self.slots.allocate(req)
            self.blocks.grow(req, want)
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self._enqueue(self.running, req)
        self._plan_drafting(req, want)
        return want

    def _unpin_adapter(self, req: Request) -> None:
        """A waiting request that was not admitted gives its adapter slot back (the load, if the slot
        was just assigned, still reaches the next plan: harmless)."""
        if req.lora_slot is not None:
            self.loras.release(req.lora_slot)
            req.lora_slot = None

    def _tokens_wanted(self, req: Request) -> int:
        """Tokens `req` could run in the next pass: its uncomputed tokens, or (async scheduling) one
        decode token for the token the previous pass sampled, not known here yet."""
        pending = req.num_pending_outputs
        if not pending:
            return req.num_tokens - req.num_computed_tokens
        if pending > 1 or req.last_sample is None or req.last_sample.pass_id != self._pass_id - 1:
            return 0  # only the previous pass's sampled ids are on the device for the next one
        if req.num_computed_tokens != req.num_tokens:
            return 0
        if (
            len(req.output_token_ids) + pending >= req.max_tokens
            or req.num_tokens + pending >= self.config.max_model_len
        ):
            return 0  # that token is its last: no pass for a token that would be discarded
        return pending

    def _verifies(self, req: Request, want: int, budget: int) -> bool:
        """Whether a decoding request runs a verify row of its k drafts in this pass."""
        return (
            self.k > 0
            and want == 1
            and req.num_computed_tokens == req.num_tokens - 1
            and len(req.draft_token_ids) == self.k
            and budget >= self.k + 1
            and req.num_tokens + self.k <= self.config.max_model_len
        )

    def _plan_drafting(self, req: Request, want: int) -> None:
        """A speculating request's sampling row drafts when its pages hold the head's draft steps
        (verify rows got them with their own); without room it decodes plainly next pass."""
        if not self.k:
            return
        if req.req_id in self._verify:
            self._drafting.add(req.req_id)
            return
        end = req.num_computed_tokens + want
        if end != req.num_tokens + req.num_pending_outputs:
            return  # the row does not sample
        if self.blocks.can_grow(req, end + self.k - 1):
            self.blocks.grow(req, end + self.k - 1)
            self._drafting.add(req.req_id)

    def _check_progress(self) -> None:
        """A request that can never fit the page pool would wait forever: fail it instead."""
        if self.running or self.waiting[0].num_pending_outputs:
            return
        req = self.waiting[0]
        if -(-min(req.num_tokens, self.config.max_num_batched_tokens) // self.blocks.block_size) > self.blocks.capacity:
            self.finish(req, FinishReason.ERROR, "request does not fit the KV page pool")
            self._failed.append(req)

    def forget_in_flight(self) -> None:
        """The passes in flight are lost (a worker failed): nothing of theirs will be applied."""
        for rows in self._rows_in_flight.values():
            for req in rows:
                req.num_pending_outputs = 0
                req.last_sample = None
        self._rows_in_flight.clear()

    def pop_failed(self) -> list[Request]:
        """Requests the scheduler itself ended with an error since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def _build_plan(self, scheduled: list[tuple[Request, int]]) -> PassPlan:
        if self._verify:  # verify rows are the decode rows; one-token rows join the prefill streams
            verify = [(r, n) for r, n in scheduled if r.req_id in self._verify]
            prefill = [(r, n) for r, n in scheduled if r.req_id not in self._verify]
            return self._finish_plan(verify, [], prefill)
        decode = [(r, n) for r, n in scheduled if n == 1 and r.num_computed_tokens > 0]
        prefill = [(r, n) for r, n in scheduled if not (n == 1 and r.num_computed_tokens > 0)]
        return self._finish_plan([], decode, prefill)

    def _finish_plan(
        self, verify: list[tuple[Request, int]], decode: list[tuple[Request, int]], prefill: list[tuple[Request, int]]
    ) -> PassPlan:
        rows = verify + decode + prefill
        bs = self.blocks.block_size
        # decode rows: one token each, in plain Python (numpy per row costs more than it saves);
        # a token still in flight is a placeholder the worker replaces from the previous pass's ids
        ids, from_prev = [], []
        for r, _ in decode:
            if r.num_computed_tokens < r.num_tokens:
                ids.append(r.token_at(r.num_computed_tokens))
                from_prev.append(-1)
            else:
                ids.append(0)
                from_prev.append(r.last_sample.index)
        positions = [r.num_computed_tokens for r, _ in decode]
        # a one-token row of a hit may recompute a position whose KV sits in a shared page: not rewritten
        slot_mapping = [
            -1 if p < r.kv_shared_until else r.block_table[p // bs] * bs + p % bs
            for (r, _), p in zip(decode, positions, strict=True)
        ]
        position_parts = [np.asarray(positions, dtype=np.int64)]
        slot_parts = [np.asarray(slot_mapping, dtype=np.int64)]
        for req, _ in verify:  # the last token, then the drafts
            ids.append(req.token_at(req.num_computed_tokens))
            ids.extend(req.draft_token_ids)
        id_parts = [np.asarray(ids, dtype=np.int32)]
        for req, n in verify + prefill:
            start = req.num_computed_tokens
            if req.req_id not in self._verify:
                id_parts.append(req.token_array(start, start + n))
            pos = np.arange(start, start + n)
            position_parts.append(pos)
            slots = np.asarray(req.block_table, dtype=np.int64)[pos // bs] * bs + pos % bs
            if start < req.kv_shared_until:  # recomputed tokens whose KV sits in shared pages: not rewritten
                slots[pos < req.kv_shared_until] = -1
            slot_parts.append(slots)
        lengths = [n for _, n in rows]
        width = max(len(r.block_table) for r, _ in rows)
        block_tables = np.array([r.block_table + [0] * (width - len(r.block_table)) for r, _ in rows], dtype=np.int32)

        new_requests = []
        for req, _ in rows:
            if req.needs_worker_state:
                new_requests.append(
                    NewRequestData(req.req_id, list(req.prompt_token_ids), list(req.output_token_ids), self._spec(req))
                )
                req.needs_worker_state = False
        copies = {}
        if self.prefix is not None:
            saves = self._take_saves()
            captures = self._plan_captures(rows, len(verify) + len(decode))
            self._save_decode_row_points(decode)
            for name, pairs, width in (
                ("slot_saves", saves, 2),
                ("slot_restores", self._restores, 2),
                ("page_copies", self._page_copies, 2),
                ("captures", captures, 3),
            ):
                if pairs:
                    copies[name] = np.asarray(pairs, dtype=np.int32).reshape(-1, width)
        spec = {}
        if self.k:
            spec["draft_rows"] = np.asarray([r.req_id in self._drafting for r, _ in rows], dtype=bool)
            spec["num_spec_tokens"] = self.k if verify else 0
        plan = PassPlan(
            pass_id=self._pass_id,
            req_ids=[r.req_id for r, _ in rows],
            num_decode_rows=len(verify) + len(decode),
            input_ids=np.concatenate(id_parts),
            positions=np.concatenate(position_parts).astype(np.int32),
            slot_mapping=np.concatenate(slot_parts),
            query_start_loc=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
            seq_lens=np.asarray([r.num_computed_tokens + n for r, n in rows], dtype=np.int32),
            block_tables=block_tables,
            state_slots=np.asarray([r.state_slot for r, _ in rows], dtype=np.int32),
            has_initial_state=np.asarray([r.num_computed_tokens > 0 for r, _ in rows], dtype=bool),
            sample_rows=np.asarray(
                [
                    r.req_id in self._verify or r.num_computed_tokens + n == r.num_tokens + r.num_pending_outputs
                    for r, n in rows
                ],
                dtype=bool,
            ),
            prompt_logprob_rows=np.asarray(
                [r.wants_prompt_logprobs and r.num_computed_tokens < r.num_prompt_tokens for r, _ in rows], dtype=bool
            ),
            next_prompt_token=np.asarray(
                [
                    r.token_at(r.num_computed_tokens + n) if r.num_computed_tokens + n < r.num_tokens else -1
                    for r, n in rows
                ],
                dtype=np.int32,
            ),
            input_from_prev=(
                np.asarray(from_prev + [-1] * len(prefill), dtype=np.int32) if any(j >= 0 for j in from_prev) else None
            ),
            lora_slots=(
                np.asarray([-1 if r.lora_slot is None else r.lora_slot for r, _ in rows], dtype=np.int32)
                if any(r.lora_slot is not None for r, _ in rows)
                else None
            ),
            lora_loads=self.loras.take_loads() if self.loras is not None else [],
            new_requests=new_requests,
            finished_req_ids=self._finished_since_last_plan,
            grammars=list(self._grammars_to_send.values()),
            **copies,
            **spec,
        )
        self._grammars_sent.update(self._grammars_to_send)
        self._grammars_to_send = {}
        self._finished_since_last_plan = []
        self._pass_id += 1
        self.stats.num_passes += 1
        j = 0
        for (req, n), sampled in zip(rows, plan.sample_rows.tolist(), strict=True):
            # a verify row has computed its last token; its accepted drafts count when known
            req.num_computed_tokens += 1 if req.req_id in self._verify else n
            if sampled:
                req.num_pending_outputs += 1
                req.last_sample = SampleRef(plan.pass_id, j)
                j += 1
        self._rows_in_flight[plan.pass_id] = [r for r, _ in rows]
        if self.prefix is not None:
            self._unregistered = [req for req, _ in rows]
            self.prefix.snapshots.unpin_all()
        return plan

    def register_planned_blocks(self) -> None:
        """Index the full blocks the last plan computes (their hashes are chained over every token
        before them: ~1 us a block in Python, so thousands for a long prompt). The engine calls it once
        the plan is launched, so that the work overlaps the pass; `schedule` calls it first in case
        nothing did, since the next plan may hit these blocks. A request that finished or was
        preempted meanwhile is skipped: its pages are no longer its own."""
        pending, self._unregistered = self._unregistered, []
        if self.prefix is None:
            return
        for req in pending:
            if req.status is RequestStatus.RUNNING:
                self._register_blocks(req)

    @staticmethod
    def _spec(req: Request):
        spec = req.sampling_params.to_spec()
        if req.sampling_params.min_tokens:
            banned = list(req.sampling_params.stop_token_ids)
            if not req.sampling_params.ignore_eos:
                banned += list(req.eos_token_ids)
            spec.min_tokens = req.sampling_params.min_tokens
            spec.min_tokens_banned_ids = banned
        return spec

    # ---- results -----------------------------------------------------------------------------
    def apply_output(self, plan: PassPlan, output: RunnerOutput) -> list[tuple[Request, int]]:
        """Append sampled tokens; finish requests on EOS, stop ids, max_tokens or the length limit
        (a verify row's tokens after the one that ends it are dropped). Returns the requests that got
        tokens this pass (finished ones included), each with how many."""
        # the plan's own request objects: an id may be reused by a new request while the pass ran
        rows = self._rows_in_flight.pop(plan.pass_id, None)
        by_id = {r.req_id: r for r in rows} if rows is not None else self.requests
        if output.grammars_ready:
            self._grammars_reported(output)
        # prompt logprobs first: a request that finishes on this pass's token leaves self.requests
        for req_id, entries in output.prompt_logprobs.items():
            req = by_id.get(req_id)
            if req is not None and not req.is_finished:
                _extend_prompt_logprobs(req, entries, plan)
        touched = []
        verified = set(plan.req_ids[: plan.num_decode_rows]) if plan.num_spec_tokens else set()
        for req_id, token in zip(output.req_ids, output.sampled_token_ids, strict=True):
            req = by_id.get(req_id)
            if req is None:
                continue
            req.num_pending_outputs = max(0, req.num_pending_outputs - 1)
            if req.is_finished:
                self.stats.num_discarded_tokens += 1  # aborted or stopped while the pass ran
                continue
            if req_id in output.grammar_errors:  # its token was not constrained: not an output
                self.finish(req, FinishReason.ERROR, output.grammar_errors[req_id])
                self._failed.append(req)
                continue
            extra = output.extra_token_ids.get(req_id, ())
            if req_id in verified:
                req.num_computed_tokens += len(extra)  # the accepted drafts were computed correctly
                self.spec_stats.record(len(extra))
            tokens = [int(token), *extra]
            entries = []
            if req_id in output.logprobs:
                entries = [output.logprobs[req_id], *output.extra_logprobs.get(req_id, ())]
            for i, t in enumerate(tokens):
                req.output_token_ids.append(t)
                if entries:
                    req.logprobs.append(entries[i])
                self._check_stop(req, t)
                if req.is_finished:
                    tokens = tokens[: i + 1]
                    break
            if not req.is_finished and self.k:
                drafts = output.draft_token_ids.get(req_id, ())
                if drafts and self.drafter is not None:
                    drafts = self.drafter.propose(req, self.k, drafts)
                req.draft_token_ids = list(drafts)
            touched.append((req, len(tokens)))
        return touched

    def _check_stop(self, req: Request, token: int) -> None:
        params = req.sampling_params
        num_out = len(req.output_token_ids)
        if num_out >= params.min_tokens:
            # a grammar allows EOS only at its end, where nothing else may follow: it ends the output
            if (not params.ignore_eos or req.grammar is not None) and token in req.eos_token_ids:
                req.stop_reason = None
                self.finish(req, FinishReason.STOP)
                return
            if token in params.stop_token_ids:
                req.stop_reason = token
                self.finish(req, FinishReason.STOP)
                return
        if num_out >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            self.finish(req, FinishReason.LENGTH)


def _extend_prompt_logprobs(req: Request, entries, plan: PassPlan) -> None:
    """entries[i] is the logprob of token (chunk start + i + 1) given what precedes it; keep those
    that are prompt positions not yet recorded (a recomputed chunk repeats earlier ones)."""
    row = plan.req_ids.index(req.req_id)
    chunk_start = int(plan.positions[plan.query_start_loc[row]])
    if not req.prompt_logprobs:
        req.prompt_logprobs.append(None)  # the first prompt token has no logprob
    for i, entry in enumerate(entries):
        position = chunk_start + i + 1
        if position == len(req.prompt_logprobs) and position < req.num_prompt_tokens:
            req.prompt_logprobs.append(entry)
