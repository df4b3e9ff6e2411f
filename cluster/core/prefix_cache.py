"""Prefix caching for hybrid models: KV pages by block hash, GDN state by snapshot, at any token offset.

KV: a full block of `block_size` tokens is identified by a hash chained over every token up to its end
(and the request's cache key: LoRA adapter, salt). Pages are reference-counted; a cached page nobody
holds stays findable until it is the least recently used one a new allocation needs.

GDN: attention can reuse any cached page, but a GDN layer's state is a running summary that exists
only where it was saved. A snapshot is every GDN layer's state (recurrent + conv window) after
position p, in a slot of the snapshot pool, keyed by (hash of the blocks before p's block, the tokens
from that block's start to p). A request resumes from the longest snapshot whose tokens it shares
and whose KV it can get: the pages of its matched full blocks, plus, when p falls inside the first
unmatched block, the snapshot's own copy of that partly filled page. It recomputes only the tokens
after p. Snapshots are taken (`CapturePolicy`) at intervals along prefills, at a prompt's last block
boundary and its end, where a prompt diverges from cached tokens (so the next request that shares
exactly that prefix hits all of it), and when a request finishes or is preempted.

This module keeps the index and the reference counts; the scheduler decides when to look up, capture
and save, and a pass's plan carries the copies and captures the workers perform.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

_HASH_BYTES = 16


def cache_key_of(adapter_key: str | None = None, cache_salt: str | None = None) -> str:
    """A request's cache key: what keeps its blocks and snapshots apart from other requests' (its
    adapter's key, its salt; "" for neither)."""
    keys = [adapter_key] if adapter_key is not None else []
    keys += ["salt:" + cache_salt] if cache_salt else []
    return "|".join(keys)


def root_hash(cache_key: str = "") -> bytes:
    """The chain's start for requests of one cache key (adapter, salt): different keys never share."""
    return hashlib.sha256(b"deltaserve-prefix\x00" + cache_key.encode()).digest()[:_HASH_BYTES]


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + np.asarray(tokens, dtype="<u4").tobytes()).digest()[:_HASH_BYTES]


@dataclass(frozen=True)
class CapturePolicy:
    """Where prefills and finished requests leave GDN snapshots."""

    interval: int = 1024  # every this many tokens along a prefill (0: never); a multiple of the block size
    prompt_end: bool = True  # the end of each prompt
    last_block: bool = True  # the last block boundary before a prompt's last token (exact resends)
    divergence: bool = True  # where a prompt stops matching cached tokens
    finish: bool = True  # a finished or preempted request's state (multi-turn: the next turn resends it)

    @classmethod
    def parse(cls, spec: str, interval: int) -> CapturePolicy:
        """From CacheConfig.prefix_snapshot_policy ('all', 'none' or a comma list of its points, already
        checked there) and prefix_snapshot_interval."""
        names = ("prompt_end", "last_block", "divergence", "finish", "interval")
        spec = spec.strip()
        if spec in ("all", "none", ""):
            chosen = set(names) if spec == "all" else set()
        else:
            chosen = {s.strip() for s in spec.split(",")}
        return cls(
            interval=interval if "interval" in chosen else 0,
            **{name: name in chosen for name in names if name != "interval"},
        )


@dataclass
class Snapshot:
    slot: int
    position: int
    key: tuple[bytes, tuple[int, ...]]
    tail_page: int | None  # the page holding tokens [block start, position), when position is mid-block


@dataclass
class CacheStats:
    queries: int = 0  # prompts looked up
    query_tokens: int = 0
    hit_tokens: int = 0  # tokens skipped (num_cached_tokens summed)
    hits: int = 0  # lookups that skipped at least one token
    snapshots_taken: int = 0
    snapshots_evicted: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass
class Hit:
    """What a lookup found: resume at `position` (tokens skipped) with these shared pages, the
    snapshot to restore, the page to copy for the partly filled block (if any), and where the
    request's tokens stop matching cached ones (`divergence`, for the divergence capture)."""

    position: int
    pages: list[int]
    snapshot: Snapshot | None
    copy_tail: bool
    divergence: int


