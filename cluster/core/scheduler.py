"""Continuous batching without phases: every pass takes, in order, the running requests (each wants
`num_tokens - num_computed_tokens` tokens: 1 when decoding, a prompt chunk when prefilling) and
then waiting ones, under a token budget and a sequence cap. The plan's rows put single-token rows of
cached requests first (decode rows), then the prefill streams batched into one chunk.

When pages run out, the newest running request is preempted: its pages and slot are freed and it
is recomputed later from its prompt and the tokens it already produced.

Async scheduling: the engine may plan pass N+1 before pass N's sampled tokens are known. A request
whose token from the previous pass is still in flight (`num_pending_outputs`) gets a one-token decode
row whose input the worker takes on the device from that pass's sampled ids (`input_from_prev`).
When the output arrives, a token for a request that finished in the meantime is discarded.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from dataclasses import dataclass

import numpy as np

from deltaserve.cluster.config import SchedulerConfig
from deltaserve.workers.plan import NewRequestData, PassPlan, RunnerOutput

from .allocator import BlockAllocator, StateSlotAllocator
from .request import FinishReason, Request, RequestStatus, SampleRef

log = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_passes: int = 0
    # sampled tokens dropped because their request finished while the pass ran (async scheduling)
    num_discarded_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockAllocator, slots: StateSlotAllocator):
        """`config.max_model_len` is the engine's effective limit (an int)."""
        self.config = config
        self.blocks = blocks
        self.slots = slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_since_last_plan: list[str] = []
        self._failed: list[Request] = []
        self._pass_id = 0
        # pass id -> the requests of its rows, from planning until its output is applied
        self._rows_in_flight: dict[int, list[Request]] = {}

    # ---- queue -----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request_id: {req.req_id!r} is already in use")
        self.requests[req.req_id] = req
        self.waiting.append(req)

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
        self._release(req)
        self.requests.pop(req.req_id, None)
        self._finished_since_last_plan.append(req.req_id)

    def abort(self, req_id: str) -> Request | None:
        req = self.requests.get(req_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT)
        return req

    def _release(self, req: Request) -> None:
        # a pass in flight may still use these pages and this slot: a later pass that reuses them runs
        # after it in stream order (one CUDA stream per worker, passes executed in plan order)
        self.blocks.free(req)
        self.slots.free(req)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self._release(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        victim.needs_worker_state = True
        self.waiting.appendleft(victim)
        self.stats.num_preemptions += 1
        # the worker drops its sampler state; the request's token history is resent on resume
        self._finished_since_last_plan.append(victim.req_id)
        log.debug("preempted %s (%d tokens)", victim.req_id, victim.num_tokens)

    # ---- one pass ----------------------------------------------------------------------------
    def schedule(self) -> PassPlan | None:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []

        # running requests first, oldest first; preempt the newest when pages run out
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            want = min(self._tokens_wanted(req), budget)
            if want <= 0:
                i += 1
                continue
            if self.blocks.pages_needed(req, req.num_computed_tokens + want):  # most decode steps need none
                while not self.blocks.can_grow(req, req.num_computed_tokens + want):
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is req:
                        break
                if req.status is not RequestStatus.RUNNING:
                    break  # req itself was the newest and got preempted
                self.blocks.grow(req, req.num_computed_tokens + want)
            scheduled.append((req, want))
            budget -= want
            i += 1

        # then waiting requests, in arrival order (preempted ones were put back in front)
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and self.slots.num_free:
            req = self.waiting[0]
            if req.num_pending_outputs:
                break  # preempted with a token in flight: it resumes once that token is known
            want = req.num_tokens - req.num_computed_tokens
            if want > budget:
                if not cfg.enable_chunked_prefill:
                    break
                want = budget
            if not self.blocks.can_grow(req, want):
                break
            self.waiting.popleft()
            self.slots.allocate(req)
            self.blocks.grow(req, want)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, want))
            budget -= want

        if not scheduled:
            if self.running or self.waiting:
                self._check_progress()
            return None
        return self._build_plan(scheduled)

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
        decode = [(r, n) for r, n in scheduled if n == 1 and r.num_computed_tokens > 0]
        prefill = [(r, n) for r, n in scheduled if not (n == 1 and r.num_computed_tokens > 0)]
        rows = decode + prefill
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
        slot_mapping = [r.block_table[p // bs] * bs + p % bs for (r, _), p in zip(decode, positions, strict=True)]
        position_parts = [np.asarray(positions, dtype=np.int64)]
        slot_parts = [np.asarray(slot_mapping, dtype=np.int64)]
        for req, n in prefill:
            start = req.num_computed_tokens
            ids.extend(req.token_slice(start, start + n))
            pos = np.arange(start, start + n)
            position_parts.append(pos)
            slot_parts.append(np.asarray(req.block_table, dtype=np.int64)[pos // bs] * bs + pos % bs)
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
        plan = PassPlan(
            pass_id=self._pass_id,
            req_ids=[r.req_id for r, _ in rows],
            num_decode_rows=len(decode),
            input_ids=np.asarray(ids, dtype=np.int32),
            positions=np.concatenate(position_parts).astype(np.int32),
            slot_mapping=np.concatenate(slot_parts),
            query_start_loc=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
            seq_lens=np.asarray([r.num_computed_tokens + n for r, n in rows], dtype=np.int32),
            block_tables=block_tables,
            state_slots=np.asarray([r.state_slot for r, _ in rows], dtype=np.int32),
            has_initial_state=np.asarray([r.num_computed_tokens > 0 for r, _ in rows], dtype=bool),
            sample_rows=np.asarray(
                [r.num_computed_tokens + n == r.num_tokens + r.num_pending_outputs for r, n in rows], dtype=bool
            ),
            prompt_logprob_rows=np.asarray(
                [r.wants_prompt_logprobs and r.num_computed_tokens < r.num_prompt_tokens for r, _ in rows], dtype=bool
            ),
            next_prompt_token=np.asarray(
                [
                    r.prompt_token_ids[r.num_computed_tokens + n]
                    if r.num_computed_tokens + n < r.num_prompt_tokens
                    else -1
                    for r, n in rows
                ],
                dtype=np.int32,
            ),
            input_from_prev=(
                np.asarray(from_prev + [-1] * len(prefill), dtype=np.int32) if any(j >= 0 for j in from_prev) else None
            ),
            new_requests=new_requests,
            finished_req_ids=self._finished_since_last_plan,
        )
        self._finished_since_last_plan = []
        self._pass_id += 1
        self.stats.num_passes += 1
        j = 0
        for (req, n), sampled in zip(rows, plan.sample_rows.tolist(), strict=True):
            req.num_computed_tokens += n
            if sampled:
                req.num_pending_outputs += 1
                req.last_sample = SampleRef(plan.pass_id, j)
                j += 1
        self._rows_in_flight[plan.pass_id] = [r for r, _ in rows]
        return plan

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
    def apply_output(self, plan: PassPlan, output: RunnerOutput) -> list[Request]:
        """Append sampled tokens; finish requests on EOS, stop ids, max_tokens or the length limit.
        Returns the requests that got a token this pass (finished ones included)."""
        # the plan's own request objects: an id may be reused by a new request while the pass ran
        rows = self._rows_in_flight.pop(plan.pass_id, None)
        by_id = {r.req_id: r for r in rows} if rows is not None else self.requests
        # prompt logprobs first: a request that finishes on this pass's token leaves self.requests
        for req_id, entries in output.prompt_logprobs.items():
            req = by_id.get(req_id)
            if req is not None and not req.is_finished:
                _extend_prompt_logprobs(req, entries, plan)
        touched = []
        for req_id, token in zip(output.req_ids, output.sampled_token_ids, strict=True):
            req = by_id.get(req_id)
            if req is None:
                continue
            req.num_pending_outputs = max(0, req.num_pending_outputs - 1)
            if req.is_finished:
                self.stats.num_discarded_tokens += 1  # aborted or stopped while the pass ran
                continue
            req.output_token_ids.append(int(token))
            if req_id in output.logprobs:
                req.logprobs.append(output.logprobs[req_id])
            touched.append(req)
            self._check_stop(req, int(token))
        return touched

    def _check_stop(self, req: Request, token: int) -> None:
        params = req.sampling_params
        num_out = len(req.output_token_ids)
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
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
