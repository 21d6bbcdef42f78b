"""`@eager_only` on a method: `torch.compiler.disable`, applied when torch._dynamo is imported.

`torch.compiler.disable` imports torch._dynamo (with sympy, FX and Triton: about a second of
CPU) in every process that imports the decorated class, though only a run that compiles needs
it. Nothing is compiled before torch._dynamo is imported, so a method disabled the moment that
import completes is disabled for every trace, exactly as if it had been decorated directly;
until then the class holds the plain function, which is what a disabled one runs in eager mode.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading

_DYNAMO = "torch._dynamo"
_lock = threading.Lock()
_pending: list[tuple[type, str]] = []  # methods to disable when torch._dynamo is imported


class eager_only:  # noqa: N801 (used as a decorator, like torch.compiler.disable)
    """Decorator for a method; the class ends up holding `torch.compiler.disable(method)`."""

    def __init__(self, fn):
        self.fn = fn

    def __set_name__(self, owner: type, name: str) -> None:
        setattr(owner, name, self.fn)  # a plain function in the class until dynamo exists
        with _lock:
            dynamo = sys.modules.get(_DYNAMO)
            if dynamo is None:
                _pending.append((owner, name))
                if not any(isinstance(f, _DisableAfterDynamoImport) for f in sys.meta_path):
                    sys.meta_path.insert(0, _DisableAfterDynamoImport())
                return
        setattr(owner, name, dynamo.disable(self.fn))


def _disable_pending(dynamo) -> None:
    with _lock:
        for owner, name in _pending:
            setattr(owner, name, dynamo.disable(owner.__dict__[name]))
        _pending.clear()


class _DisableAfterDynamoImport(importlib.abc.MetaPathFinder):
    """Finds torch._dynamo through the other finders and runs `_disable_pending` right after
    the module has executed, before anything can use it to compile."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            _disable_pending(module)

        spec.loader.exec_module = exec_module
        return spec
