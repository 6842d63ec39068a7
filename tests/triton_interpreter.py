"""Triton's interpreter (``TRITON_INTERPRET=1``, how the suite runs the kernels on CPU) without its repeated scans of
``triton.language``.

Each call of a ``@triton.jit`` helper from inside a kernel makes the interpreter patch ``triton.language``'s builtins
again (``interpreter._patch_lang``): ``inspect.getmembers`` over ``tl``, ``tl.tensor``, ``tl.math`` and
``tl.core.tensor_descriptor_base``, ~350 members, for builtins the kernel's own patch replaced already (the helper's
patch is never undone, so after the first one nothing is left to replace): about a fifth of an interpreted kernel's
time.

:func:`skip_scans_of_patched_packages` remembers which packages hold no builtin any more, and forgets one when a patch
scope restores any of its attributes, so the interpreter patches exactly what it patched before and computes the same
bits; only the scans that could find nothing are skipped. Triton 3.x's private names; another Triton leaves the
interpreter as it is.
"""

from __future__ import annotations


def skip_scans_of_patched_packages() -> bool:
    """Install the skip into ``triton.runtime.interpreter`` (once); False where its internals are not those of
    Triton 3.x (or Triton is missing), which are then left alone."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    scope = getattr(interpreter, "_LangPatchScope", None)
    patch_builtin = getattr(interpreter, "_patch_builtin", None)
    if scope is None or patch_builtin is None or not hasattr(scope, "restore"):
        return False
    if getattr(patch_builtin, "skips_patched_packages", False):
        return True

    patched: set = set()  # packages whose builtins were all replaced, and not restored since
    restore = scope.restore

    def patch_once(pkg, builder, patch_scope):
        if pkg in patched:
            return
        patch_builtin(pkg, builder, patch_scope)
        patched.add(pkg)

    def restore_and_forget(self):
        for obj, _name, _original in getattr(self, "_changes", ()):
            try:
                patched.discard(obj)
            except TypeError:  # an unhashable object is never a package remembered here
                pass
        restore(self)

    patch_once.skips_patched_packages = True
    interpreter._patch_builtin = patch_once
    scope.restore = restore_and_forget
    return True