class PageCache:
    """Reference counts and block hashes of the KV pages. Page `reserved` (the last) is scratch for
    padded rows and never handed out. Pages that only snapshots hold count as free: when nothing
    else is left, `reclaim` (set by the snapshot cache) evicts such a snapshot to release one."""

    def __init__(self, num_blocks: int, block_size: int, enabled: bool):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV pages, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.reserved = num_blocks - 1
        self.enabled = enabled
        self._free = list(range(num_blocks - 2, -1, -1))  # uncached, unreferenced; pop() hands out low pages first
        self._ref = [0] * num_blocks
        self._snap_ref = [0] * num_blocks  # the part of _ref that snapshots hold
        self._only_snapshots: set[int] = set()  # pages with references, all of them from snapshots
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        # parent hash -> {page: its tokens}: the cached blocks that continue a chain (divergence points)
        self._children: dict[bytes, dict[int, tuple[int, ...]]] = {}
        self._parent_of: dict[int, bytes] = {}
        self.reclaim = None  # () -> bool: release a page that only snapshots hold
        self.held_back = None  # () -> set[int]: pages of snapshots that may not be evicted now (pinned)
        # (True, hash) when a block becomes findable, (False, hash) when it is forgotten: for a router's
        # PrefixMirror in another process (None: nobody reads them)
        self.events: deque[tuple[bool, bytes]] | None = None

    @property
    def num_free(self) -> int:
        """Pages an allocation can have: free, cached and unreferenced, or held only by snapshots that
        may be evicted (not those `held_back` names: a plan's pinned snapshots keep theirs)."""
        only = self._only_snapshots
        held = self.held_back() if self.held_back is not None else ()
        return len(self._free) + len(self._evictable) + len(only) - sum(1 for page in held if page in only)

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    def allocate(self) -> int:
        while not self._free and not self._evictable and self._only_snapshots and self.reclaim is not None:
            if not self.reclaim():
                break
        if self._free:
            page = self._free.pop()
        elif self._evictable:
            page, _ = self._evictable.popitem(last=False)
            self._forget(page)
        else:
            raise RuntimeError("out of KV pages")
        self._ref[page] = 1
        return page

    def hold(self, page: int, by_snapshot: bool = False) -> None:
        if self._ref[page] == 0:
            self._evictable.pop(page, None)
        self._ref[page] += 1
        if by_snapshot:
            self._snap_ref[page] += 1
        self._update_only_snapshots(page)

    def hold_all(self, pages: Sequence[int]) -> None:
        """hold() for each page (a hit's shared pages: hundreds at once)."""
        ref, evictable, only = self._ref, self._evictable, self._only_snapshots
        for page in pages:
            if ref[page] == 0:
                evictable.pop(page, None)
            ref[page] += 1
            only.discard(page)  # a request holds it now

    def release(self, page: int, by_snapshot: bool = False) -> None:
        self._ref[page] -= 1
        if by_snapshot:
            self._snap_ref[page] -= 1
        self._update_only_snapshots(page)
        if self._ref[page] == 0:
            if page in self._hash_of:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def _update_only_snapshots(self, page: int) -> None:
        if self._ref[page] and self._ref[page] == self._snap_ref[page]:
            self._only_snapshots.add(page)
        else:
            self._only_snapshots.discard(page)

    def reclaimable(self, page: int) -> bool:
        return page in self._only_snapshots

    def counts_as_free(self, page: int) -> bool:
        """Whether holding this page takes one from num_free (nothing but snapshots hold it, none of
        them pinned)."""
        if self._ref[page] == 0:
            return True
        return page in self._only_snapshots and (self.held_back is None or page not in self.held_back())

    def _forget(self, page: int) -> None:
        h = self._hash_of.pop(page, None)
        if h is not None:
            self._page_of.pop(h, None)
            if self.events is not None:
                self.events.append((False, h))
            parent = self._parent_of.pop(page)
            children = self._children.get(parent)
            if children is not None:
                children.pop(page, None)
                if not children:
                    del self._children[parent]

    def register(self, page: int, parent: bytes, h: bytes, tokens: tuple[int, ...]) -> None:
        """Page `page` now holds the full block with hash h (computed in a pass already planned)."""
        if not self.enabled or h in self._page_of or page in self._hash_of:
            return
        self._page_of[h] = page
        self._hash_of[page] = h
        self._parent_of[page] = parent
        self._children.setdefault(parent, {})[page] = tokens
        if self.events is not None:
            self.events.append((True, h))

    def lookup(self, h: bytes) -> int | None:
        return self._page_of.get(h)

    def children(self, parent: bytes) -> dict[int, tuple[int, ...]]:
        return self._children.get(parent, {})

    def reset(self) -> int:
        """Forget every cached block: unreferenced ones become plain free pages, referenced ones keep
        their contents but are no longer findable. Returns how many were forgotten."""
        dropped = len(self._page_of)
        for page in list(self._evictable):
            self._forget(page)
            self._free.append(page)
        self._evictable.clear()
        for page in list(self._hash_of):
            self._forget(page)
        return dropped


