"""A same-node shared-memory ring: one writer, `num_readers` readers, polled by the readers.

`ShmBroadcast` carries opaque byte messages (the msgpack plans and outputs of `wire.py`) between
processes of one host at a few microseconds plus a memcpy, instead of a Ray call or compiled-graph
hop. The same class serves both directions: the driver broadcasts each plan to every worker
(`num_readers = world size`) and each worker answers on its own channel (`num_readers = 1`).

Layout of the one `SharedMemory` segment (all fields are aligned little-endian u64 words):

    header      magic, num_readers, num_slots, slot_bytes, writer_closed, ...  (64 bytes)
    reader_closed[num_readers]                                                 (padded to 64)
    meta[num_slots]   seq, length, kind, aux, ack[num_readers]                 (each padded to 64)
    data[num_slots]   slot_bytes each

Protocol. Message k (k = 1, 2, ...) goes to slot (k - 1) % num_slots. The writer first waits until
every reader's ack in that slot equals the slot's previous sequence number (k - num_slots), i.e.
every reader has finished copying the old message out; then it writes the payload, its length and
kind, and writes `seq = k` LAST. A reader waits until its next slot's `seq` equals exactly the k it
expects, reads the payload, and only then stores `ack[reader] = k`. Readers therefore read in order
and never see a half-written or overwritten message, and a slow reader makes the writer block
rather than lose data. An ack holds a sequence number rather than a 0/1 flag so that nothing has
to be cleared before a slot is reused. Since the writer cannot pass a reader that has not acked, a
reader may attach after the first writes (it still gets message 1); each reader index attaches
once, there is one writer, and each object is used by one thread.

Memory ordering. On x86-64 (TSO) stores become visible in program order and loads are not
reordered with older loads, and CPython issues each u64 field access as one aligned 8-byte
load/store; that is all the publish (payload before seq) and consume (seq before payload, payload
before ack) orders need. On other architectures a lock acquire/release is used as a (best-effort)
fence before each publish and ack; the channel is only tested on x86-64.

Messages larger than a slot take the overflow path: the writer puts the payload in a separate
`SharedMemory` segment owned by that slot and writes the segment's name into the slot instead of
the payload (kind = overflow). The segment is kept and reused for later large messages in the same
slot (it is only replaced, by a bigger one, once every reader has acked the slot's previous
message), and readers keep their mapping of it, so a steady stream of 1 MB prefill plans costs a
memcpy, not a segment creation per pass. Overflow segments are rounded up to a power of two
(>= 1 MiB); tmpfs pages are only allocated where written. They are unlinked by the writer when
replaced and on `close()`.

Waiting (`WaitPolicy`). Every blocking `read`/`write` polls (with `sched_yield` between checks)
for `spin_s` after it starts and for as long as the channel saw a message less than `yield_s` ago
(a wake-up in microseconds, but a core stays busy: use it on GPU hosts with spare cores, not on a
2-core CI box), then sleeps with doubling intervals up to `max_sleep_s`, so an idle reader costs
~nothing. Every `check_s` while waiting the peer's close flags and the caller's `alive()` callback
are checked; a gone peer raises `ChannelClosed`, an expired `timeout` raises `TimeoutError`.

Closing. The creator (`ShmBroadcast.create`) unlinks the segment on `close()`; others
(`ShmBroadcast.attach`) only unmap it. Closing also sets a flag in the segment: readers drain the
messages already written and then get `ChannelClosed`; a writer blocked on a reader that closed
gets `ChannelClosed`. Mappings stay valid after an unlink, so the order of closes does not matter.

Python's resource tracker. A `SharedMemory(name)` that merely attaches registers the segment
with the attaching process's resource tracker, which unlinks it when that process exits (warning
about a "leaked" object): it destroys a segment it did not create. Checked here on 3.11.7, 3.12.1
(the GPU image's 3.12) and 3.13.0: all three do it. Python >= 3.13 has `SharedMemory(track=False)`,
used there. Before 3.13, attaching and then calling `resource_tracker.unregister` (the usual
workaround) is not safe when the tracker is shared, as it is between a `multiprocessing` parent
and its children: the registry is a set, so the child's unregister also drops the creator's entry,
and two readers attaching at once make the tracker raise KeyError.
So on < 3.13 readers map the segment themselves (`_Attached`: shm_open + mmap, what SharedMemory
does minus the registration). Only segments a process created are in its tracker, which still
unlinks them if that process dies without closing.

Use (driver side, sketch):

    plans = ShmBroadcast.create(num_readers=world)            # driver writes, workers read
    replies = [ShmBroadcast.create(num_readers=1, reader=0) for _ in range(world)]  # driver reads
    # ship plans.handle and replies[r].handle to worker r (small frozen dataclasses)
    # worker r: ShmBroadcast.attach(plan_handle, reader=r); ShmBroadcast.attach(reply_handle)

`python -m deltaserve.bench.shm_ring` times a round trip (driver -> 2 reader processes -> replies).
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

__all__ = ["ChannelClosed", "ShmBroadcast", "ShmHandle", "WaitPolicy", "process_alive"]

_MAGIC = 0x4453_5348_4D43_0001  # "DSSHMC" + layout version 1
_LINE = 64  # bytes; every region starts on its own cache line
_WORD = 8
# header words
_H_MAGIC, _H_READERS, _H_SLOTS, _H_SLOT_BYTES, _H_WRITER_CLOSED = range(5)
# per-slot meta words; the readers' acks follow
_M_SEQ, _M_LEN, _M_KIND, _M_AUX, _M_ACKS = range(5)
_KIND_INLINE, _KIND_OVERFLOW = 0, 1
_MIN_SLOT_BYTES = 256  # an overflow segment's name must fit in a slot
_MIN_OVERFLOW_BYTES = 1 << 20
_FIRST_SLEEP_S = 20e-6
# a waiting poller calls its `idle` hook (if any) at most this often, starting this long into the wait
IDLE_EVERY_S = 0.5e-3
Alive = Callable[[], bool] | None  # a check that the peer process still lives
Idle = Callable[[], None] | None  # work a poller does while it waits (keeps its next steps in cache)
_X86 = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})


class ChannelClosed(RuntimeError):
    """The peer closed the channel, its process is gone, or the segment no longer exists."""


@dataclass(frozen=True)
class ShmHandle:
    """What a process needs to attach to a channel: small and picklable (ship it to a Ray actor)."""

    name: str
    num_readers: int
    num_slots: int
    slot_bytes: int


@dataclass(frozen=True)
class WaitPolicy:
    """How a blocked read/write waits: poll, then sleep with growing intervals.

    Polling re-checks the slot between `sched_yield` calls, which give the CPU (and the GIL) to
    anything runnable: on an idle core that is a ~1 us busy loop, on an oversubscribed one it does
    not starve the peer the poller is waiting for (a pure spin measured 5-10x slower on 2 cores).
    The default suits a small CPU box (an idle reader is asleep after 0.1 ms and costs ~nothing, but
    wakes up to `max_sleep_s` late); on a GPU host with spare cores use `WaitPolicy(yield_s=1.0)`,
    which keeps polling between passes so a reader wakes within microseconds.
    """

    spin_s: float = 100e-6  # poll for this long after a wait starts
    yield_s: float = 0.0  # also poll while the channel's last message is younger than this
    max_sleep_s: float = 1e-3  # the sleep between polls doubles up to this
    check_s: float = 5e-3  # how often close flags and alive() are checked while waiting

    def __post_init__(self) -> None:
        for field in ("spin_s", "yield_s", "max_sleep_s", "check_s"):
            value = getattr(self, field)
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"WaitPolicy.{field} must be a finite number >= 0, got {value!r}")


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a dead child nobody has reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # no /proc at all (not Linux): trust kill(0)
    except OSError:
        return True
    # the state letter follows the command name, which is in parentheses and may contain spaces
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def _up(n: int) -> int:
    return -(-n // _LINE) * _LINE


def _layout(num_readers: int, num_slots: int, slot_bytes: int) -> tuple[int, int, int, int, int]:
    """Byte offsets: (reader_closed, meta, meta stride, data, total size)."""
    closed_off = _LINE
    meta_off = closed_off + _up(num_readers * _WORD)
    meta_stride = _up((_M_ACKS + num_readers) * _WORD)
    data_off = meta_off + num_slots * meta_stride
    return closed_off, meta_off, meta_stride, data_off, data_off + num_slots * _up(slot_bytes)


class _Attached:
    """A mapping of an existing segment that no resource tracker knows about (Python < 3.13)."""

    def __init__(self, name: str):
        import _posixshmem  # what SharedMemory itself opens segments with on POSIX

        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)  # the mapping keeps the memory; the descriptor is not needed
        self.name = name
        self.size = len(self._mmap)
        self.buf: memoryview | None = memoryview(self._mmap)

    def close(self) -> None:
        if self.buf is not None:
            self.buf.release()
            self.buf = None
            self._mmap.close()


def _attach_segment(name: str) -> SharedMemory | _Attached:
    """Map an existing segment without telling this process's resource tracker (which would unlink
    it when this process exits)."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    return _Attached(name)


