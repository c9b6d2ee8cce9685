"""CUDA backend: GPU virtual memory through the CUDA driver's VMM API (``cuda.bindings.driver``).

* reserve: ``cuMemAddressReserve(nbytes, alignment=granularity)`` — device address space only.
* physical pages: the whole store is created up front, one ``cuMemCreate`` handle per page
  (``cuMemMap`` maps a handle from offset 0 only, so a handle cannot hold several pages). The
  hot path never allocates; ``release_page`` is a no-op and memory goes back at ``close()``.
* map: ``cuMemMap(addr, page_size, 0, handle, 0)`` then ``cuMemSetAccess`` (read-write for this
  device) — without the access call every touch of the page faults. Mapping one handle at
  several addresses shares it.
* unmap: ``cuMemUnmap``; the range stays reserved. The caller synchronizes first
  (:meth:`CudaVirtualMemory.synchronize`), as ``VirtualKVCache`` does: unmapping a page a
  running kernel still reads is an illegal-address fault that kills the CUDA context.
* tensors: an object exposing ``__cuda_array_interface__`` handed to ``torch.as_tensor``.

Contexts: every call runs in PyTorch's primary context of the device. torch initialises it,
the backend retains it (``cuDevicePrimaryCtxRetain`` returns the same context, it never
creates another) and pushes it only on threads where it is not current (e.g. a map-ahead
thread), so torch's own notion of the current device is never changed.

Every driver call returns a tuple whose first item is a ``CUresult``; anything but
``CUDA_SUCCESS`` raises :class:`~vmkv.errors.BackendError` naming the call and the error.
A missing cuda-bindings package, driver or GPU raises one
:class:`~vmkv.errors.BackendUnavailable` ("CUDA driver not available: ...").
"""

from __future__ import annotations

import bisect
import math
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ..errors import BackendError, BackendUnavailable, InvalidConfig
from .base import VirtualMemory

_UNAVAILABLE = "CUDA driver not available: "


def _driver_for(device: torch.device | str | int) -> tuple[Any, int]:
    """Import cuda-bindings and initialise the driver inside torch's primary context.

    Returns:
        ``(driver module, device index)``.

    Raises:
        BackendUnavailable: no GPU/driver visible to torch, cuda-bindings missing, the driver
            refuses to initialise, or the device cannot do virtual memory management.
        InvalidConfig: ``device`` is not a CUDA device or does not exist.
    """
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise InvalidConfig(f"the CUDA backend needs a cuda device, got {device}")
    if not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise BackendUnavailable(f"{_UNAVAILABLE}torch {torch.__version__} ({build}) sees no CUDA GPU")
    index = torch.cuda.current_device() if device.index is None else device.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise InvalidConfig(f"device cuda:{index} does not exist; {count} CUDA device(s) are visible")
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise BackendUnavailable(
            f"{_UNAVAILABLE}cannot import cuda.bindings.driver ({exc}); install it with pip install 'vmkv[cuda]'"
        ) from None
    torch.cuda.synchronize(index)  # torch creates (or finds) the device's primary context
    try:
        (result,) = driver.cuInit(0)
    except Exception as exc:  # cuda-bindings raises its own loader errors when libcuda is missing
        raise BackendUnavailable(f"{_UNAVAILABLE}cuInit failed: {exc}") from None
    if result != driver.CUresult.CUDA_SUCCESS:
        raise BackendUnavailable(f"{_UNAVAILABLE}cuInit returned {_error_name(result)}")
    attribute = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    supported = _check(driver, driver.cuDeviceGetAttribute(attribute, index), "cuDeviceGetAttribute")
    if not supported:
        raise BackendUnavailable(
            f"{_UNAVAILABLE}{torch.cuda.get_device_name(index)} (cuda:{index}) does not support "
            "virtual memory management (cuMemMap)"
        )
    return driver, index


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


def _allocation_prop(driver: Any, index: int) -> Any:
    """``CUmemAllocationProp`` of plain (pinned, unshared) device memory on device ``index``."""
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = index
    return prop


def _granularity(driver: Any, index: int) -> int:
    flag = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    prop = _allocation_prop(driver, index)
    return int(_check(driver, driver.cuMemGetAllocationGranularity(prop, flag), "cuMemGetAllocationGranularity"))


def cuda_granularity(device: torch.device | str | int) -> int:
    """The smallest mappable page on ``device``, in bytes (``cuMemGetAllocationGranularity``,
    minimum granularity; 2 MiB on current NVIDIA GPUs).

    Raises:
        BackendUnavailable: no GPU, driver or cuda-bindings here.
    """
    driver, index = _driver_for(device)
    return _granularity(driver, index)


