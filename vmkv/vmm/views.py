"""Read-only views: the tensors a VMM cache hands its users (``kv``, ``kv_cache``, ``layer_storage``).

Why read-only: a VMM tensor lies over a reserved range whose empty pages are the backend's shared,
read-only zero page. Reading there gives zeros; *writing* there is a SIGSEGV on the host (an
illegal address on CUDA, which poisons the context), which no Python code can catch. And the
pages under a view come and go: a view kept past ``free``, ``trim`` or ``close`` reads zeros, and
a write into it would fault the same way. Even a write into a mapped page is wrong: it bypasses
copy-on-write (a forked sequence shares the page) and the prefix cache. So a user's view refuses
every write with :class:`~vmkv.errors.Unsupported`; the cache writes through ``write`` and
``write_batch`` only, on the plain tensors underneath, and its kernels read those.

What a :class:`ReadOnlyView` refuses, for a view or any view of it (``view[0]``,
``view.transpose(0, 1)``, ``view.detach()`` are read-only views too):

* in-place methods and functions (``zero_``, ``copy_``, ``index_copy_``, ``torch.nn.init.zeros_``,
  ``torch._foreach_add_``, ``relu(..., inplace=True)``), in-place operators (``+=``), item
  assignment (``view[i] = x``), ``out=`` a view, and ATen operators whose schema writes an
  argument (``torch.ops.aten.fill_.Scalar``);
* writes through NumPy: ``view.numpy()`` and ``numpy.asarray(view)`` are read-only arrays.

Results that are new tensors (``view + 1``, ``view.clone()``, ``view.to(torch.float16)``,
``copy.deepcopy(view)``, a pickled and loaded view) are ordinary tensors, the user's to change.

What it does not see: raw memory a user takes on purpose (``data_ptr()``, ``untyped_storage()``,
DLPack, ``view.as_subclass(torch.Tensor)`` or :func:`unguarded`); a write through those is the
user's own, and into an empty page it still faults.

Cost: every torch call on a view passes through :meth:`ReadOnlyView.__torch_function__`, about
5 us more a call on a 2-core host (``view[3]`` 1 -> 6 us, ``view.sum()`` 2 -> 6 us); making a
view is one ``as_subclass`` (~1 us). The cache's own writes, its kernels and the transformers
adapter's per-step views (``write_batch``) use the plain tensors and pay nothing.
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
    """A zero-copy tensor over a VMM cache's memory that refuses writes (see the module docstring).

    Make one with :func:`read_only`; read it like any tensor.
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
        """A deep copy is a new tensor: an ordinary one (``torch.Tensor.__deepcopy__`` would want
        ``new_empty`` to return this class)."""
        with DisableTorchFunctionSubclass():
            return self.clone()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save``, a multiprocessing queue) as an ordinary tensor: what is loaded
        is a copy, the loader's to change."""
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def read_only(tensor: torch.Tensor) -> ReadOnlyView:
    """``tensor`` as a :class:`ReadOnlyView` (same memory, no copy)."""
    return tensor.as_subclass(ReadOnlyView)


def unguarded(view: torch.Tensor) -> torch.Tensor:
    """The plain tensor under a read-only view (same memory, no copy), for code that reads it in a
    hot loop (a kernel benchmark). Nothing refuses a write through it: a write into a page that
    holds no data is a SIGSEGV. Any other tensor is returned as is."""
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
    """``result`` with every tensor over one of ``storages`` (a view of a view) made read-only;
    new tensors stay ordinary."""
    if isinstance(result, torch.Tensor):
        if result.layout is torch.strided and result.untyped_storage().data_ptr() in storages:
            return result.as_subclass(ReadOnlyView)
        return result
    if isinstance(result, (list, tuple)):
        items = [_wrap_aliases(item, storages) for item in result]
        if any(new is not old for new, old in zip(items, result)):
            return type(result)(items)
    return result
