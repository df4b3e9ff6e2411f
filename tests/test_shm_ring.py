"""The shared-memory channel: order and content across slot sizes and ring wraps, back-pressure from
a slow reader, timeouts and dead peers, closing without leaks, and writer + reader processes."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import pickle
import random
import subprocess
import sys
import threading
import time

import pytest

from deltaserve.workers.shm_ring import (
    IDLE_EVERY_S,
    ChannelClosed,
    ShmBroadcast,
    ShmHandle,
    WaitPolicy,
    process_alive,
)

SLOT = 1024
FAST = WaitPolicy(check_s=1e-3)  # notice dead peers quickly in tests


def shm_names(prefix: str) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def message(i: int, slot_bytes: int = SLOT) -> bytes:
    """Message i: deterministic content; sizes cover empty, around a slot, and several slots."""
    sizes = [0, 1, slot_bytes - 1, slot_bytes, slot_bytes + 1, 3 * slot_bytes + 7, 37, 500]
    n = sizes[i % len(sizes)] if i % 5 else random.Random(i).randrange(0, 5 * slot_bytes)
    return random.Random(i * 7919).randbytes(n)


@pytest.fixture
def channel():
    """A writer and its two readers in this process."""
    writer = ShmBroadcast.create(2, num_slots=4, slot_bytes=SLOT, wait=FAST)
    readers = [ShmBroadcast.attach(writer.handle, reader=r, wait=FAST) for r in range(2)]
    yield writer, readers
    for ch in (*readers, writer):
        ch.close()


# ---- one process --------------------------------------------------------------------------------
def test_round_trip_sizes_and_buffer_types(channel):
    writer, readers = channel
    big = os.urandom(10 * SLOT)
    sent = [b"", b"a", os.urandom(SLOT), os.urandom(SLOT + 1), big, bytearray(b"xyz"), memoryview(big)[5:2000]]
    for m in sent:
        writer.write(m)
        for r in readers:
            assert r.pending()
            got = r.read(timeout=1)
            assert type(got) is bytes and got == bytes(m)
            assert not r.pending()


def test_non_byte_memoryview_is_sent_as_its_bytes(channel):
    writer, readers = channel
    data = memoryview(bytes(range(16))).cast("I")  # four u32s
    writer.write(data)
    assert readers[0].read(timeout=1) == bytes(range(16))


def test_ring_wraps_many_times_in_order(channel):
    writer, readers = channel
    received = [(r, []) for r in readers]
    sent = 0
    for burst in range(250):  # up to a full ring ahead each time, ~250 wraps
        for _ in range(1 + burst % 4):
            writer.write(message(sent))
            sent += 1
        for got in received:
            while got[0].pending():
                got[1].append(got[0].read(timeout=1))
    assert sent > 250 * 2
    for _, messages in received:
        assert messages == [message(i) for i in range(sent)]


def test_full_ring_blocks_writer_until_every_reader_read(channel):
    writer, (r0, r1) = channel
    for i in range(4):
        writer.write(message(i))
    with pytest.raises(TimeoutError, match="slot 0"):
        writer.write(b"fifth", timeout=0.02)
    assert r0.read(timeout=1) == message(0)
    with pytest.raises(TimeoutError):  # reader 1 has not read slot 0 yet
        writer.write(b"fifth", timeout=0.02)
    assert r1.read(timeout=1) == message(0)
    writer.write(b"fifth", timeout=0.02)
    for r in (r0, r1):  # nothing was overwritten
        assert [r.read(timeout=1) for _ in range(4)] == [message(1), message(2), message(3), b"fifth"]


def test_read_timeout_and_try_read(channel):
    _, (r0, _) = channel
    assert r0.try_read() is None
    started = time.perf_counter()
    with pytest.raises(TimeoutError, match="no a message within"):
        r0.read(timeout=0.05)
    assert 0.05 <= time.perf_counter() - started < 1


def test_alive_false_raises_channel_closed(channel):
    writer, (r0, _) = channel
    with pytest.raises(ChannelClosed, match="not alive"):
        r0.read(timeout=5, alive=lambda: False)
    for i in range(4):
        writer.write(message(i))
    started = time.perf_counter()
    with pytest.raises(ChannelClosed, match="not alive"):
        writer.write(b"x", timeout=5, alive=lambda: False)
    assert time.perf_counter() - started < 1


def test_writer_close_lets_readers_drain_then_raises(channel):
    writer, (r0, r1) = channel
    writer.write(b"last words")
    writer.close()
    for r in (r0, r1):
        assert r.read(timeout=1) == b"last words"
        with pytest.raises(ChannelClosed, match="writer closed"):
            r.read(timeout=5)


def test_reader_close_fails_a_blocked_writer(channel):
    writer, (r0, r1) = channel
    for i in range(4):
        writer.write(message(i))
    r0.read(timeout=1)
    r1.close()
    with pytest.raises(ChannelClosed, match="reader 1 closed"):
        writer.write(b"x", timeout=5)
    with pytest.raises(ChannelClosed, match="is closed"):
        r1.read()


def test_roles_are_enforced(channel):
    writer, (r0, _) = channel
    with pytest.raises(RuntimeError, match="cannot read"):
        writer.read(timeout=0)
    with pytest.raises(RuntimeError, match="cannot write"):
        r0.write(b"x")
    with pytest.raises(ValueError, match="reader must be"):
        ShmBroadcast.attach(writer.handle, reader=2)
    with pytest.raises(ValueError, match="does not match"):
        ShmBroadcast.attach(ShmHandle(writer.name, 3, 4, SLOT), reader=0)


def test_handle_pickles_small_and_channel_does_not(channel):
    writer, _ = channel
    blob = pickle.dumps(writer.handle)
    assert len(blob) < 200 and pickle.loads(blob) == writer.handle
    with pytest.raises(TypeError, match="handle"):
        pickle.dumps(writer)


def test_close_unlinks_segment_and_overflow_segments():
    writer = ShmBroadcast.create(1, num_slots=2, slot_bytes=SLOT)
    reader = ShmBroadcast.attach(writer.handle, reader=0)
    for n in (3 * SLOT, 5 * SLOT, (1 << 20) + 1, 10):  # the last large one replaces slot 0's overflow segment
        writer.write(bytes(n))
        assert reader.read(timeout=1) == bytes(n)
    assert len(shm_names(writer.name)) == 3  # the ring and one overflow segment per slot
    reader.close()
    assert len(shm_names(writer.name)) == 3  # a reader's close only unmaps
    writer.close()
    assert shm_names(writer.name) == set()
    with pytest.raises(ChannelClosed, match="does not exist"):
        ShmBroadcast.attach(writer.handle, reader=0)
    writer.close()  # idempotent


def test_creator_can_be_the_reader():
    """The reply direction: the driver creates the channel and reads; the worker attaches and writes."""
    inbox = ShmBroadcast.create(1, num_slots=2, slot_bytes=SLOT, reader=0)
    outbox = ShmBroadcast.attach(inbox.handle)
    for i in range(20):
        outbox.write(message(i))
        assert inbox.read(timeout=1) == message(i)
    outbox.close()  # the writer's overflow segments go with it; the ring stays for the creator
    assert shm_names(inbox.name) == {inbox.name}
    inbox.close()
    assert shm_names(inbox.name) == set()


def test_process_alive():
    assert process_alive(os.getpid())
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    child.start()
    deadline = time.monotonic() + 30
    while process_alive(child.pid) and time.monotonic() < deadline:  # exited but not reaped: a zombie
        time.sleep(0.01)
    assert not process_alive(child.pid)
    child.join()
    assert not process_alive(child.pid)


# ---- separate processes -------------------------------------------------------------------------
def _reader_proc(plan: ShmHandle, reply: ShmHandle, rank: int, count: int, mode: str, slow_s: float) -> None:
    """Reads `count` messages checking each against message(i); 'lockstep' answers each with its
    digest, 'stream' answers once at the end with a digest of all (so the writer runs ahead)."""
    plans = ShmBroadcast.attach(plan, reader=rank, wait=FAST)
    replies = ShmBroadcast.attach(reply, wait=FAST)
    total = hashlib.sha256()
    for i in range(count):
        if slow_s and i < 40:
            time.sleep(slow_s)
        got = plans.read(timeout=30)
        ok = got == message(i, plan.slot_bytes)
        if mode == "lockstep":
            replies.write(b"%d %d " % (i, ok) + hashlib.sha256(got).digest(), timeout=30)
        total.update(b"%d" % ok + got)
    if mode == "stream":
        replies.write(total.digest(), timeout=30)
    plans.close()
    replies.close()


def _run_readers(count: int, mode: str, slow: tuple[float, float] = (0.0, 0.0)) -> None:
    ctx = multiprocessing.get_context("spawn")
    plans = ShmBroadcast.create(2, num_slots=4, slot_bytes=SLOT, wait=FAST)
    replies = [ShmBroadcast.create(1, num_slots=4, slot_bytes=SLOT, reader=0, wait=FAST) for _ in range(2)]
    procs = [
        ctx.Process(target=_reader_proc, args=(plans.handle, replies[r].handle, r, count, mode, slow[r]))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    alive = lambda: all(process_alive(p.pid) for p in procs)
    expected = hashlib.sha256()
    try:
        for i in range(count):
            plans.write(message(i), timeout=30, alive=alive)
            expected.update(b"1" + message(i))
            if mode == "lockstep":
                for ch in replies:
                    assert ch.read(timeout=30, alive=alive) == b"%d 1 " % i + hashlib.sha256(message(i)).digest()
        if mode == "stream":
            for ch in replies:
                assert ch.read(timeout=30, alive=alive) == expected.digest()
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        names = [plans.name] + [ch.name for ch in replies]
        for ch in (plans, *replies):
            ch.close()
    for name in names:
        assert shm_names(name) == set()


def test_two_reader_processes_lockstep():
    _run_readers(300, "lockstep")


def test_two_reader_processes_streaming_writer_runs_ahead():
    _run_readers(400, "stream")


def test_slow_reader_blocks_the_writer_instead_of_losing_messages():
    started = time.perf_counter()
    _run_readers(100, "stream", slow=(0.0, 0.005))  # reader 1 lags 5 ms on each of its first 40 reads
    assert time.perf_counter() - started >= 40 * 0.005


def _attach_and_exit(handle: ShmHandle) -> None:
    reader = ShmBroadcast.attach(handle, reader=0)
    os._exit(0 if reader else 1)  # no close (a dropped object would close itself): the reader simply dies


def test_dead_reader_process_fails_the_writer():
    ctx = multiprocessing.get_context("spawn")
    writer = ShmBroadcast.create(1, num_slots=2, slot_bytes=SLOT, wait=FAST)
    child = ctx.Process(target=_attach_and_exit, args=(writer.handle,))
    child.start()
    try:
        writer.write(b"a")
        writer.write(b"b")
        with pytest.raises(ChannelClosed, match="not alive"):  # the child is a zombie now: not alive either
            writer.write(b"c", timeout=30, alive=lambda: process_alive(child.pid))
    finally:
        child.join(timeout=30)
        writer.close()


def test_attaching_process_exit_does_not_unlink_the_segment():
    """Python < 3.13's resource tracker would unlink a segment that an exiting process only attached."""
    writer = ShmBroadcast.create(1, num_slots=2, slot_bytes=SLOT)
    code = (
        "import sys\n"
        "from deltaserve.workers.shm_ring import ShmBroadcast, ShmHandle\n"
        f"r = ShmBroadcast.attach(ShmHandle(*{tuple(vars(writer.handle).values())!r}), reader=0)\n"
        "assert r.read(timeout=30) == b'x' * 5000\n"  # overflow: maps a second segment too
    )
    try:
        writer.write(b"x" * 5000)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "leaked" not in done.stderr and "resource_tracker" not in done.stderr, done.stderr
        time.sleep(0.2)  # the child's tracker exits after the child
        assert len(shm_names(writer.name)) == 2  # ring and overflow segment both still there
    finally:
        writer.close()
    assert shm_names(writer.name) == set()