class _DeviceBytes:
    """``nbytes`` bytes of device memory at ``addr``, as a ``__cuda_array_interface__`` (v2).

    Exposed as uint8 so every dtype (bfloat16 has no array-interface type string) is a
    ``.view`` of it.
    """

    def __init__(self, addr: int, nbytes: int) -> None:
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
        num_pages: pages in the store, all created now (``num_pages * page_size`` bytes of GPU
            memory are taken at once).
        device: the CUDA device (``"cuda"`` means torch's current device).

    Raises:
        BackendUnavailable: no GPU, driver or cuda-bindings here.
        InvalidConfig: bad page size or page count.
        BackendError: the driver refused to create the pages (e.g. out of GPU memory).
    """

    name = "cuda"

    def __init__(self, page_size: int, num_pages: int, *, device: torch.device | str | int = "cuda") -> None:
        self._handles: list[int] = []
        self._reservations: dict[int, int] = {}  # base address -> bytes
        self._bases: list[int] = []  # sorted reservation bases, to find the one holding an address
        self._mapped: dict[int, int] = {}  # page address -> page mapped there
        self._probe: int | None = None  # a granule-sized handle used by tensor() (see _probe_at)
        self._ctx: Any = None
        driver, index = _driver_for(device)
        self._driver = driver
        self.device = torch.device("cuda", index)
        self.granularity = _granularity(driver, index)
        if page_size <= 0 or page_size % self.granularity:
            raise InvalidConfig(f"cuda page_size must be a positive multiple of {self.granularity} B, got {page_size}")
        if num_pages <= 0:
            raise InvalidConfig(f"num_pages must be positive, got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self._ctx = _check(driver, driver.cuDevicePrimaryCtxRetain(index), "cuDevicePrimaryCtxRetain")
        self._prop = _allocation_prop(driver, index)
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        try:
            with self._current():
                for page in range(num_pages):
                    self._handles.append(self._create(page_size, f"cuMemCreate (page {page} of {num_pages})"))
        except BaseException as exc:
            self.close()
            if isinstance(exc, BackendError) and "OUT_OF_MEMORY" in str(exc):
                raise BackendError(
                    f"{exc}: a store of {num_pages} x {page_size} B does not fit in free GPU memory; lower memory_budget"
                ) from None
            raise

    # ---- driver plumbing -------------------------------------------------------------------
    def _call(self, returned: tuple, call: str) -> Any:
        return _check(self._driver, returned, call)

    @contextmanager
    def _current(self) -> Iterator[None]:
        """Run the body with torch's primary context current, pushing it only if it is not."""
        current = self._call(self._driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(current) == int(self._ctx):
            yield
            return
        self._call(self._driver.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self._call(self._driver.cuCtxPopCurrent(), "cuCtxPopCurrent")

    def _create(self, nbytes: int, call: str) -> int:
        return int(self._call(self._driver.cuMemCreate(nbytes, self._prop, 0), call))

    def _map_handle(self, addr: int, nbytes: int, handle: int) -> None:
        self._call(self._driver.cuMemMap(addr, nbytes, 0, handle, 0), f"cuMemMap at {addr:#x}")
        try:
            self._call(self._driver.cuMemSetAccess(addr, nbytes, self._access, 1), f"cuMemSetAccess at {addr:#x}")
        except BackendError:
            self._driver.cuMemUnmap(addr, nbytes)
            raise

    def _reservation_of(self, addr: int) -> int:
        """Base of the reservation holding ``addr``.

        Raises:
            BackendError: ``addr`` is in no reservation of this backend.
        """
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0 or addr >= self._bases[i] + self._reservations[self._bases[i]]:
            raise BackendError(f"address {addr:#x} is not inside a reservation of this backend")
        return self._bases[i]

    def _page_address(self, addr: int) -> int:
        """``addr`` checked to be a page boundary inside a reservation."""
        base = self._reservation_of(addr)
        if (addr - base) % self.page_size:
            raise BackendError(f"address {addr:#x} is not on a page boundary ({self.page_size} B pages)")
        return addr

    # ---- the protocol ----------------------------------------------------------------------
    def reserve(self, nbytes: int) -> int:
        if nbytes <= 0 or nbytes % self.page_size:
            raise InvalidConfig(f"reserve: {nbytes} is not a positive multiple of the page size {self.page_size}")
        with self._current():
            ptr = self._call(self._driver.cuMemAddressReserve(nbytes, self.granularity, 0, 0), f"cuMemAddressReserve ({nbytes} B)")
        addr = int(ptr)
        self._reservations[addr] = nbytes
        bisect.insort(self._bases, addr)
        return addr

    def free_reservation(self, addr: int, nbytes: int) -> None:
        if self._reservations.get(addr) != nbytes:
            raise BackendError(f"free_reservation: {addr:#x} ({nbytes} B) is not a reservation of this backend")
        still_mapped = [a for a in self._mapped if addr <= a < addr + nbytes]
        if still_mapped:
            raise BackendError(f"free_reservation: {len(still_mapped)} page(s) are still mapped in {addr:#x}")
        with self._current():
            self._call(self._driver.cuMemAddressFree(addr, nbytes), f"cuMemAddressFree at {addr:#x}")
        del self._reservations[addr]
        self._bases.remove(addr)

    def map(self, addr: int, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise BackendError(f"map: page {page} is outside the store of {self.num_pages} pages")
        if self._page_address(addr) in self._mapped:
            raise BackendError(f"map: {addr:#x} already holds page {self._mapped[addr]}; unmap it first")
        with self._current():
            self._map_handle(addr, self.page_size, self._handles[page])
        self._mapped[addr] = page

    def unmap(self, addr: int) -> None:
        """Unmap the page at ``addr``. Call :meth:`synchronize` first if a kernel may still read it."""
        if addr not in self._mapped:
            raise BackendError(f"unmap: nothing is mapped at {addr:#x}")
        with self._current():
            self._call(self._driver.cuMemUnmap(addr, self.page_size), f"cuMemUnmap at {addr:#x}")
        del self._mapped[addr]

    def release_page(self, page: int) -> None:
        """No-op: the page store is preallocated (one ``cuMemCreate`` handle per page) and is
        only given back to the driver by :meth:`close`."""

    def tensor(self, addr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize * math.prod(shape)
        with self._current(), self._probe_at(addr):
            raw = torch.as_tensor(_DeviceBytes(addr, nbytes), device=self.device)  # uint8 [nbytes]
        if raw.data_ptr() != addr or raw.device != self.device:
            raise BackendError(f"torch copied the range at {addr:#x} instead of viewing it")
        return raw.view(dtype).view(shape)

    @contextmanager
    def _probe_at(self, addr: int) -> Iterator[None]:
        """Keep memory mapped at ``addr`` while torch wraps it.

        ``torch.as_tensor`` asks the runtime which device owns the pointer
        (``cudaPointerGetAttributes``); an address with nothing mapped answers "unregistered
        host memory" and torch refuses it. So if the page holding ``addr`` is unmapped, a spare
        granule-sized handle is mapped at ``addr`` for the duration of the call, then unmapped
        (the tensor keeps only the address; it reads nothing).
        """
        base = self._reservation_of(addr)
        page_addr = addr - (addr - base) % self.page_size
        if page_addr in self._mapped:
            yield
            return
        if self._probe is None:
            self._probe = self._create(self.granularity, "cuMemCreate (probe granule)")
        granule = addr - addr % self.granularity  # reservations are granularity-aligned
        self._map_handle(granule, self.granularity, self._probe)
        try:
            yield
        finally:
            self._call(self._driver.cuMemUnmap(granule, self.granularity), f"cuMemUnmap at {granule:#x}")

    def synchronize(self) -> None:
        """Wait for every stream of the device (``torch.cuda.synchronize``)."""
        torch.cuda.synchronize(self.device)

    def resident_bytes(self) -> int:
        """GPU memory the store holds: pages created times page size (plus the probe granule)."""
        probe = self.granularity if self._probe is not None else 0
        return len(self._handles) * self.page_size + probe

    def close(self) -> None:
        """Unmap every page, release every handle and reservation, release the context. Idempotent.

        Raises:
            BackendError: the driver refused a call (cleanup still runs to the end).
        """
        if self._ctx is None:
            return
        errors: list[BackendError] = []

        def attempt(returned: tuple, call: str) -> None:
            try:
                self._call(returned, call)
            except BackendError as exc:
                errors.append(exc)

        try:
            self.synchronize()
        except RuntimeError as exc:  # a faulted context: still give back what the driver will take
            errors.append(BackendError(f"synchronize before close failed: {exc}"))
        with self._current():
            for addr in list(self._mapped):
                attempt(self._driver.cuMemUnmap(addr, self.page_size), f"cuMemUnmap at {addr:#x}")
            self._mapped.clear()
            for addr, nbytes in list(self._reservations.items()):
                attempt(self._driver.cuMemAddressFree(addr, nbytes), f"cuMemAddressFree at {addr:#x}")
            self._reservations.clear()
            self._bases.clear()
            for handle in self._handles + ([self._probe] if self._probe is not None else []):
                attempt(self._driver.cuMemRelease(handle), "cuMemRelease")
            self._handles.clear()
            self._probe = None
        attempt(self._driver.cuDevicePrimaryCtxRelease(self.device.index), "cuDevicePrimaryCtxRelease")
        self._ctx = None
        if errors:
            raise errors[0]

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown or a dead context: nothing left to do
            pass


__all__ = ["CudaVirtualMemory", "cuda_granularity"]
