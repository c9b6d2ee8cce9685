"""The fake CUDA driver library (``fake_cuda.c``): build it, load it, drive it from tests.

The library is compiled with the system ``gcc`` into ``libcuda.so.1`` (soname included) and
loaded into the test process *before* cuda-bindings first touches the driver. cuda-bindings
finds the driver with ``dlopen("libcuda.so.1")`` at its first call (cuda.pathfinder checks
``RTLD_NOLOAD`` first), so it binds to the already loaded fake: the real bindings convert our
arguments and call C functions with the driver's ABI. Nothing is loaded if a real driver is
already in the process or installed on the loader path (a GPU machine): torch would then get
the fake too, so the fake tests skip there and the real ones run.

:class:`FakeRuntime` stands in for :class:`vmkv.vm.cuda.TorchCudaRuntime` (torch here is
CPU-only): it does what torch's runtime does with the driver (retain the primary context once
and make it current on the calling thread) and wraps "device" memory, which the fake backs with
host memory at the same address, in a CPU tensor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("fake_cuda.c")
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_INVALID_VALUE = 1
_loaded: list["FakeDriver"] = []  # the library this process loaded (a library loads once)
_LINE = re.compile(r"^(\w+)\((.*)\) -> (\w+)(?: \[(.*)\])?$")


class FakeUnavailable(Exception):
    """The fake driver cannot be used in this process (the message is the skip reason)."""


def build(directory: Path) -> Path:
    """Compile ``fake_cuda.c`` into ``directory/<hash>/libcuda.so.1`` (reused if already there).

    Raises:
        FakeUnavailable: no gcc, or the compile failed.
    """
    gcc = shutil.which("gcc")
    if gcc is None:
        raise FakeUnavailable("gcc not found: the fake CUDA driver (tests/fake_cuda/fake_cuda.c) is compiled with it")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    target = directory / digest / "libcuda.so.1"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden",
           "-Wl,-soname,libcuda.so.1", "-o", str(partial), str(SOURCE), "-lpthread"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise FakeUnavailable(f"compiling the fake CUDA driver failed: {done.stderr.strip()[-500:]}")
    partial.replace(target)
    return target


def _real_driver_reason() -> str | None:
    """Why loading the fake here could hand it to torch in place of a real driver, or None."""
    try:
        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        pass
    else:
        return "a CUDA driver library is already loaded in this process"
    if ctypes.util.find_library("cuda"):
        return "a real CUDA driver is installed (libcuda on the loader path): the real CUDA tests run instead"
    return None


@dataclass(frozen=True)
class Call:
    """One line of the fake's call log."""

    name: str
    args: str
    result: str
    note: str | None

    @property
    def ok(self) -> bool:
        return self.result == "CUDA_SUCCESS"


