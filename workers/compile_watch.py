"""Triton compiles after start-up, logged: a kernel compiled on first use in the middle of serving
stalls every running request for as long as the compile takes (seconds), which shows in TTFT and
ITL tails. Start-up warm-up (`warmup.py`) aims to compile every variant a server
meets; this names the ones it missed."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TypeVar

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable)

# runners of this process in their start-up: Triton's hooks are process-wide, so without this the log of
# a runner that started earlier (tests, notebooks: several engines in one process) would report the
# next one's warm-up and graph captures as first-use stalls
_starting = 0


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """While inside, Triton compiles are a runner's start-up (its warm-up, its graph captures): no
    LateCompileLog records or warns of them."""
    global _starting
    _starting += 1
    try:
        yield
    finally:
        _starting -= 1


def during_startup(method: F) -> F:
    """A runner method whose compiles are start-up compiles (`starting` around each call)."""

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with starting():
            return method(*args, **kwargs)

    return wrapped  # type: ignore[return-value]


class LateCompileLog:
    """Triton's JIT hooks (before and after each compile): each compile is logged as a warning with
    its kernel signature and how long it took, and kept in `events` (repr, seconds)."""

    def __init__(self, keep: int = 256):
        self.events: deque[tuple[str, float]] = deque(maxlen=keep)
        self._started: dict[str, float] = {}

    def before(self, *, key: str, **_) -> None:
        self._started[key] = time.perf_counter()
        return None  # a true value would tell Triton to skip the compile

    def after(self, *, key: str, repr: str, **_) -> None:
        took = time.perf_counter() - self._started.pop(key, time.perf_counter())
        if _starting:  # a runner's start-up (`starting`): not a first-use stall
            return
        self.events.append((repr, took))
        # one line: the kernel, its launch options, and the specialisation key (argument types and
        # the integer properties Triton specialises on), which says what the warm-up did not cover
        text = " ".join(f"{repr} key={key}".split())
        log.warning("Triton compiled a kernel after start-up in %.2f s (a first-use stall): %s", took, text[:3000])

    def install(self) -> None:
        """Hook this log into Triton (process-wide: the last runner to start holds the hooks, and no
        runner's start-up is logged, `starting`)."""
        import triton

        triton.knobs.runtime.jit_cache_hook = self.before
        triton.knobs.runtime.jit_post_compile_hook = self.after
