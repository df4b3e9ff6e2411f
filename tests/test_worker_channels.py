"""The worker's shared-memory loop (no Ray, a fake runner): it keeps one pass in flight, launching
the next plan before the previous pass is done when that plan is already there; it answers a pass
that is done when no plan follows (a synchronous driver never deadlocks); replies come back in pass
order, an error as an error frame."""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from deltaserve.workers.plan import RunnerOutput
from deltaserve.workers.shm_ring import ShmBroadcast, WaitPolicy
from deltaserve.workers.warmup import profile_plan
from deltaserve.workers.wire import REPLY_STAMPS, decode_output, decode_reply, encode_plan
from deltaserve.workers.worker import Worker


class FakeHandle:
    def __init__(self, runner: FakeRunner, pass_id: int):
        self.runner, self.pass_id = runner, pass_id

    def done(self) -> bool:
        # pass k "runs on the device" until plan k+1 was launched, or for at most a second
        return self.pass_id + 1 in self.runner.launched or time.perf_counter() - self.runner.t0[self.pass_id] > 1.0

    def result(self) -> RunnerOutput:
        self.runner.events.append(("result", self.pass_id))
        return RunnerOutput(pass_id=self.pass_id, req_ids=[], sampled_token_ids=[])


class FakeRunner:
    device = torch.device("cpu")

    def __init__(self):
        self.launched: list[int] = []
        self.events: list[tuple[str, int]] = []
        self.t0: dict[int, float] = {}

    def execute_async(self, plan) -> FakeHandle:
        if plan.pass_id < 0:
            raise ValueError("a bad plan")
        self.t0[plan.pass_id] = time.perf_counter()
        self.launched.append(plan.pass_id)
        self.events.append(("launch", plan.pass_id))
        return FakeHandle(self, plan.pass_id)


def plan_blob(pass_id: int) -> bytes:
    return encode_plan(dataclasses.replace(profile_plan(4, 4), pass_id=pass_id))


def reply_output(frame: bytes) -> RunnerOutput:
    ok, stamps, payload = decode_reply(frame)
    assert ok and len(stamps) == len(REPLY_STAMPS)
    # the worker's stage stamps come in order: read, decoded, launched, reply started, resolved, encoded
    assert list(stamps) == sorted(stamps)
    return decode_output(payload)


def test_worker_loop_overlaps_and_replies_in_order():
    wait = WaitPolicy()
    plans = ShmBroadcast.create(1, num_slots=4, slot_bytes=1 << 16, wait=wait)
    reply = ShmBroadcast.create(1, num_slots=4, slot_bytes=1 << 16, reader=0, wait=wait)
    worker = Worker(0, 1)
    worker.runner = runner = FakeRunner()
    try:
        worker.start_channels(plans.handle, reply.handle, os.getpid(), wait)
        # a synchronous driver: each reply before the next plan (pass 0 is done only after 1 s)
        plans.write(plan_blob(0))
        assert reply_output(reply.read(timeout=10)).pass_id == 0
        # overlapped: plan 2 is written while pass 1 still runs; the worker launches it first
        plans.write(plan_blob(1))
        time.sleep(0.05)
        plans.write(plan_blob(2))
        assert reply_output(reply.read(timeout=10)).pass_id == 1
        assert reply_output(reply.read(timeout=10)).pass_id == 2
        assert runner.events.index(("launch", 2)) < runner.events.index(("result", 1))
        # a plan that fails to launch answers with an error frame, in its turn
        plans.write(plan_blob(3))
        plans.write(plan_blob(-1))
        assert reply_output(reply.read(timeout=10)).pass_id == 3
        ok, _, error = decode_reply(reply.read(timeout=10))
        assert not ok and b"a bad plan" in error
    finally:
        plans.close()
        worker._loop.join(timeout=10)
        reply.close()
    assert not worker._loop.is_alive()


def test_worker_warms_its_codec_while_a_pass_runs():
    """With a polling wait policy (the GPU one) the loop re-decodes the last plan and re-encodes the
    last output while a pass is in flight; the replies are unchanged by it."""
    wait = WaitPolicy(spin_s=0.0, yield_s=1.0)
    plans = ShmBroadcast.create(1, num_slots=4, slot_bytes=1 << 16, wait=wait)
    reply = ShmBroadcast.create(1, num_slots=4, slot_bytes=1 << 16, reader=0, wait=wait)
    worker = Worker(0, 1)
    worker.runner = FakeRunner()
    warmed = []
    warm = worker._warm

    def counting_warm():
        warmed.append((worker._last_plan is not None, worker._last_output is not None))
        warm()

    worker._warm = counting_warm
    try:
        worker.start_channels(plans.handle, reply.handle, os.getpid(), wait)
        for pass_id in range(2):  # each pass "runs" for a second (no next plan comes)
            plans.write(plan_blob(pass_id))
            assert reply_output(reply.read(timeout=10)).pass_id == pass_id
    finally:
        plans.close()
        worker._loop.join(timeout=10)
        reply.close()
    assert len(warmed) > 10
    assert (True, False) in warmed and (True, True) in warmed  # the second pass also re-encodes pass 0's output