class FakeDriver:
    """The loaded fake library and its test controls."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL)
        lib = self.lib
        lib.fake_cuda_reset.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.fake_cuda_fail.argtypes = [ctypes.c_char_p, ctypes.c_long, ctypes.c_int]
        lib.fake_cuda_log.argtypes = [ctypes.c_int]
        for name in ("fake_cuda_log", "fake_cuda_state"):
            getattr(lib, name).restype = ctypes.c_void_p
        lib.fake_cuda_free.argtypes = [ctypes.c_void_p]
        lib.fake_cuda_hazards.restype = ctypes.c_long

    @classmethod
    def load(cls, directory: Path) -> "FakeDriver":
        """Build and load the fake, checking cuda-bindings will bind to it. A process loads it
        once: later calls return that one.

        Raises:
            FakeUnavailable: cuda-bindings missing, no gcc, or a real driver is around.
        """
        if _loaded:
            return _loaded[0]
        if importlib.util.find_spec("cuda.bindings") is None:
            raise FakeUnavailable("cuda-bindings is not installed: pip install cuda-bindings")
        try:
            importlib.import_module("cuda.bindings.driver")  # imports without loading libcuda
        except ImportError as exc:
            raise FakeUnavailable(f"cuda-bindings is not installed ({exc}): pip install cuda-bindings") from None
        reason = _real_driver_reason()
        if reason:
            raise FakeUnavailable(reason)
        fake = cls(build(directory))
        found = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)  # what cuda-bindings will get
        if not hasattr(found, "fake_cuda_reset"):
            raise FakeUnavailable("libcuda.so.1 resolves to another library than the fake")
        _loaded.append(fake)
        return fake

    def reset(self, *, granularity: int = 64 << 10, memory: int = 64 << 20, vmm: bool = True, read_only: bool = True,
              devices: int = 1) -> None:
        """Forget every object, the log and the injected failures; start with this device
        (``read_only=False``: a device whose cuMemSetAccess refuses PROT_READ)."""
        self.lib.fake_cuda_reset(granularity, memory, int(vmm), int(read_only), devices)

    def fail(self, name: str = "", nth: int = 1, result: int = CUDA_ERROR_OUT_OF_MEMORY) -> None:
        """Make the ``nth`` next call of ``name`` (any call if empty) return ``result``;
        ``nth=-1``: every such call from now on."""
        if not self.lib.fake_cuda_fail(name.encode(), nth, result):
            raise RuntimeError("too many injected failures")

    def clear_failures(self) -> None:
        self.lib.fake_cuda_clear_failures()

    def _text(self, pointer: int) -> str:
        try:
            return ctypes.string_at(pointer).decode()
        finally:
            self.lib.fake_cuda_free(pointer)

    def calls(self, *, clear: bool = False) -> list[Call]:
        """The driver calls made since the last reset/clear, in order."""
        calls = []
        for line in self._text(self.lib.fake_cuda_log(int(clear))).splitlines():
            match = _LINE.match(line)
            if match is None:
                raise AssertionError(f"unparsable fake log line: {line!r}")
            calls.append(Call(*match.groups()))
        return calls

    def state(self) -> dict[str, Any]:
        """Live handles, reservations, mappings (with access flags), context retains, hazards."""
        return json.loads(self._text(self.lib.fake_cuda_state()))

    def hazards(self) -> int:
        return self.lib.fake_cuda_hazards()

    def created_minus_released(self) -> int:
        """Bytes of the handles ``cuMemCreate`` created minus those ``cuMemRelease`` released,
        counted from the call log since the last reset or clear (not from the fake's own bookkeeping)."""
        sizes: dict[str, int] = {}
        for call in self.calls():
            if call.name == "cuMemCreate" and call.ok:
                sizes[call.args.rsplit("handle=", 1)[1]] = int(call.args.split("size=", 1)[1].split(",", 1)[0])
            elif call.name == "cuMemRelease" and call.ok:
                del sizes[call.args.split("handle=", 1)[1]]
        return sum(sizes.values())


class FakeRuntime:
    """Stands in for ``TorchCudaRuntime``: torch's side of CUDA, done against the fake driver.

    ``activate`` retains the primary context once and makes it current on the calling thread,
    as torch's runtime does; ``as_tensor`` wraps the fake's device memory (host memory at the
    device address) in a CPU tensor that holds the interface object, as torch's CUDA tensor does.
    """

    def __init__(self, devices: int = 1) -> None:
        from cuda.bindings import driver

        self.driver = driver
        self.devices = devices
        self.contexts: dict[int, Any] = {}

    def unavailable_reason(self) -> str | None:
        return None

    def device_count(self) -> int:
        return self.devices

    def current_device(self) -> int:
        return 0

    def device_name(self, index: int) -> str:
        return f"fake device {index}"

    def activate(self, index: int) -> None:
        driver = self.driver
        if index not in self.contexts:
            driver.cuInit(0)
            result, ctx = driver.cuDevicePrimaryCtxRetain(index)
            if result != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"fake torch runtime: cuDevicePrimaryCtxRetain failed: {result}")
            self.contexts[index] = ctx
        driver.cuCtxSetCurrent(self.contexts[index])

    def as_tensor(self, obj: Any, device: torch.device) -> torch.Tensor:
        interface = obj.__cuda_array_interface__
        (nbytes,), (addr, _) = interface["shape"], interface["data"]
        buffer = (ctypes.c_uint8 * nbytes).from_address(addr)
        buffer.owner = obj  # the tensor holds the buffer, the buffer the interface object
        return torch.frombuffer(buffer, dtype=torch.uint8)
