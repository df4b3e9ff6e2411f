"""Triton's CPU interpreter, made cheaper for the kernel tests without changing what it computes.

The interpreter patches `triton.language` (every builtin wrapped, `inspect.getmembers` over the
modules) when a kernel launches, and again on every call of a `@triton.jit` helper inside the
running kernel, although the launch's patches are still in place; for kernels with helpers in
their loops that re-patching is about a third of the test's time. `install()` makes a helper's call
skip it while a launch of the same language modules is running. Any interpreter without these
internals is left as it is.
"""

from __future__ import annotations

import inspect


def install() -> bool:
    """Patch the interpreter in this process; returns whether it was patched."""
    try:
        from triton.runtime import interpreter as it
    except ImportError:
        return False
    original = getattr(it, "_patch_lang", None)
    scope_type = getattr(it, "_LangPatchScope", None)
    if original is None or scope_type is None or getattr(original, "_deltaserve_skips_nested", False):
        return False
    import triton.language as tl

    active: list[frozenset[int]] = []  # the language modules the running launch patched

    def langs(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        mine = langs(fn)
        if active:  # a helper's call inside a running launch (the interpreter never restores its scope)
            return scope_type() if mine <= active[-1] else original(fn)
        scope = original(fn)  # a launch: its scope is restored when the launch ends
        active.append(mine)
        restore = scope.restore

        def restore_and_pop() -> None:
            if active:
                active.pop()
            restore()

        scope.restore = restore_and_pop
        return scope

    patch_lang._deltaserve_skips_nested = True
    it._patch_lang = patch_lang
    return True
