"""CUDA backend: GPU virtual memory through the CUDA driver's VMM API (``cuda.bindings.driver``).

* physical pages: the whole store is created at open, one ``cuMemCreate`` handle per page
  (``cuMemMap`` maps a handle from offset 0 only, so a handle cannot hold several pages), plus
  one more handle: the **zero page**. New device memory holds whatever was there before, so all
  of them are zeroed once at open: mapped side by side into a scratch range, ``cuMemsetD8``,
  ``cuCtxSynchronize``, unmapped. The hot path never allocates; ``release_page`` is a no-op.
  With ``on_demand=True`` (a cache in a shared budget) only the zero page is created at open:
  :meth:`CudaVirtualMemory.provision` creates and zeroes a batch of pages at once (the cache
  calls it when the ledger grants a batch, off the per-page path), ``map`` creates a page not
  provisioned yet, and ``release_page`` gives an unmapped page's handle back to the driver.
* reserve: ``cuMemAddressReserve``, then the zero page is mapped at every page of the range and
  the whole range is made read-only for this device (``cuMemSetAccess`` with
  ``CU_MEM_ACCESS_FLAGS_PROT_READ``). Reads anywhere in a reservation see zeros; a kernel that
  writes there faults (illegal address), so no kernel may write outside mapped pages. (A device
  that refuses read-only mappings gets read-write zero pages and a warning at open.)
* map: ``cuMemUnmap`` of the zero page, ``cuMemMap`` of the data page, ``cuMemSetAccess``
  read-write. Mapping one handle at several addresses shares it.
* unmap: ``cuMemUnmap`` of the data page, then the zero page goes back (map + read access).
* Both leave the address with nothing mapped for a moment, so the caller synchronizes first
  (:meth:`CudaVirtualMemory.synchronize`), as ``VirtualKVCache`` does before every map and
  unmap: a running kernel reading the address then (padded kernels read zeros past a
  sequence's length) would take an illegal-address fault that kills the CUDA context.
* tensors: an object exposing ``__cuda_array_interface__`` handed to ``torch.as_tensor``; the
  tensor holds that object, which holds the reservation.

Memory picture of one reservation::

    | page 7 (rw) | page 2 (rw) | zero (ro) | zero (ro) | ... zero (ro) ... |
      one handle per page        the one zero handle, mapped at every empty page

Lifetime: a reservation lives while the backend or a tensor over it does. ``close()`` puts the
zero page back wherever data was mapped and releases every handle (``cuMemRelease`` of a
handle that is still mapped frees its memory once the last mapping goes), so views read zeros
after ``close()``; the last tensor over a reservation unmaps it and frees the address range.

Failures: a driver call that fails inside ``reserve``/``map``/``unmap`` is undone (the zero
page or the data page is mapped back), so the backend is left as it was, and
:class:`~vmkv.errors.BackendError` names the call and the ``CUresult``. Only if the undo fails
too is a page left with nothing mapped (reads there would fault); the error says so. ``close()``
never raises: it gives back everything the driver will take and logs what it would not.

Contexts: every call runs in PyTorch's primary context of the device. torch initialises it,
the backend retains it (``cuDevicePrimaryCtxRetain`` returns the same context, it never
creates another; each reservation holds its own retain so it can be freed after ``close()``)
and pushes it only on threads where it is not current (e.g. a map-ahead thread), so torch's
own notion of the current device is never changed.

What the backend needs from torch (is CUDA there, which device, make its context, wrap a
device pointer in a tensor) goes through one small object, :class:`TorchCudaRuntime`; the test
suite substitutes it (its torch is CPU-only) while every driver call stays real. A missing
cuda-bindings package, driver or GPU raises one :class:`~vmkv.errors.BackendUnavailable`
("CUDA driver not available: ...").
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ..errors import BackendError, BackendUnavailable, InvalidConfig
from ..extras import install_hint
from ..validate import is_int, positive_int
from .base import VirtualMemory

_UNAVAILABLE = "CUDA driver not available: "
log = logging.getLogger("vmkv")


class TorchCudaRuntime:
    """What the backend needs from PyTorch's CUDA runtime, in one place.

    The driver calls never go through here: only the questions torch answers (is a GPU
    visible, which device is current, make the primary context) and the wrapping of device
    memory in a tensor. Tests without a GPU pass a substitute with the same methods.
    """

    def unavailable_reason(self) -> str | None:
        """Why torch cannot use CUDA here, or ``None`` when it can."""
        if torch.cuda.is_available():
            return None
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"torch {torch.__version__} ({build}) sees no CUDA GPU"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def activate(self, index: int) -> None:
        """Make torch create (or find) the primary context of device ``index``."""
        torch.cuda.synchronize(index)

    def device_name(self, index: int) -> str:
        return torch.cuda.get_device_name(index)

    def as_tensor(self, obj: Any, device: torch.device) -> torch.Tensor:
        """A uint8 tensor over the memory ``obj.__cuda_array_interface__`` describes (no copy);
        the tensor keeps ``obj`` alive."""
        return torch.as_tensor(obj, device=device)


def _driver_for(device: torch.device | str | int, runtime: TorchCudaRuntime) -> tuple[Any, int]:
    """Import cuda-bindings and initialise the driver inside torch's primary context.

    Returns:
        ``(driver module, device ordinal)``.

    Raises:
        BackendUnavailable: no GPU/driver visible to torch, cuda-bindings missing, the driver
            refuses to initialise, or the device cannot do virtual memory management.
        InvalidConfig: ``device`` is not a CUDA device or does not exist.
    """
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise InvalidConfig(f"the CUDA backend needs a cuda device, got {device}")
    reason = runtime.unavailable_reason()
    if reason is not None:
        raise BackendUnavailable(f"{_UNAVAILABLE}{reason}")
    index = runtime.current_device() if device.index is None else device.index
    count = runtime.device_count()
    if not 0 <= index < count:
        raise InvalidConfig(f"device cuda:{index} does not exist; {count} CUDA device(s) are visible")
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise BackendUnavailable(
            f"{_UNAVAILABLE}cannot import cuda.bindings.driver ({exc}); install it with {install_hint('cuda')}"
        ) from None
    try:
        runtime.activate(index)
    except RuntimeError as exc:  # torch could not initialise CUDA on that device
        raise BackendUnavailable(f"{_UNAVAILABLE}torch could not initialise cuda:{index}: {exc}") from None
    try:
        (result,) = driver.cuInit(0)
    except Exception as exc:  # cuda-bindings raises its own loader errors when libcuda is missing
        raise BackendUnavailable(f"{_UNAVAILABLE}cuInit failed: {exc}") from None
    if result != driver.CUresult.CUDA_SUCCESS:
        raise BackendUnavailable(f"{_UNAVAILABLE}cuInit returned {_error_name(result)}")
    try:
        ordinal = int(_check(driver, driver.cuDeviceGet(index), "cuDeviceGet"))
        attribute = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        supported = _check(driver, driver.cuDeviceGetAttribute(attribute, ordinal), "cuDeviceGetAttribute")
    except BackendError as exc:
        raise BackendUnavailable(f"{_UNAVAILABLE}{exc}") from None
    if not supported:
        raise BackendUnavailable(
            f"{_UNAVAILABLE}{runtime.device_name(index)} (cuda:{index}) does not support "
            "virtual memory management (cuMemMap)"
        )
    return driver, ordinal


def _error_name(result: Any) -> str:
    return getattr(result, "name", None) or f"CUresult {int(result)}"


def _check(driver: Any, returned: tuple, call: str) -> Any:
    """Raise ``BackendError`` unless ``returned[0]`` is ``CUDA_SUCCESS``; return the rest.

    Returns:
        ``None`` for calls that return only a status, the value for one result, else a tuple.
    """
    result, *values = returned
    if result != driver.CUresult.CUDA_SUCCESS:
        raise BackendError(f"{call} failed: {_error_name(result)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _allocation_prop(driver: Any, ordinal: int) -> Any:
    """``CUmemAllocationProp`` of plain (pinned, unshared) device memory on device ``ordinal``."""
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    return prop


def _granularity(driver: Any, ordinal: int) -> int:
    flag = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    prop = _allocation_prop(driver, ordinal)
    return int(_check(driver, driver.cuMemGetAllocationGranularity(prop, flag), "cuMemGetAllocationGranularity"))


def cuda_granularity(device: torch.device | str | int, *, runtime: TorchCudaRuntime | None = None) -> int:
    """The smallest mappable page on ``device``, in bytes (``cuMemGetAllocationGranularity``,
    minimum granularity; 2 MiB on current NVIDIA GPUs).

    Args:
        device: a CUDA device.
        runtime: torch's side of CUDA (tests substitute it); default :class:`TorchCudaRuntime`.

    Raises:
        BackendUnavailable: no GPU, driver or cuda-bindings here.
    """
    driver, ordinal = _driver_for(device, runtime or TorchCudaRuntime())
    try:
        return _granularity(driver, ordinal)
    except BackendError as exc:
        raise BackendUnavailable(f"{_UNAVAILABLE}{exc}") from None


def cuda_memory_info(device: torch.device | str | int, *, runtime: TorchCudaRuntime | None = None) -> tuple[int, int]:
    """``(free, total)`` bytes of device memory as the driver counts them (``cuMemGetInfo`` in
    torch's primary context of ``device``; what ``torch.cuda.mem_get_info`` reads). Device-wide:
    other processes' memory is in it too.

    Args:
        device: a CUDA device.
        runtime: torch's side of CUDA (tests substitute it); default :class:`TorchCudaRuntime`.

    Raises:
        BackendUnavailable: no GPU, driver or cuda-bindings here, or the driver refused.
    """
    driver, ordinal = _driver_for(device, runtime or TorchCudaRuntime())
    context = _Context(driver, ordinal)
    try:
        context.retain()
        try:
            with context.current():
                free, total = context.call(driver.cuMemGetInfo(), "cuMemGetInfo")
        finally:
            errors: list[str] = []
            context.release(errors)
    except BackendError as exc:
        raise BackendUnavailable(f"{_UNAVAILABLE}{exc}") from None
    return int(free), int(total)


def _summary(errors: list[str], shown: int = 3) -> str:
    """The first few failures and how many more (close can fail a call per page)."""
    more = f"; and {len(errors) - shown} more" if len(errors) > shown else ""
    return "; ".join(errors[:shown]) + more


class _Context:
    """The driver module, one device and its primary context: checked calls, made current."""

    def __init__(self, driver: Any, ordinal: int) -> None:
        self.driver, self.ordinal = driver, ordinal
        self.ctx: Any = None

    def call(self, returned: tuple, what: str) -> Any:
        return _check(self.driver, returned, what)

    def attempt(self, returned: tuple, what: str, errors: list[str]) -> None:
        """Like :meth:`call`, but a failure is appended to ``errors`` instead of raised."""
        try:
            self.call(returned, what)
        except BackendError as exc:
            errors.append(str(exc))

    def retain(self) -> None:
        """One more reference to the primary context (each holder releases its own)."""
        self.ctx = self.call(self.driver.cuDevicePrimaryCtxRetain(self.ordinal), "cuDevicePrimaryCtxRetain")

    def release(self, errors: list[str]) -> None:
        self.attempt(self.driver.cuDevicePrimaryCtxRelease(self.ordinal), "cuDevicePrimaryCtxRelease", errors)

    @contextmanager
    def current(self, *, cleanup: bool = False) -> Iterator[None]:
        """Run the body with the primary context current, pushing it only if it is not.

        Args:
            cleanup: if asking for the current context fails, push ours anyway (a cleanup
                path gives back what it can rather than nothing).

        Raises:
            BackendError: the context could not be made current (the body did not run).
        """
        try:
            current = self.call(self.driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        except BackendError:
            if not cleanup:
                raise
            current = None
        if current is not None and int(current) == int(self.ctx):
            yield
            return
        self.call(self.driver.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:  # the body's work is done (or undone): a failed pop must not turn it into an error
            popped: list[str] = []
            self.attempt(self.driver.cuCtxPopCurrent(), "cuCtxPopCurrent", popped)
            if popped:
                log.warning("CUDA backend: %s (the context stays pushed on this thread)", popped[0])


class _Reservation:
    """One reserved device range and what is mapped at each of its pages.

    A page address is in ``data`` (a store page is mapped there, read-write), in ``holes``
    (nothing is mapped: only while a reservation is built, or after a failed undo), or else
    holds the zero page. The object frees itself (unmap all, ``cuMemAddressFree``, release its
    context reference) when the backend and every tensor over it have let go of it.
    """

    def __init__(self, context: _Context, nbytes: int, page_size: int, alignment: int) -> None:
        self.context, self.nbytes, self.page_size = context, nbytes, page_size
        self.freed = True  # until the range exists
        context.retain()
        try:
            ptr = context.call(context.driver.cuMemAddressReserve(nbytes, alignment, 0, 0), f"cuMemAddressReserve ({nbytes} B)")
        except BackendError:
            context.release([])
            raise
        self.addr = int(ptr)
        self.freed = False
        self.data: dict[int, int] = {}
        self.holes: set[int] = set(self.pages())

    def pages(self) -> range:
        return range(self.addr, self.addr + self.nbytes, self.page_size)

    def free(self) -> list[str]:
        """Unmap everything, free the range, release the context reference. Total: returns the
        failures instead of raising. Idempotent."""
        if self.freed:
            return []
        self.freed = True
        errors: list[str] = []
        driver = self.context.driver
        try:
            with self.context.current(cleanup=True):
                self.context.attempt(driver.cuCtxSynchronize(), "cuCtxSynchronize", errors)  # no kernel reads it now
                for addr in self.pages():
                    if addr not in self.holes:
                        self.context.attempt(driver.cuMemUnmap(addr, self.page_size), f"cuMemUnmap at {addr:#x}", errors)
                self.context.attempt(driver.cuMemAddressFree(self.addr, self.nbytes),
                                     f"cuMemAddressFree at {self.addr:#x}", errors)
        except BackendError as exc:  # the context could not be made current: nothing could be given back
            errors.append(str(exc))
        self.context.release(errors)
        return errors

    def __del__(self) -> None:
        try:
            errors = self.free()
        except Exception:  # interpreter shutdown: the driver module may be gone already
            return
        if errors:
            log.warning("CUDA backend: freeing the reservation at %#x: %s", self.addr, _summary(errors))


class _DeviceBytes:
    """``nbytes`` bytes of device memory at ``addr``, as a ``__cuda_array_interface__`` (v2).

    Exposed as uint8 so every dtype (bfloat16 has no array-interface type string) is a
    ``.view`` of it. Holds the reservation: a tensor over it keeps the range alive.
    """

    def __init__(self, addr: int, nbytes: int, reservation: _Reservation) -> None:
        self.reservation = reservation
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "strides": None,
            "version": 2,
        }


class CudaVirtualMemory(VirtualMemory):
    """CUDA driver virtual memory over a preallocated store of physical pages (see the module
    docstring).

    Args:
        page_size: bytes of one page: a multiple of :func:`cuda_granularity`.
        num_pages: pages in the store, all created now (``(num_pages + 1) * page_size`` bytes of
            GPU memory are taken at once: the extra page is the zero page), unless ``on_demand``.
        device: the CUDA device (``"cuda"`` means torch's current device).
        runtime: torch's side of CUDA (tests substitute it); default :class:`TorchCudaRuntime`.
        on_demand: create only the zero page now; pages are created by :meth:`provision` (or a
            ``map``) and given back by :meth:`release_page`.

    Attributes:
        zero_page_read_only: empty pages are mapped read-only (a write there faults); ``False``
            only on a device that refuses read-only mappings (logged at open).

    Raises:
        BackendUnavailable: no GPU, driver or cuda-bindings here.
        InvalidConfig: bad page size or page count.
        BackendError: the driver refused to create or zero the pages (e.g. out of GPU memory);
            everything created so far is given back first.
    """

    name = "cuda"

    def __init__(self, page_size: int, num_pages: int, *, device: torch.device | str | int = "cuda",
                 runtime: TorchCudaRuntime | None = None, on_demand: bool = False) -> None:
        self._handles: list[int | None] = []  # None: not created (on demand), no memory behind it
        self._maps: Counter[int] = Counter()  # page -> addresses it is mapped at
        self.on_demand = on_demand
        self._zero: int | None = None
        self._reservations: dict[int, _Reservation] = {}
        self._bases: list[int] = []  # sorted reservation addresses, to find the one holding an address
        self._retained = False
        self._closed = False
        self._runtime = runtime or TorchCudaRuntime()
        driver, ordinal = _driver_for(device, self._runtime)
        self._context = _Context(driver, ordinal)
        self.device = torch.device("cuda", ordinal)
        self.granularity = _granularity(driver, ordinal)
        if not is_int(page_size, 1) or page_size % self.granularity:
            raise InvalidConfig(f"cuda page_size must be a positive multiple of {self.granularity} B, got {page_size!r}")
        positive_int("num_pages", num_pages)
        self.page_size = page_size
        self.num_pages = num_pages
        self._prop = _allocation_prop(driver, ordinal)
        self._read, self._read_write = (self._access(flag) for flag in ("PROT_READ", "PROT_READWRITE"))
        self._empty_access = self._read
        self.zero_page_read_only = True  # False where the device refuses read-only mappings
        try:
            self._context.retain()
            self._retained = True
            with self._context.current():
                self._zero = self._create("cuMemCreate (zero page)")
                for page in range(num_pages):
                    self._handles.append(None if on_demand else self._create(f"cuMemCreate (page {page} of {num_pages})"))
                self._zero_store()
        except BaseException as exc:
            self.close()
            if isinstance(exc, BackendError) and "OUT_OF_MEMORY" in str(exc):
                raise BackendError(
                    f"{exc}: a store of {num_pages} x {page_size} B does not fit in free GPU memory; lower memory_budget"
                ) from None
            raise

    # ---- driver plumbing -------------------------------------------------------------------
    def _access(self, flag: str) -> list[Any]:
        driver = self._context.driver
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self._context.ordinal
        access.flags = getattr(driver.CUmemAccess_flags, f"CU_MEM_ACCESS_FLAGS_{flag}")
        return [access]

    def _call(self, returned: tuple, what: str) -> Any:
        return self._context.call(returned, what)

    def _create(self, what: str) -> int:
        return int(self._call(self._context.driver.cuMemCreate(self.page_size, self._prop, 0), what))

    def _zero_store(self) -> None:
        """Zero every page created at open, then probe whether empty pages can be read-only."""
        self._zero_handles([self._zero, *(h for h in self._handles if h is not None)], probe=True)

    def _zero_handles(self, handles: list[int], *, probe: bool = False) -> None:
        """Zero new pages once: cuMemCreate memory holds stale bytes (NaN patterns, say, which
        a masked read times a zero weight still turns into NaN). The handles are mapped side by
        side into a scratch range, set to 0 with one ``cuMemsetD8``, then unmapped.

        Raises:
            BackendError: a driver call failed (the scratch range is given back first).
        """
        driver = self._context.driver
        scratch = _Reservation(self._context, len(handles) * self.page_size, self.page_size, self.granularity)
        try:
            for addr, handle in zip(scratch.pages(), handles):
                self._call(driver.cuMemMap(addr, self.page_size, 0, handle, 0), f"cuMemMap at {addr:#x} (zeroing)")
                scratch.holes.discard(addr)
            self._call(driver.cuMemSetAccess(scratch.addr, scratch.nbytes, self._read_write, 1), "cuMemSetAccess (zeroing)")
            self._call(driver.cuMemsetD8(scratch.addr, 0, scratch.nbytes), "cuMemsetD8 (zeroing the store)")
            self._call(driver.cuCtxSynchronize(), "cuCtxSynchronize (zeroing)")
            if probe:
                self._empty_access = self._probe_read_only(scratch.addr)
        finally:
            errors = scratch.free()
        if errors:
            raise BackendError(f"giving back the scratch range after zeroing the store failed: {_summary(errors)}")

    def _probe_read_only(self, addr: int) -> list[Any]:
        """The access of empty pages: read-only, unless the device refuses read-only mappings
        (then read-write, with a warning: a stray write would land in the shared zero page).

        Raises:
            BackendError: ``cuMemSetAccess`` failed for another reason.
        """
        driver = self._context.driver
        (result,) = driver.cuMemSetAccess(addr, self.page_size, self._read, 1)
        if result == driver.CUresult.CUDA_SUCCESS:
            return self._read
        if result not in (driver.CUresult.CUDA_ERROR_NOT_SUPPORTED, driver.CUresult.CUDA_ERROR_INVALID_VALUE):
            raise BackendError(f"cuMemSetAccess (read-only probe) failed: {_error_name(result)}")
        self.zero_page_read_only = False
        log.warning("CUDA backend: the device refuses read-only mappings (%s); empty pages are mapped "
                    "read-write, so a kernel writing past a sequence would not fault", _error_name(result))
        return self._read_write

    def _map_at(self, res: _Reservation, addr: int, handle: int, access: list[Any]) -> None:
        """Map ``handle`` at the hole ``addr`` with ``access``; on failure nothing stays mapped
        (or, if even the undo fails, ``addr`` is no longer counted as a hole).

        Raises:
            BackendError: ``cuMemMap`` or ``cuMemSetAccess`` failed.
        """
        driver = self._context.driver
        self._call(driver.cuMemMap(addr, self.page_size, 0, handle, 0), f"cuMemMap at {addr:#x}")
        try:
            self._call(driver.cuMemSetAccess(addr, self.page_size, access, 1), f"cuMemSetAccess at {addr:#x}")
        except BackendError as exc:
            undo: list[str] = []
            self._context.attempt(driver.cuMemUnmap(addr, self.page_size), f"cuMemUnmap at {addr:#x}", undo)
            if undo:
                res.holes.discard(addr)  # something is mapped there, without access
                raise BackendError(f"{exc}; undoing the map failed too: {undo[0]}") from None
            raise
        res.holes.discard(addr)

    def _refill(self, res: _Reservation, addr: int, exc: BackendError) -> BackendError:
        """Put the zero page back at the hole ``addr`` after ``exc``; the error to raise."""
        try:
            self._map_at(res, addr, self._zero, self._empty_access)
        except BackendError as undo:
            return BackendError(f"{exc}; mapping the zero page back failed too ({undo}): reads at {addr:#x} fault")
        return exc

    def _reservation_of(self, addr: int, nbytes: int = 1) -> _Reservation:
        """The reservation holding ``[addr, addr + nbytes)``.

        Raises:
            BackendError: the range is not inside one reservation of this backend.
        """
        i = bisect.bisect_right(self._bases, addr) - 1
        res = self._reservations[self._bases[i]] if i >= 0 else None
        if res is None or addr + nbytes > res.addr + res.nbytes:
            raise BackendError(f"[{addr:#x}, +{nbytes}) is not inside a reservation of this backend")
        return res

    def _page_of(self, addr: Any) -> _Reservation:
        """The reservation holding page address ``addr`` (checked to be a page boundary)."""
        self._check_open()
        if not is_int(addr):
            raise BackendError(f"address must be an int, got {type(addr).__name__}")
        res = self._reservation_of(addr)
        if (addr - res.addr) % self.page_size:
            raise BackendError(f"address {addr:#x} is not on a page boundary ({self.page_size} B pages)")
        return res

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("the CUDA backend is closed")

    # ---- the protocol ----------------------------------------------------------------------
    def reserve(self, nbytes: int) -> int:
        """Reserve ``nbytes`` of device address space, the zero page mapped read-only at each page.

        Raises:
            InvalidConfig: ``nbytes`` is not a positive multiple of the page size.
            BackendError: a driver call failed (everything done so far is undone).
        """
        self._check_open()
        if not is_int(nbytes, 1) or nbytes % self.page_size:
            raise InvalidConfig(f"reserve: {nbytes!r} is not a positive multiple of the page size {self.page_size}")
        driver = self._context.driver
        with self._context.current():
            res = _Reservation(self._context, nbytes, self.page_size, self.granularity)
            try:
                for addr in res.pages():
                    self._call(driver.cuMemMap(addr, self.page_size, 0, self._zero, 0), f"cuMemMap (zero page) at {addr:#x}")
                    res.holes.discard(addr)
                self._call(driver.cuMemSetAccess(res.addr, nbytes, self._empty_access, 1),
                           f"cuMemSetAccess (zero page) at {res.addr:#x}")
            except BackendError as exc:
                errors = res.free()
                raise BackendError(f"{exc}" + (f"; giving the range back failed too: {_summary(errors)}"
                                               if errors else "")) from None
        self._reservations[res.addr] = res
        bisect.insort(self._bases, res.addr)
        return res.addr

    def free_reservation(self, addr: int, nbytes: int) -> None:
        """Give back a range: its data pages go back to the zero page now; the address space is
        freed once no tensor over it is left.

        Raises:
            BackendError: not a reservation of this backend, or a driver call failed (the pages
                done so far get their data pages back: nothing changed).
        """
        self._check_open()
        res = self._reservations.get(addr)
        if res is None or res.nbytes != nbytes:
            raise BackendError(f"free_reservation: {addr:#x} ({nbytes} B) is not a reservation of this backend")
        with self._context.current():
            done: list[tuple[int, int]] = []
            try:
                for page_addr, page in list(res.data.items()):
                    self._unmap_in(res, page_addr)
                    done.append((page_addr, page))
            except BackendError as exc:
                undo: list[str] = []
                for page_addr, page in done:
                    try:
                        self._map_in(res, page_addr, page)
                    except BackendError as failed:
                        undo.append(str(failed))
                raise BackendError(f"{exc}" + (f"; putting the pages back failed too: {_summary(undo)}"
                                               if undo else "")) from None
        del self._reservations[addr]
        self._bases.remove(addr)

    def map(self, addr: int, page: int) -> None:
        """Map store page ``page`` at the page address ``addr``, read-write. Call
        :meth:`synchronize` first if a kernel may still read ``addr`` (its zero page is unmapped
        for a moment).

        Raises:
            BackendError: bad page or address, a page is mapped there already, or a driver call
                failed (the zero page is mapped back: nothing changed).
        """
        res = self._page_of(addr)
        if not is_int(page, 0) or page >= self.num_pages:
            raise BackendError(f"map: page {page!r} is outside the store of {self.num_pages} pages")
        if addr in res.data:
            raise BackendError(f"map: {addr:#x} already holds page {res.data[addr]}; unmap it first")
        with self._context.current():
            self._map_in(res, addr, page)

    def _map_in(self, res: _Reservation, addr: int, page: int) -> None:
        """Replace the zero page (or hole) at ``addr`` by store page ``page``, or leave it and raise."""
        if addr not in res.holes:  # the zero page is there
            self._call(self._context.driver.cuMemUnmap(addr, self.page_size), f"cuMemUnmap (zero page) at {addr:#x}")
            res.holes.add(addr)
        try:
            if self._handles[page] is None:
                self._provision_locked([page])
            self._map_at(res, addr, self._handles[page], self._read_write)
        except BackendError as exc:
            raise (self._refill(res, addr, exc) if addr in res.holes else exc) from None
        res.data[addr] = page
        self._maps[page] += 1

    def unmap(self, addr: int) -> None:
        """Unmap the page at ``addr``; it reads as zeros again. Call :meth:`synchronize` first if
        a kernel may still read it.

        Raises:
            BackendError: nothing is mapped there, or a driver call failed (the data page is
                mapped back: nothing changed).
        """
        res = self._page_of(addr)
        if addr not in res.data:
            raise BackendError(f"unmap: nothing is mapped at {addr:#x}")
        with self._context.current():
            self._unmap_in(res, addr)

    def _unmap_in(self, res: _Reservation, addr: int) -> None:
        """Replace the data page at ``addr`` by the zero page, or leave it as it was and raise."""
        page = res.data[addr]
        self._call(self._context.driver.cuMemUnmap(addr, self.page_size), f"cuMemUnmap at {addr:#x}")
        del res.data[addr]
        self._maps[page] -= 1
        res.holes.add(addr)
        try:
            self._map_at(res, addr, self._zero, self._empty_access)
        except BackendError as exc:
            if addr not in res.holes:
                raise
            try:
                self._map_at(res, addr, self._handles[page], self._read_write)
            except BackendError as undo:
                raise BackendError(f"{exc}; mapping page {page} back failed too ({undo}): reads at {addr:#x} fault") from None
            res.data[addr] = page
            self._maps[page] += 1
            raise

    def provision(self, pages: list[int]) -> int:
        """On demand: create and zero, in one batch, the pages of ``pages`` that have no memory
        yet (one ``cuMemsetD8`` and one synchronize for the batch). A no-op otherwise.

        Returns:
            How many pages were created.

        Raises:
            BackendError: a page id is outside the store, or the driver refused (e.g. out of
                memory): the pages created by this call are given back first.
        """
        self._check_open()
        if not self.on_demand:
            return 0
        for page in pages:
            if not is_int(page, 0) or page >= self.num_pages:
                raise BackendError(f"provision: page {page!r} is outside the store of {self.num_pages} pages")
        with self._context.current():
            return self._provision_locked(pages)

    def _provision_locked(self, pages: list[int]) -> int:
        new = sorted({page for page in pages if self._handles[page] is None})
        created: list[int] = []
        try:
            for page in new:
                created.append(self._create(f"cuMemCreate (page {page}, on demand)"))
            if created:
                self._zero_handles(created)
        except BaseException:
            errors: list[str] = []
            for handle in created:
                self._context.attempt(self._context.driver.cuMemRelease(handle), "cuMemRelease (undo)", errors)
            if errors:
                log.warning("CUDA backend: giving back pages after a failed provision: %s", _summary(errors))
            raise
        for page, handle in zip(new, created):
            self._handles[page] = handle
        return len(created)

    def release_page(self, page: int) -> None:
        """On demand: give the memory of unmapped page ``page`` back to the driver
        (``cuMemRelease``); it is created again when next provisioned or mapped. Otherwise a
        no-op: the preallocated store is only given back by :meth:`close`.

        Raises:
            BackendError: the page is still mapped somewhere, or the driver refused.
        """
        self._check_open()
        if not self.on_demand or self._handles[page] is None:
            return
        if self._maps[page]:
            raise BackendError(f"release_page: page {page} is still mapped at {self._maps[page]} address(es)")
        with self._context.current():
            self._call(self._context.driver.cuMemRelease(self._handles[page]), f"cuMemRelease (page {page})")
        self._handles[page] = None

    def tensor(self, addr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` over ``addr`` without copying; it keeps the reservation
        alive, so it reads zeros (never faults) after its pages are unmapped or after close().

        Raises:
            BackendError: the range is empty or not inside one reservation, or torch copied it.
        """
        self._check_open()
        nbytes = torch.empty((), dtype=dtype).element_size() * math.prod(shape)
        if nbytes <= 0:
            raise BackendError(f"tensor: shape {tuple(shape)} covers no bytes")
        res = self._reservation_of(addr, nbytes)
        raw = self._runtime.as_tensor(_DeviceBytes(addr, nbytes, res), self.device)  # uint8 [nbytes]
        if raw.data_ptr() != addr or raw.numel() != nbytes:
            raise BackendError(f"torch copied the range at {addr:#x} instead of viewing it")
        return raw.view(dtype).view(shape)

    def synchronize(self) -> None:
        """Wait for all work on the device's primary context (every torch stream):
        ``cuCtxSynchronize``.

        Raises:
            BackendError: the driver reported an error (e.g. a kernel faulted earlier).
        """
        if self._closed:  # nothing of ours can still run
            return
        with self._context.current():
            self._call(self._context.driver.cuCtxSynchronize(), "cuCtxSynchronize")

    def resident_bytes(self) -> int:
        """GPU memory the store holds: (pages + the zero page) times the page size; 0 once closed."""
        if self._closed:
            return 0
        return (sum(h is not None for h in self._handles) + (self._zero is not None)) * self.page_size

    def close(self) -> None:
        """Put the zero page back wherever data is mapped (views read zeros), release every page
        and the context. Never raises: what the driver refuses is logged. Idempotent; also
        gives back a half-built backend."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        if self._retained:
            self._give_back(errors)
        self._reservations.clear()  # each is freed when its last tensor goes
        self._bases.clear()
        self._handles.clear()
        self._zero = None
        if self._retained:
            self._context.release(errors)
            self._retained = False
        if errors:
            log.warning("CUDA backend close: %d driver call(s) failed: %s", len(errors), _summary(errors))

    def _give_back(self, errors: list[str]) -> None:
        driver = self._context.driver
        try:
            with self._context.current(cleanup=True):
                self._context.attempt(driver.cuCtxSynchronize(), "cuCtxSynchronize", errors)
                for res in self._reservations.values():
                    for addr in list(res.data):
                        try:
                            self._unmap_in(res, addr)
                        except BackendError as exc:  # that page keeps its data until the range is freed
                            errors.append(str(exc))
                zero = [] if self._zero is None else [self._zero]
                # still-mapped handles are freed with their last mapping
                for handle in zero + [h for h in self._handles if h is not None]:
                    self._context.attempt(driver.cuMemRelease(handle), "cuMemRelease", errors)
        except BackendError as exc:  # the context could not be made current
            errors.append(str(exc))

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver module may be gone already
            pass


__all__ = ["CudaVirtualMemory", "TorchCudaRuntime", "cuda_granularity", "cuda_memory_info"]
