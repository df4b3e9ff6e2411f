"""The shared-memory ring's round trip (driver -> reader processes -> replies) and its in-process
cost: `python -m deltaserve.bench.shm_ring`."""

from __future__ import annotations

import multiprocessing
import os
import platform
import statistics
import struct
import time

from deltaserve.workers.shm_ring import ShmBroadcast, ShmHandle, WaitPolicy, process_alive


def _bench_reader(plan: ShmHandle, reply: ShmHandle, rank: int, wait: WaitPolicy, forward_s: float) -> None:
    """A stand-in worker: reads plans, 'runs' for forward_s, replies (rank 0: 256 B; others: 8 B)."""
    plans = ShmBroadcast.attach(plan, reader=rank, wait=wait)
    replies = ShmBroadcast.attach(reply, wait=wait)
    try:
        while True:
            blob = plans.read(timeout=60)
            if blob[:1] == b"q":
                return
            started = time.perf_counter()
            if forward_s:
                time.sleep(forward_s)  # a GPU forward: the CPU waits (its overshoot is counted as forward)
            forward = struct.pack("<d", time.perf_counter() - started)
            replies.write(forward + bytes(248) if rank == 0 else forward, timeout=60)
    finally:
        plans.close()
        replies.close()


def benchmark(
    size: int, iters: int, wait: WaitPolicy, readers: int = 2, forward_s: float = 0.0, gap_s: float = 0.0
) -> tuple[float, float]:
    """(median, p99) microseconds of driver write -> `readers` processes read -> all replies read,
    minus rank 0's own 'forward' time (the executor's control overhead)."""
    ctx = multiprocessing.get_context("spawn")
    plans = ShmBroadcast.create(readers, num_slots=8, slot_bytes=max(size, 4096), wait=wait)
    replies = [ShmBroadcast.create(1, num_slots=4, slot_bytes=4096, reader=0, wait=wait) for _ in range(readers)]
    procs = [
        ctx.Process(target=_bench_reader, args=(plans.handle, replies[r].handle, r, wait, forward_s), daemon=True)
        for r in range(readers)
    ]
    for p in procs:
        p.start()
    alive = lambda: all(process_alive(p.pid) for p in procs)
    message = b"p" + os.urandom(size - 1)
    times = []
    try:
        for i in range(iters + 50):
            if gap_s:
                time.sleep(gap_s)  # the driver's own work between passes: readers drift into their backoff
            started = time.perf_counter()
            plans.write(message, timeout=60, alive=alive)
            outs = [ch.read(timeout=60, alive=alive) for ch in replies]
            elapsed = time.perf_counter() - started - struct.unpack("<d", outs[0][:8])[0]
            if i >= 50:  # the first passes include the readers' start-up
                times.append(elapsed * 1e6)
        plans.write(b"q", timeout=60, alive=alive)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        plans.close()
        for ch in replies:
            ch.close()
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.99))]


def in_process_cost(size: int, iters: int = 5000) -> float:
    """Median microseconds of one write + 2 reads + 2 one-reader replies in one process: the
    channel's own CPU cost, without any cross-process wake-up or scheduling."""
    plans = ShmBroadcast.create(2, num_slots=8, slot_bytes=max(size, 4096))
    readers = [ShmBroadcast.attach(plans.handle, reader=r) for r in range(2)]
    replies = [ShmBroadcast.create(1, num_slots=4, slot_bytes=4096, reader=0) for _ in range(2)]
    repliers = [ShmBroadcast.attach(ch.handle) for ch in replies]
    message, answer, times = os.urandom(size), bytes(256), []
    for _ in range(iters):
        started = time.perf_counter()
        plans.write(message)
        for r, out, back in zip(readers, repliers, replies, strict=True):
            r.read()
            out.write(answer)
            back.read()
        times.append((time.perf_counter() - started) * 1e6)
    for ch in (*readers, *repliers, plans, *replies):
        ch.close()
    return statistics.median(times)


def main() -> None:
    gentle, busy = WaitPolicy(), WaitPolicy(yield_s=1.0)
    print(f"host: {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.machine()}")
    for size in (4 << 10, 256 << 10):
        print(
            f"in-process cost of a round (write, 2 reads, 2 replies), {size >> 10} KiB: {in_process_cost(size):.1f} us"
        )
    print("round trip driver -> 2 reader processes -> replies, control overhead in microseconds")
    cases = [
        ("back-to-back", gentle, 0.0, 0.0, 2000),
        ("back-to-back", busy, 0.0, 0.0, 2000),
        ("2 ms forward + 0.5 ms gap", gentle, 2e-3, 5e-4, 500),
        ("2 ms forward + 0.5 ms gap", busy, 2e-3, 5e-4, 500),
    ]
    for label, wait, forward_s, gap_s, iters in cases:
        for size in (4 << 10, 256 << 10):
            med, p99 = benchmark(size, iters, wait, forward_s=forward_s, gap_s=gap_s)
            policy = "yield_s=1" if wait.yield_s else "default"
            print(f"  {label:26s} {policy:9s} {size >> 10:4d} KiB: median {med:8.1f} us   p99 {p99:8.1f} us")


if __name__ == "__main__":
    main()
