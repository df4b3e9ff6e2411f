"""Triton's CPU interpreter, made cheaper for the kernel tests without changing what it computes.

The interpreter patches `triton.language` (every builtin wrapped, `inspect.getmembers` over the
modules) when a kernel launches, and again on every call of a `@triton.jit` helper inside the
running kernel (`tl.sum`, `tl.zeros`, the kernels' own helpers), although the launch's patches are
still in place; for kernels with helpers in their loops that re-patching is about a third of the
test's time. `install()` patches each language module once per launch: a helper whose modules the
launch (or an earlier helper of it) patched skips it, and what a helper patched is undone with the
launch's own patches when the launch ends (the interpreter itself never undoes a helper's). Any
interpreter without these internals is left as it is.
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
    if original is None or scope_type is None or getattr(original, "_deltaserve_once_per_launch", False):
        return False
    import triton.language as tl

    # the running launch: the language modules patched so far, and its helpers' scopes
    launch: dict = {}

    def langs(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        mine = langs(fn)
        if launch:  # a helper's call inside the running launch
            if mine <= launch["patched"]:
                return scope_type()
            scope = original(fn)
            launch["patched"] |= mine
            launch["helpers"].append(scope)
            return scope
        scope = original(fn)  # a launch: its scope is restored when the launch ends
        launch.update(patched=set(mine), helpers=[])
        restore = scope.restore

        def restore_all() -> None:
            helpers = launch.get("helpers", [])
            launch.clear()
            for helper in reversed(helpers):
                helper.restore()
            restore()

        scope.restore = restore_all
        return scope

    patch_lang._deltaserve_once_per_launch = True
    it._patch_lang = patch_lang
    return True