def _unlink_segment(segment: SharedMemory) -> None:
    """Close and unlink a segment this process created."""
    segment.close()
    try:
        segment.unlink()
    except FileNotFoundError:  # someone else unlinked it: only our tracker's entry is left to drop
        resource_tracker.unregister("/" + segment.name, "shared_memory")


def _check_reader(reader: int | None, num_readers: int) -> None:
    if reader is not None and not 0 <= reader < num_readers:
        raise ValueError(f"reader must be None (the writer) or in [0, {num_readers}), got {reader}")


def _make_fence() -> Callable[[], None]:
    if platform.machine().lower() in _X86:
        return lambda: None  # TSO: stores and loads already stay in program order
    lock = threading.Lock()

    def fence() -> None:
        lock.acquire()  # best effort on weakly ordered CPUs: the mutex's barriers order our accesses
        lock.release()

    return fence


class ShmBroadcast:
    """One writer, `num_readers` readers, a ring of `num_slots` slots of `slot_bytes` in shared memory.

    Make one with `create` (the creator unlinks the segment on close) and attach from other
    processes with `attach(handle, reader=i)` or, for the writing side, `attach(handle)`. Each
    object is either the writer (`reader=None`) or reader `i`; the creator may be either.
    Not thread-safe: one thread per object.
    """

    def __init__(
        self, segment: SharedMemory | _Attached, handle: ShmHandle, reader: int | None, owner: bool, wait: WaitPolicy
    ):
        # use create() or attach()
        self._segment = segment
        self._handle = handle
        self._reader = reader
        self._owner = owner
        self.wait = wait
        self._closed = False
        self._next = 0  # messages written (writer) or read (reader) so far
        self._last_activity = time.perf_counter()
        self._fence = _make_fence()
        closed_off, meta_off, self._meta_stride, self._data_off, _ = _layout(
            handle.num_readers, handle.num_slots, handle.slot_bytes
        )
        self._closed_word = closed_off // _WORD
        self._meta_word = meta_off // _WORD
        self._meta_words = self._meta_stride // _WORD
        self._slot_stride = _up(handle.slot_bytes)
        self._buf: memoryview = segment.buf
        self._words: memoryview = segment.buf.cast("Q")
        # slot -> its overflow segment (the writer owns them; readers map them)
        self._overflow: dict[int, SharedMemory | _Attached] = {}
        self._overflow_gen = 0

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        num_readers: int,
        num_slots: int = 8,
        slot_bytes: int = 1 << 20,
        *,
        reader: int | None = None,
        wait: WaitPolicy | None = None,
    ) -> ShmBroadcast:
        """A new channel; this object is its writer, or reader `reader` when that is given."""
        if num_readers < 1:
            raise ValueError(f"num_readers must be >= 1, got {num_readers}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if slot_bytes < _MIN_SLOT_BYTES:
            raise ValueError(f"slot_bytes must be >= {_MIN_SLOT_BYTES}, got {slot_bytes}")
        _check_reader(reader, num_readers)
        size = _layout(num_readers, num_slots, slot_bytes)[4]
        segment = SharedMemory(name=f"dsc_{os.getpid()}_{secrets.token_hex(6)}", create=True, size=size)
        handle = ShmHandle(segment.name.lstrip("/"), num_readers, num_slots, slot_bytes)
        words = segment.buf.cast("Q")
        words[_H_READERS], words[_H_SLOTS], words[_H_SLOT_BYTES] = num_readers, num_slots, slot_bytes
        words[_H_MAGIC] = _MAGIC  # last: an attacher that sees the magic sees the geometry
        words.release()
        return cls(segment, handle, reader, True, wait or WaitPolicy())

    @classmethod
    def attach(cls, handle: ShmHandle, *, reader: int | None = None, wait: WaitPolicy | None = None) -> ShmBroadcast:
        """Join an existing channel as reader `reader`, or as its writer when `reader` is None."""
        _check_reader(reader, handle.num_readers)
        try:
            segment = _attach_segment(handle.name)
        except FileNotFoundError as e:
            raise ChannelClosed(f"shm channel {handle.name} does not exist (its creator closed it?)") from e
        words = segment.buf.cast("Q")
        try:
            found = (words[_H_MAGIC], words[_H_READERS], words[_H_SLOTS], words[_H_SLOT_BYTES])
        finally:
            words.release()
        if found != (_MAGIC, handle.num_readers, handle.num_slots, handle.slot_bytes):
            segment.close()
            raise ValueError(f"shm channel {handle.name}: segment header {found} does not match handle {handle}")
        return cls(segment, handle, reader, False, wait or WaitPolicy())

    def __reduce__(self):
        raise TypeError("a ShmBroadcast cannot be pickled; send its .handle and attach() on the other side")

    # ---- introspection -----------------------------------------------------------------------
    @property
    def handle(self) -> ShmHandle:
        return self._handle

    @property
    def name(self) -> str:
        return self._handle.name

    # ---- writer ------------------------------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview, timeout: float | None = None, alive: Alive = None) -> None:
        """Publish one message to every reader; blocks while its slot still holds an unread message.

        `alive()` (optional, checked every `wait.check_s`) returning False raises `ChannelClosed`.
        """
        self._check_usable(writer=True)
        payload = memoryview(data)
        if payload.format != "B" or payload.ndim != 1:
            payload = payload.cast("B")
        n = payload.nbytes
        seq = self._next + 1
        slot = self._next % self._handle.num_slots
        meta = self._meta_word + slot * self._meta_words
        previous = seq - self._handle.num_slots
        if previous > 0 and not self._slot_free(meta, previous):
            self._block(lambda: self._slot_free(meta, previous), timeout, alive, f"slot {slot} to be read by all")
        words, off = self._words, self._data_off + slot * self._slot_stride
        if n <= self._handle.slot_bytes:
            self._buf[off : off + n] = payload
            kind, aux = _KIND_INLINE, 0
        else:
            overflow = self._overflow_segment(slot, n)
            overflow.buf[:n] = payload
            name = overflow.name.encode()
            self._buf[off : off + len(name)] = name
            kind, aux = _KIND_OVERFLOW, len(name)
        words[meta + _M_LEN], words[meta + _M_KIND], words[meta + _M_AUX] = n, kind, aux
        self._fence()
        words[meta + _M_SEQ] = seq  # last: relies on TSO keeping the payload's stores before this one
        self._next = seq
        self._last_activity = time.perf_counter()

    def _slot_free(self, meta: int, previous: int) -> bool:
        words = self._words
        first = meta + _M_ACKS
        return all(words[i] == previous for i in range(first, first + self._handle.num_readers))

    def _overflow_segment(self, slot: int, n: int) -> SharedMemory:
        current = self._overflow.get(slot)
        if current is not None and current.size >= n:
            return current  # every reader acked this slot's last message, so reuse is safe
        size = max(_MIN_OVERFLOW_BYTES, 1 << (n - 1).bit_length())
        self._overflow_gen += 1
        fresh = SharedMemory(name=f"{self.name}_o{os.getpid()}_{slot}_{self._overflow_gen}", create=True, size=size)
        if current is not None:
            _unlink_segment(current)  # readers that still map it keep a valid mapping until they switch
        self._overflow[slot] = fresh
        return fresh

    # ---- reader ------------------------------------------------------------------------------
    def read(self, timeout: float | None = None, alive: Alive = None, idle: Idle = None) -> bytes:
        """The next message, in order; blocks until the writer has published it.

        Raises `ChannelClosed` once the writer closed and every message it wrote was read, or when
        `alive()` (optional, checked every `wait.check_s`) returns False; `TimeoutError` on timeout.
        `idle()` (optional) is called every IDLE_EVERY_S while polling (the caller's cache warm-up).
        """
        self._check_usable(writer=False)
        seq = self._next + 1
        meta = self._meta_word + (self._next % self._handle.num_slots) * self._meta_words
        words = self._words
        if words[meta + _M_SEQ] != seq:
            self._block(lambda: words[meta + _M_SEQ] == seq, timeout, alive, "a message", idle)
        return self._take(meta, seq)

    def try_read(self) -> bytes | None:
        """The next message if one is ready, else None (never blocks)."""
        self._check_usable(writer=False)
        seq = self._next + 1
        meta = self._meta_word + (self._next % self._handle.num_slots) * self._meta_words
        return self._take(meta, seq) if self._words[meta + _M_SEQ] == seq else None

    def pending(self) -> bool:
        """Whether `read` would return at once."""
        self._check_usable(writer=False)
        meta = self._meta_word + (self._next % self._handle.num_slots) * self._meta_words
        return self._words[meta + _M_SEQ] == self._next + 1

    def wait_pending_or(
        self, other: Callable[[], bool], timeout: float | None = None, alive: Alive = None, idle: Idle = None
    ) -> None:
        """Block, waiting as `read` does (this channel's WaitPolicy), until a message is pending or
        `other()` is true (a worker polls for the next plan and its pass's completion at once)."""
        self._check_usable(writer=False)
        if not (self.pending() or other()):
            self._block(lambda: self.pending() or other(), timeout, alive, "a message or the other event", idle)

    def _take(self, meta: int, seq: int) -> bytes:
        words = self._words
        n, kind, aux = words[meta + _M_LEN], words[meta + _M_KIND], words[meta + _M_AUX]
        slot = (seq - 1) % self._handle.num_slots
        off = self._data_off + slot * self._slot_stride
        if kind == _KIND_INLINE:
            out = bytes(self._buf[off : off + n])
        else:
            name = bytes(self._buf[off : off + aux]).decode()
            out = bytes(self._overflow_mapping(slot, name).buf[:n])
        self._fence()
        words[meta + _M_ACKS + self._reader] = seq  # after the copy: the writer may now reuse the slot
        self._next = seq
        self._last_activity = time.perf_counter()
        return out

    def _overflow_mapping(self, slot: int, name: str) -> SharedMemory | _Attached:
        current = self._overflow.get(slot)
        if current is not None and current.name.lstrip("/") == name:
            return current
        if current is not None:
            current.close()
        try:
            mapping = _attach_segment(name)
        except FileNotFoundError as e:
            raise ChannelClosed(f"shm channel {self.name}: overflow segment {name} is gone") from e
        self._overflow[slot] = mapping
        return mapping

    # ---- waiting -----------------------------------------------------------------------------
    def _block(
        self, ready: Callable[[], bool], timeout: float | None, alive: Alive, what: str, idle: Idle = None
    ) -> None:
        policy = self.wait
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        # poll for spin_s after the wait starts, and for as long as the last message is younger than yield_s
        poll_until = max(start + policy.spin_s, self._last_activity + policy.yield_s)
        next_check = start + policy.check_s
        next_idle = start + IDLE_EVERY_S if idle is not None else float("inf")
        sleep = _FIRST_SLEEP_S
        while True:
            if ready():
                return
            now = time.perf_counter()
            if now >= next_idle and now < poll_until:
                idle()
                next_idle = time.perf_counter() + IDLE_EVERY_S
                continue
            if now >= next_check:
                next_check = now + policy.check_s
                reason = self._peer_gone()
                if reason is None and alive is not None and not alive():
                    reason = "the peer process is not alive"
                if reason is not None:
                    if ready():  # published just before the peer went away: still deliver it
                        return
                    raise ChannelClosed(f"shm channel {self.name}: {reason} (waiting for {what})")
            if deadline is not None and now >= deadline:
                if ready():
                    return
                raise TimeoutError(f"shm channel {self.name}: no {what} within {timeout:.3g}s")
            if now < poll_until:
                _yield()
                continue
            time.sleep(sleep)
            sleep = min(sleep * 2, policy.max_sleep_s)

    def _peer_gone(self) -> str | None:
        words = self._words
        if self._reader is not None:
            return "the writer closed the channel" if words[_H_WRITER_CLOSED] else None
        for r in range(self._handle.num_readers):
            if words[self._closed_word + r]:
                return f"reader {r} closed the channel"
        return None

    # ---- closing -----------------------------------------------------------------------------
    def _check_usable(self, writer: bool) -> None:
        if self._closed:
            raise ChannelClosed(f"shm channel {self.name} is closed")
        if writer != (self._reader is None):
            role = "the writer" if self._reader is None else f"reader {self._reader}"
            raise RuntimeError(f"shm channel {self.name}: {role} cannot {'write' if writer else 'read'}")

    def close(self) -> None:
        """Tell the peers, unmap, and (the creator) unlink the segment; idempotent."""
        if self._closed:
            return
        self._closed = True
        words = self._words
        if self._reader is None:
            words[_H_WRITER_CLOSED] = 1
        else:
            words[self._closed_word + self._reader] = 1
        words.release()  # every view must go before the mapping can be closed
        self._buf = None
        for segment in self._overflow.values():
            if self._reader is None:
                _unlink_segment(segment)  # overflow segments belong to the writer
            else:
                segment.close()
        self._overflow.clear()
        if self._owner:
            _unlink_segment(self._segment)
        else:
            self._segment.close()

    def __enter__(self) -> ShmBroadcast:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # noqa: SIM105 (contextlib may already be torn down at interpreter shutdown)
            self.close()
        except Exception:
            pass


def _yield() -> None:
    # gives the GIL and the CPU to anything runnable (such as the peer we wait for), else returns at once
    if hasattr(os, "sched_yield"):
        os.sched_yield()
    else:
        time.sleep(0)
