"""The Triton runtime every kernel of ours goes through: the guarded import, whether kernels can
run here, and the decorator matching the mode triton was imported in.

Triton is imported guarded: this module (and every kernel module) imports fine without it;
:func:`triton_available` says why not. Kernels are decorated on first use, through
:func:`jit_decorator`. On CPU tensors they run under the Triton interpreter, which needs
``TRITON_INTERPRET=1`` set before triton is first imported in the process.
"""
from __future__ import annotations

import functools
import os

import torch

try:  # guarded: the module must import where triton is absent
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: str | None = None
except Exception as _e:  # noqa: BLE001  # pragma: no cover - any import failure means "no triton"
    triton = None
    tl = None
    TRITON_IMPORT_ERROR = f"{type(_e).__name__}: {_e}"

__all__ = ["KernelTable", "TRITON_INTERPRETED", "available_on", "interpreted", "jit_decorator", "kernels_usable",
           "pow2", "tl", "triton", "triton_available", "triton_available_cached", "usable_on"]


def _env_interpret() -> bool:
    """TRITON_INTERPRET as triton reads it (at call time)."""
    if triton is not None:
        knobs = getattr(triton, "knobs", None)
        if knobs is not None:
            return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _detect_imported_mode() -> bool | None:
    """Was triton imported in interpreter mode?  (None if triton is absent.)

    triton decorates its own standard library (tl.zeros, tl.cdiv, ...) when ``triton`` is first
    imported, according to TRITON_INTERPRET at that moment; a kernel can only run in that same
    mode, so this, not the variable's current value, decides how our kernels are built.
    """
    if triton is None:
        return None
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        std = getattr(tl, "standard", None)
        fn = getattr(std, "zeros", None) or getattr(std, "cdiv", None)
        if isinstance(fn, InterpretedFunction):
            return True
        if isinstance(fn, JITFunction):
            return False
    except ImportError:  # pragma: no cover - layout of another triton version
        return _env_interpret()
    return _env_interpret()


TRITON_INTERPRETED = _detect_imported_mode()


def interpreted() -> bool:
    """Kernels run under the Triton interpreter (CPU tensors): no launch options (warps, stages),
    numpy's math instead of libdevice's."""
    return bool(TRITON_INTERPRETED)


def pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two >= max(n, lo): a tile extent (tl.arange needs powers of two)."""
    p = lo
    while p < n:
        p *= 2
    return p


def triton_available() -> tuple[bool, str]:
    """(usable, reason): triton importable and either a CUDA device or TRITON_INTERPRET=1.

    TRITON_INTERPRET=1 must be set before ``triton`` is first imported in the process.
    """
    if triton is None:
        return False, f"triton is not importable ({TRITON_IMPORT_ERROR})"
    if TRITON_INTERPRETED:
        return True, f"triton {triton.__version__} in interpreter mode (TRITON_INTERPRET=1)"
    if _env_interpret():
        return False, (
            "TRITON_INTERPRET=1 was set after triton had been imported in compiled mode; the "
            "interpreter needs it set before the first `import triton` (use a fresh process)"
        )
    if torch.cuda.is_available():
        return True, f"triton {triton.__version__} with CUDA device {torch.cuda.get_device_name()}"
    return False, (
        f"triton {triton.__version__} is importable but no CUDA device is present "
        "(set TRITON_INTERPRET=1 before importing triton to run on CPU tensors via the interpreter)"
    )


@functools.lru_cache(maxsize=1)
def triton_available_cached() -> tuple[bool, str]:
    return triton_available()


def require_launchable(what: str, t: torch.Tensor) -> None:
    """Raise a clear error unless ``what``'s Triton kernel can run on ``t``: triton importable with
    a CUDA device, and ``t`` on CUDA (or on the CPU under the interpreter)."""
    ok, why = triton_available_cached()
    if not ok:
        raise RuntimeError(f"{what} needs triton: {why}")
    if t.device.type != "cuda" and not TRITON_INTERPRETED:
        raise ValueError(f"{what}: the input is on {t.device}, the compiled kernel needs CUDA tensors "
                         "(or TRITON_INTERPRET=1 before triton is imported, for CPU tensors)")


def usable_on(device: torch.device) -> bool:
    """Our Triton kernels can run on tensors of ``device`` (CUDA, or CPU under the interpreter)."""
    if triton is None:
        return False
    if TRITON_INTERPRETED:
        return device.type == "cpu"
    return device.type == "cuda"


def kernels_usable(t: torch.Tensor) -> bool:
    """Our Triton kernels can run on t's device."""
    return usable_on(t.device)


