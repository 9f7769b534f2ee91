"""The one-shot all-reduce's buffers: one per rank, opened in every other rank over CUDA IPC.

``CustomAllReduce.create`` runs on every rank right after the process group exists (before
the KV pool is sized and before any CUDA graph is captured). Each rank allocates one zeroed
buffer (a PyTorch tensor, kept for the rank's life), exports the IPC handle of the
allocation that holds it (``cuMemGetAddressRange`` + ``cuIpcGetMemHandle``) with the buffer's
offset in it, and the handles travel through the process group (``all_gather_object``). Each
rank then opens every peer's handle in its own device's context with lazy peer access
(``cuIpcOpenMemHandle``), which maps the peer's memory over NVLink into this process: the
kernel (``pageserve.kernels.allreduce``) then reads and writes it with plain loads and
stores. No multicast object is involved (the machines this runs on forbid them). The driver
is reached through ``ctypes`` (``libcuda.so.1``); nothing is compiled.

Used only when every pair of GPUs can access each other (``torch.cuda.can_device_access_peer``);
otherwise, or for messages over ``max_bytes``, ``parallel.all_reduce`` calls NCCL.
"""
from __future__ import annotations

import ctypes
import logging

import torch
import torch.distributed as dist

from ..kernels.allreduce import MAX_BLOCKS, flag_bytes, one_shot_all_reduce

logger = logging.getLogger(__name__)

# 8 MiB: decode up to 2,048 rows at hidden 2,048 in bf16; larger (prefill) messages use NCCL
DEFAULT_MAX_BYTES = 8 << 20
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _Driver:
    """The few CUDA driver calls the buffers need, each checked."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, size_t, p = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER

        def fn(names, *argtypes):
            for n in names:
                f = getattr(lib, n, None)
                if f is not None:
                    f.argtypes, f.restype = list(argtypes), ctypes.c_int
                    return f
            raise RuntimeError(f"the CUDA driver has none of {names}")

        self.get_error = fn(["cuGetErrorString"], ctypes.c_int, p(ctypes.c_char_p))
        self.ctx_get_device = fn(["cuCtxGetDevice"], p(ctypes.c_int))
        self.address_range = fn(["cuMemGetAddressRange_v2", "cuMemGetAddressRange"], p(u64), p(size_t), u64)
        self.ipc_get = fn(["cuIpcGetMemHandle"], p(_IpcHandle), u64)
        self.ipc_open = fn(["cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"], p(u64), _IpcHandle, ctypes.c_uint)
        self.ipc_close = fn(["cuIpcCloseMemHandle"], u64)

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self.get_error(rc, ctypes.byref(msg))
            raise RuntimeError(f"{what} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")

    def current_device(self) -> int:
        dev = ctypes.c_int(-1)
        self.check(self.ctx_get_device(ctypes.byref(dev)), "cuCtxGetDevice (no current CUDA context?)")
        return dev.value

    def export(self, ptr: int) -> tuple[bytes, int]:
        """The IPC handle of the allocation holding ``ptr``, and ``ptr``'s offset in it."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check(self.address_range(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
        h = _IpcHandle()
        self.check(self.ipc_get(ctypes.byref(h), base.value), "cuIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(h), 64), ptr - base.value

    def open(self, handle: bytes) -> int:
        h = _IpcHandle.from_buffer_copy(handle)
        ptr = ctypes.c_uint64()
        self.check(self.ipc_open(ctypes.byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        return ptr.value


def _all_ok(ok: bool, device: torch.device) -> bool:
    """True when ``ok`` on every rank (collective)."""
    t = torch.tensor([int(ok)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


class CustomAllReduce:
    """This rank's view of the world's buffers, and the call that sums through them."""

    def __init__(self, driver: _Driver, buffer: torch.Tensor, peers: list[int], bases: torch.Tensor, rank: int,
                 world: int, max_bytes: int) -> None:
        self.driver, self.buffer, self.peers = driver, buffer, peers  # peers: the opened allocations' bases
        self.bases, self.rank, self.world, self.max_bytes = bases, rank, world, max_bytes
        self.counters = torch.zeros(MAX_BLOCKS, dtype=torch.int64, device=bases.device)

    @classmethod
    def create(cls, rank: int, world: int, device: torch.device,
               max_bytes: int = DEFAULT_MAX_BYTES) -> "CustomAllReduce | None":
        """Collective: every rank calls it, and every rank gets an instance or None (NCCL for
        everything) alike: None when a GPU pair lacks peer access or any rank fails to
        allocate, export or open a buffer (the failure is logged)."""
        n = torch.cuda.device_count()
        peer_ok = n >= world and all(torch.cuda.can_device_access_peer(a, b)
                                     for a in range(world) for b in range(world) if a != b)
        if not _all_ok(peer_ok, device):
            logger.info("custom all-reduce off: GPUs without peer access; NCCL for every message")
            return None
        max_bytes = max_bytes // 16 * 16
        driver, buffer, shared, error = None, None, None, None
        try:
            buffer = torch.zeros(flag_bytes(world) + 2 * world * max_bytes, dtype=torch.uint8, device=device)
            torch.cuda.synchronize(device)  # zeroed before any peer can see it; the primary context is current
            driver = _Driver()
            want = device.index if device.index is not None else torch.cuda.current_device()
            if driver.current_device() != want:
                raise RuntimeError(f"current CUDA context is device {driver.current_device()}, not cuda:{want}")
            shared = driver.export(buffer.data_ptr())
        except Exception as e:  # noqa: BLE001 - reported, then everyone falls back together
            error = e
        handles: list[tuple[bytes, int] | None] = [None] * world
        dist.all_gather_object(handles, shared if error is None else None)
        opened: dict[int, int] = {}  # rank -> the peer allocation's base in this process
        addresses: dict[int, int] = {}
        if all(h is not None for h in handles):
            try:
                for r, (handle, offset) in enumerate(handles):
                    if r != rank:
                        opened[r] = driver.open(handle)
                        addresses[r] = opened[r] + offset
                addresses[rank] = buffer.data_ptr()
                if any(a % 16 for a in addresses.values()):
                    raise RuntimeError("a buffer is not 16-byte aligned")
            except Exception as e:  # noqa: BLE001
                error = e
        if not _all_ok(error is None and all(h is not None for h in handles), device):
            if error is not None:
                logger.warning("custom all-reduce off (rank %d: %s); NCCL for every message", rank, error)
            for base in opened.values():
                driver.ipc_close(base)
            return None
        bases = torch.tensor([addresses[r] for r in range(world)], dtype=torch.int64, device=device)
        return cls(driver, buffer, list(opened.values()), bases, rank, world, max_bytes)

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        return one_shot_all_reduce(x, x, self.buffer, self.bases, self.counters, self.rank, self.world, self.max_bytes)

    def close(self) -> None:
        """Unmap the peers' buffers (after the device is idle); this rank's goes with its tensor."""
        torch.cuda.synchronize(self.bases.device)
        for p in self.peers:
            self.driver.ipc_close(p)
        self.peers, self.buffer = [], None