def test_wait_policy_rejects_bad_values():
    with pytest.raises(ValueError, match="max_sleep_s"):
        WaitPolicy(max_sleep_s=-1)
    with pytest.raises(ValueError, match="yield_s"):
        WaitPolicy(yield_s=float("nan"))


def test_polling_policy_round_trips(channel):
    """yield_s keeps a waiter polling after recent traffic; a wait still ends on its timeout."""
    writer, readers = channel
    polling = WaitPolicy(yield_s=1.0, check_s=1e-3)
    for ch in (writer, *readers):
        ch.wait = polling
    for i in range(50):
        writer.write(message(i))
        assert [r.read(timeout=1) for r in readers] == [message(i)] * 2
    with pytest.raises(TimeoutError):
        readers[0].read(timeout=0.02)


def test_idle_hook_runs_while_polling_and_the_message_still_arrives(channel):
    """A polling reader calls its idle hook (the codec warm-up) every IDLE_EVERY_S or so while it
    waits, never once the message is there; a sleeping reader (no recent traffic) does not call it."""
    writer, readers = channel
    for ch in (writer, *readers):
        ch.wait = WaitPolicy(yield_s=1.0, check_s=1e-3)
    writer.write(b"recent traffic")
    readers[0].read(timeout=1)
    calls = []
    timer = threading.Timer(0.02, writer.write, args=(b"late",))
    timer.start()
    started = time.perf_counter()
    try:
        assert readers[0].read(timeout=5, idle=lambda: calls.append(time.perf_counter())) == b"late"
    finally:
        timer.join()
    waited = time.perf_counter() - started
    assert 3 <= len(calls) <= waited / IDLE_EVERY_S + 1
    assert all(b - a >= IDLE_EVERY_S for a, b in zip(calls, calls[1:], strict=False))
    readers[0].wait = WaitPolicy(spin_s=0.0, yield_s=0.0)  # sleeps at once: no idle work
    readers[0]._last_activity = 0.0
    before = len(calls)
    timer = threading.Timer(0.01, writer.write, args=(b"slept",))
    timer.start()
    try:
        assert readers[0].read(timeout=5, idle=lambda: calls.append(-2.0)) == b"slept"
    finally:
        timer.join()
    assert len(calls) == before