class SnapshotCache:
    """GDN snapshot slots [first_slot, first_slot + count) and their index, least recently used first."""

    def __init__(self, first_slot: int, count: int, pages: PageCache):
        self.first_slot = first_slot
        self.count = count
        self.pages = pages
        self._free = list(range(first_slot + count - 1, first_slot - 1, -1))
        self._lru: OrderedDict[tuple[bytes, tuple[int, ...]], Snapshot] = OrderedDict()
        self._by_chain: dict[bytes, dict[tuple[int, ...], Snapshot]] = {}
        self.stats = CacheStats()
        # snapshots the plan being built restores or captures: never evicted (their slots never taken
        # again) before that plan is done
        self._pinned: dict[int, Snapshot] = {}  # by slot
        pages.reclaim = self._reclaim_page
        pages.held_back = self._pinned_tail_pages

    def pin(self, snap: Snapshot) -> None:
        self._pinned[snap.slot] = snap

    def unpin_all(self) -> None:
        self._pinned.clear()

    def _pinned_tail_pages(self) -> set[int]:
        return {s.tail_page for s in self._pinned.values() if s.tail_page is not None}

    def page_pinning_takes(self, snap: Snapshot | None) -> int:
        """1 when pinning `snap` would take a page that num_free counts now (its partly filled page,
        held by snapshots only, none of them pinned yet), else 0."""
        if snap is None or snap.slot in self._pinned or snap.tail_page is None:
            return 0
        page = snap.tail_page
        return int(self.pages.reclaimable(page) and page not in self._pinned_tail_pages())

    def _reclaim_page(self) -> bool:
        """Evict the least recently used snapshot whose partly filled page nothing else holds."""
        for key, snap in self._lru.items():
            if snap.slot in self._pinned:
                continue
            if snap.tail_page is not None and self.pages.reclaimable(snap.tail_page):
                del self._lru[key]
                self._drop(snap)
                self._free.append(snap.slot)
                self.stats.snapshots_evicted += 1
                return True
        return False

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, key: tuple[bytes, tuple[int, ...]]) -> Snapshot | None:
        return self._lru.get(key)

    def take(self, key: tuple[bytes, tuple[int, ...]], position: int, tail_page: int | None) -> Snapshot | None:
        """A slot for a new snapshot under `key` (evicting the least recently used one if none is
        free), holding `tail_page` until the snapshot goes; None when there are no snapshot slots."""
        if self.count == 0:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            old = next((s for s in self._lru.values() if s.slot not in self._pinned), None)
            if old is None:
                return None  # every snapshot is in use by the plan being built
            del self._lru[old.key]
            self._drop(old)
            self.stats.snapshots_evicted += 1
            slot = old.slot
        if tail_page is not None:
            self.pages.hold(tail_page, by_snapshot=True)
        snap = Snapshot(slot, position, key, tail_page)
        self._lru[key] = snap
        self._by_chain.setdefault(key[0], {})[key[1]] = snap
        self.stats.snapshots_taken += 1
        return snap

    def _drop(self, snap: Snapshot) -> None:
        chain = self._by_chain.get(snap.key[0])
        if chain is not None:
            chain.pop(snap.key[1], None)
            if not chain:
                del self._by_chain[snap.key[0]]
        if snap.tail_page is not None:
            self.pages.release(snap.tail_page, by_snapshot=True)

    def discard(self, snap: Snapshot) -> None:
        if self._lru.get(snap.key) is snap:
            del self._lru[snap.key]
            self._drop(snap)
            self._free.append(snap.slot)

    def touch(self, snap: Snapshot) -> None:
        if self._lru.get(snap.key) is snap:
            self._lru.move_to_end(snap.key)

    def at_chain(self, chain: bytes) -> dict[tuple[int, ...], Snapshot]:
        return self._by_chain.get(chain, {})

    def reset(self) -> int:
        dropped = len(self._lru)
        self._pinned.clear()
        for snap in self._lru.values():
            self._drop(snap)
            self._free.append(snap.slot)
        self._lru.clear()
        return dropped


@dataclass
class RequestHashes:
    """A request's chain: hashes[i] covers tokens [0, (i + 1) * block_size); root for position 0."""

    root: bytes
    hashes: list[bytes] = field(default_factory=list)
    registered: int = 0  # leading blocks already offered to the page index

    def extend(self, tokens: Sequence[int], block_size: int, upto: int) -> None:
        """Hash the full blocks among the first `upto` tokens (block_hash's bytes, one conversion)."""
        first, last = len(self.hashes), upto // block_size
        if last <= first:
            return
        data = np.asarray(tokens[first * block_size : last * block_size], dtype="<u4").tobytes()
        step = 4 * block_size
        parent = self.hashes[-1] if self.hashes else self.root
        for j in range(last - first):
            parent = hashlib.sha256(parent + data[j * step : (j + 1) * step]).digest()[:_HASH_BYTES]
            self.hashes.append(parent)

    def chain(self, blocks: int) -> bytes:
        """The hash of the first `blocks` blocks (the root for none)."""
        return self.hashes[blocks - 1] if blocks else self.root


