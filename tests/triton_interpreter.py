"""Triton's CPU interpreter (TRITON_INTERPRET=1, how the suite runs Triton kernels without a GPU) without its one
redundant step: it patches `triton.language` for the interpreter on every call of a @triton.jit helper from inside
a kernel (InterpretedFunction.__call__ -> _patch_lang), though the kernel's launch (GridExecutor.__call__) patched
the same modules already and puts them back when it ends. That repatch scans every member of the language modules
and was a quarter of an interpreted attention test (tests/parity/test_attention_backends.py: 352 of 1527 samples).

Inside a launch, a helper whose language modules were patched in that launch already (by the launch, or by an
earlier helper: Triton's own tl.max and tl.sum see triton.language.core, which a kernel importing triton.language
does not) skips it. The repatch is a no-op there: it installs closures equal to those in place (each interpreted op
is a stateless wrapper of its builtin; builtins already wrapped are skipped) and is never undone (the launch's restore
undoes the launch's; a helper's first patch stays, as before). The first patch of each module in each launch runs as
before. Kernel outputs are bit-identical either way (tests/unit/test_triton_interpreter_patch.py)."""

from __future__ import annotations

import functools
import threading


def _langs(fn) -> set[int]:
    """ids of the language modules (triton.language, triton.language.core) visible to `fn`, as _patch_lang finds
    them."""
    import inspect

    import triton.language as tl

    return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}


def install() -> bool:
    """Wraps the interpreter's launch (GridExecutor.__call__) and its _patch_lang (once); False where that
    interpreter is not the one this was written against (then nothing changes)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original_patch = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    scope_class = getattr(interpreter, "_LangPatchScope", None)
    if None in (original_patch, executor, scope_class) or getattr(original_patch, "_once_per_launch", False):
        return False
    original_call = executor.__call__
    running = threading.local()  # .launches: per running launch of this thread, the modules patched in it so far

    def launches() -> list[set[int]]:
        if not hasattr(running, "launches"):
            running.launches = []
        return running.launches

    @functools.wraps(original_patch)
    def patch_lang(fn):
        if launches():
            patched, langs = launches()[-1], _langs(fn)
            if langs and langs <= patched:
                return scope_class()  # a helper inside the launch: patched already, nothing to restore
            patched |= langs  # the launch's own patch (its first call), or a helper's that sees more modules
        return original_patch(fn)

    @functools.wraps(original_call)
    def launch(self, *args, **kwargs):
        launches().append(set())
        try:
            return original_call(self, *args, **kwargs)
        finally:
            launches().pop()

    patch_lang._once_per_launch = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = launch
    return True