def available_on(device: torch.device) -> tuple[bool, str]:
    """(present, reason) of a Triton-kernel backend on a runner's device: a CUDA device and a
    working triton (attention backends' ``available``)."""
    if device.type != "cuda":
        return False, f"Triton kernels need a CUDA device, have {device.type}"
    return triton_available()


class KernelTable:
    """One module's raw kernel functions, each decorated on first use (:func:`jit_decorator`), so
    importing the module costs nothing and works without triton. ``raw``: a function returning
    name -> raw kernel (called only once a kernel is asked for: the raw functions exist only
    where triton imported).

    ``helpers``: likewise, the raw device functions the kernels call (``_load_tile`` inside a
    kernel). A kernel resolves a call by name in its globals, and Triton only lowers calls to
    decorated functions; so the kernels and helpers are rebuilt over one private namespace (the
    module's globals with the helpers decorated) instead of rebinding the module's own names."""

    def __init__(self, raw, helpers=None):
        self._raw, self._helpers, self._made = raw, helpers, {}
        self._namespace: dict | None = None

    def _rebuilt(self, fn):
        """``fn`` over the private namespace, when there are helpers (else ``fn`` itself)."""
        if self._helpers is None:
            return fn
        if self._namespace is None:
            raw_helpers = self._helpers()
            ns = dict(next(iter(raw_helpers.values())).__globals__)
            deco = jit_decorator()
            for name, h in raw_helpers.items():
                ns[name] = deco(_with_globals(h, ns))
            self._namespace = ns
        return _with_globals(fn, self._namespace)

    def __getitem__(self, name: str):
        if name not in self._made:
            self._made[name] = jit_decorator()(self._rebuilt(self._raw()[name]))
        return self._made[name]


def _with_globals(fn, namespace: dict):
    """A copy of function ``fn`` whose global names resolve in ``namespace``."""
    import types
    out = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__qualname__, out.__doc__, out.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    out.__kwdefaults__, out.__annotations__ = fn.__kwdefaults__, dict(getattr(fn, "__annotations__", {}))
    out.__wrapped__ = fn
    return out


def _interpreter_numpy_compat() -> None:
    """Make triton's interpreter work with numpy >= 2.4 (interpret mode only).

    The interpreter keeps scalars as 1-element arrays and converts them with
    ``int(ndarray)`` for ``range(start, runtime_bound, step)``; numpy 2.4 made that a
    TypeError.  This wraps the interpreter's tensor patching so ``__index__`` takes the single
    element explicitly.  No-op where numpy still accepts it, or when already applied.
    """
    import numpy as np

    try:
        int(np.array([1]))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter as _interp

    orig = getattr(_interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_fdx_numpy_compat", False):
        return

    def _index(self):
        data = self.handle.data
        return int(data.reshape(-1)[0]) if getattr(data, "size", 0) == 1 else int(data)

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)

    patched._fdx_numpy_compat = True
    _interp._patch_lang_tensor = patched


def jit_decorator():
    """The triton decorator matching the mode triton was imported in (JIT compiled, or the
    interpreter under TRITON_INTERPRET=1); every Triton module of ours decorates through it."""
    if TRITON_INTERPRETED:
        from triton.runtime.interpreter import InterpretedFunction

        _interpreter_numpy_compat()
        return InterpretedFunction
    from triton.runtime.jit import JITFunction
    return JITFunction