class PrefixCache:
    """The index the scheduler consults: pages by block hash and GDN snapshots by position."""

    def __init__(self, pages: PageCache, snapshots: SnapshotCache, policy: CapturePolicy):
        self.pages = pages
        self.snapshots = snapshots
        self.policy = policy
        self.block_size = pages.block_size

    @property
    def enabled(self) -> bool:
        return self.pages.enabled and self.snapshots.count > 0

    @property
    def stats(self) -> CacheStats:
        return self.snapshots.stats

    def snapshot_key(
        self, hashes: RequestHashes, tokens: Sequence[int], position: int
    ) -> tuple[bytes, tuple[int, ...]]:
        block = position // self.block_size
        hashes.extend(tokens, self.block_size, position)
        tail = tokens[block * self.block_size : position]
        return hashes.chain(block), tuple(tail.tolist() if isinstance(tail, np.ndarray) else tail)

    def lookup(self, hashes: RequestHashes, tokens: Sequence[int]) -> Hit:
        """The best place for a request with these tokens to resume (at most the last token is left
        to compute). Position 0 (no hit) when no snapshot fits."""
        bs = self.block_size
        limit = len(tokens) - 1
        hashes.extend(tokens, bs, len(tokens))
        pages: list[int] = []
        for h in hashes.hashes[: limit // bs]:
            page = self.pages.lookup(h)
            if page is None:
                break
            pages.append(page)
        matched = len(pages)
        best: Snapshot | None = None
        for j in range(matched, -1, -1):
            for tail, snap in self.snapshots.at_chain(hashes.chain(j)).items():
                position = j * bs + len(tail)
                if position > limit or (best is not None and position <= best.position):
                    continue
                if tuple(tokens[j * bs : position]) != tail:
                    continue
                if j == matched and tail and snap.tail_page is None:
                    continue  # its partly filled block is neither cached nor kept with it
                best = snap
            if best is not None:
                break
        divergence = matched * bs + self._common_tail(hashes.chain(matched), tokens[matched * bs : matched * bs + bs])
        if best is None:
            return Hit(0, [], None, False, divergence)
        position = best.position
        copy_tail = position > matched * bs
        return Hit(position, pages, best, copy_tail, divergence)

    def _common_tail(self, chain: bytes, tokens: Sequence[int]) -> int:
        """The longest run of `tokens` that a cached block or snapshot continuing `chain` starts with."""
        best = 0
        candidates = list(self.pages.children(chain).values()) + list(self.snapshots.at_chain(chain))
        for cached in candidates:
            n = 0
            for a, b in zip(cached, tokens, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    def reset(self) -> tuple[int, int]:
        return self.pages.reset(), self.snapshots.reset()


def prompt_block_hashes(tokens: Sequence[int], block_size: int, cache_key: str = "") -> list[bytes]:
    """The chained hashes of the full blocks a lookup of this prompt can reuse (every full block before
    its last token: the last token is always computed)."""
    hashes = RequestHashes(root_hash(cache_key))
    hashes.extend(tokens, block_size, len(tokens) - 1)
    return hashes.hashes


class PrefixMirror:
    """Another process's copy of the block hashes one engine's page index holds, kept from that engine's
    events (`PageCache.events`), plus the blocks of prompts sent there since (`expect`: they are cached
    once prefilled, before their events arrive). `matched_blocks` says how many leading blocks of a prompt
    that engine holds. The GDN snapshot a hit also needs is taken on the same engine at those blocks'
    boundaries (prompt end, last block, divergence), so the page match is the router's measure."""

    def __init__(self, expect_s: float = 30.0):
        self.cached: set[bytes] = set()
        self.expected: OrderedDict[bytes, float] = OrderedDict()  # hash -> when it was routed here
        self.expect_s = expect_s

    def __len__(self) -> int:
        return len(self.cached)

    def apply(self, events: Iterable[tuple[bool, bytes]]) -> None:
        for added, h in events:
            if added:
                self.cached.add(h)
            else:
                self.cached.discard(h)
            self.expected.pop(h, None)

    def expect(self, hashes: Sequence[bytes], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for h in hashes:
            if h not in self.cached:
                self.expected[h] = now
                self.expected.move_to_end(h)

    def matched_blocks(self, hashes: Sequence[bytes], now: float | None = None) -> int:
        """Leading blocks of the chain `hashes` held (or expected) here."""
        now = time.monotonic() if now is None else now
        while self.expected and next(iter(self.expected.values())) < now - self.expect_s:
            self.expected.popitem(last=False)
        n = 0
        for h in hashes:
            if h not in self.cached and h not in self.expected:
                break
            n += 1
        return n
