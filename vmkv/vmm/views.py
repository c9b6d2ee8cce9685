"""Read-only views: the tensors a VMM cache hands its users (``kv``, ``kv_cache``, ``layer_storage``).

Why: an empty page is the read-only zero page, and a write there is a SIGSEGV no Python can
catch; a write into a mapped page would bypass copy-on-write and the prefix cache. So a
:class:`ReadOnlyView`, and any view of it, refuses in-place methods and operators, item assignment,
``out=``, schema-mutating ATen ops and NumPy writes with :class:`~vmkv.errors.Unsupported`; new
tensors computed from it are ordinary. Raw memory (``data_ptr()``, DLPack, :func:`unguarded`) is
not guarded. What the guard costs a call: docs/api.md.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch._C import DisableTorchFunctionSubclass

from ..errors import Unsupported

_IN_PLACE_OPERATORS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
})
_NUMPY_ALIASES = frozenset({"numpy", "__array__"})  # results over the same memory, made read-only


class ReadOnlyView(torch.Tensor):
    """A zero-copy tensor over a VMM cache's memory that refuses writes (module docstring); made by
    :func:`read_only`.
    """

    @classmethod
    def __torch_function__(cls, func: Callable, types: Iterable[type], args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if _writes_a_view(func, args, kwargs):
            name = getattr(func, "__name__", repr(func))
            raise Unsupported(
                f"{name}: this view of the KV cache is read-only (a write into a page that holds no data would "
                "crash the process, and any write would bypass copy-on-write and the prefix cache): write through "
                "cache.write() or write_batch(), or change a copy (view.clone())"
            )
        with DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
            if getattr(func, "__name__", "") in _NUMPY_ALIASES and isinstance(result, np.ndarray):
                result.flags.writeable = False
                return result
            return _wrap_aliases(result, _storages(args, kwargs))

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        """A deep copy is an ordinary tensor."""
        with DisableTorchFunctionSubclass():
            return self.clone()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled as an ordinary tensor: what is loaded is a copy."""
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def read_only(tensor: torch.Tensor) -> ReadOnlyView:
    """``tensor`` as a :class:`ReadOnlyView` (same memory, no copy)."""
    return tensor.as_subclass(ReadOnlyView)


def unguarded(view: torch.Tensor) -> torch.Tensor:
    """The plain tensor under a read-only view (same memory), for a hot loop; nothing refuses a write
    through it. Any other tensor is returned as is.
    """
    return view.as_subclass(torch.Tensor) if isinstance(view, ReadOnlyView) else view


def _writes_a_view(func: Callable, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether calling ``func(*args, **kwargs)`` would write into a :class:`ReadOnlyView`."""
    schema = getattr(func, "_schema", None)
    if schema is not None:  # an ATen operator: its schema marks the arguments it writes
        for position, argument in enumerate(schema.arguments):
            alias = argument.alias_info
            if alias is not None and alias.is_write:
                value = args[position] if position < len(args) else kwargs.get(argument.name)
                if _holds_view(value):
                    return True
        return False
    name = getattr(func, "__name__", "")
    in_place = name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.endswith("__")) or kwargs.get("inplace")
    if in_place and args and _holds_view(args[0]):  # a method's self, a function's first argument
        return True
    return _holds_view(kwargs.get("out"))


def _holds_view(value: Any) -> bool:
    """A :class:`ReadOnlyView`, or a list/tuple holding one (``out=(a, b)``, ``torch._foreach_*_``)."""
    if isinstance(value, ReadOnlyView):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(item, ReadOnlyView) for item in value)


def _storages(args: tuple, kwargs: dict[str, Any]) -> set[int]:
    """Addresses of the storages of the views among the arguments (a list or tuple one level deep)."""
    found: set[int] = set()
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, ReadOnlyView):
                found.add(item.untyped_storage().data_ptr())
    return found


def _wrap_aliases(result: Any, storages: set[int]) -> Any:
    """``result`` with every tensor over one of ``storages`` made read-only; new tensors stay ordinary."""
    if isinstance(result, torch.Tensor):
        if result.layout is torch.strided and result.untyped_storage().data_ptr() in storages:
            return result.as_subclass(ReadOnlyView)
        return result
    if isinstance(result, (list, tuple)):
        items = [_wrap_aliases(item, storages) for item in result]
        if any(new is not old for new, old in zip(items, result)):
            return type(result)(items)
    return result
