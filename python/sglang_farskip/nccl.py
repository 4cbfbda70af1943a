"""FarSkip's own NCCL/RCCL binding: the few calls its GPU collectives need, through ctypes.

    comm = NcclComm.from_group(cpu_group, device, max_ctas=16)   # or NcclComm(1, 0, None, dev)
    comm.all_reduce_(t)                    # in place, summed, on the *current* stream
    comm.all_gather_(out, t)               # out = the ranks' t, concatenated in rank order
    comm.reduce_scatter_(out, t)           # out = this rank's slice of the sum of the ranks' t
    comm.destroy()

Every collective is enqueued on the caller's current CUDA/HIP stream and returns at once: the
stream/event semantics (fork, join, the event ring, graph capture) are those of
`comm.SideStreamAllReduce`, documented once in comm.py. Needs torch and the NCCL/RCCL shared
library only: no SGLang, no CuPy, no compiler.

Why a binding of our own rather than torch's ProcessGroupNCCL driven from a dedicated stream:
- ProcessGroupNCCL never runs a collective on the caller's stream. It makes an internal stream
  of its own wait on the caller's, runs NCCL there and hands back an event edge. FarSkip's side
  stream would then order nothing but that hop: the all-reduce kernels would get the priority
  of the process group's stream (one option for the whole group, not for FarSkip's lane), and
  the two lanes' launch order, eager and captured alike, would rest on the process group's
  internals instead of on one stream in program order.
- Under CUDA-graph capture the process group's work objects, its watchdog thread (which
  queries events while another thread captures) and its coalescing state are involved in
  every captured collective; a raw ncclAllReduce on the capturing stream is a plain captured
  kernel, the case NCCL documents (mixing eager and captured use of one communicator relies on
  NCCL_GRAPH_MIXING_SUPPORT=1, NCCL's default).
- A CTA cap (ncclConfig_t.maxCTAs) belongs to this communicator alone. Through torch it would
  be a process-group option, and a group created for it still brings the rest of c10d.
- Against it: this module has to match NCCL's C ABI. The only struct it passes is the
  versioned, append-only ncclConfig_t, declared here as it stands since 2.18 and tagged with
  that version, so a newer library reads the fields we set and defaults the rest (it copies
  `size` bytes, then resets what `version` predates); the rest is ints, pointers and a
  128-byte id passed by value.
It is also what FarSkip has run since the start (then through SGLang's ctypes wrapper), so
the device checks keep checking the code path they always checked.

Library: $FARSKIP_NCCL_LIBRARY if set (a path or a soname), else one already loaded in this
process (torch's own, so that two copies never coexist), else the nvidia-nccl wheel beside torch
(`nvidia/nccl/lib/libnccl.so.2`), else `libnccl.so.2` from the loader path; on ROCm
(torch.version.hip) `librccl.so.1` / `librccl.so` instead, the one in torch/lib first.
"""

from __future__ import annotations

import ctypes
import glob
import os
from pathlib import Path
from typing import Optional

import torch

ENV_LIBRARY = "FARSKIP_NCCL_LIBRARY"
UNIQUE_ID_BYTES = 128

# The ncclConfig_t layout below is the 2.18 one; a CTA cap needs 2.17 (where maxCTAs appeared).
CONFIG_VERSION = 21800
MIN_CTA_CAP_VERSION = 21700
_CONFIG_MAGIC = 0xCAFEBEEF
_UNDEF_INT = -(2**31)  # NCCL_CONFIG_UNDEF_INT: "let NCCL pick"

_SUM = 0  # ncclSum
_DTYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4,
    torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}
for _name, _code in (("float8_e4m3fn", 10), ("float8_e5m2", 11)):  # NCCL 2.24+
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code


class NcclError(RuntimeError):
    """A failed NCCL/RCCL call, or no usable library. The message names the call."""


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class Config(ctypes.Structure):
    """ncclConfig_t as of NCCL 2.18 (size 48 on LP64). Fields NCCL added later are left to
    the library's defaults: it reads min(size, its own sizeof) bytes."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
    ]


def make_config(library_version: int, max_ctas: int) -> Config:
    """The config for a CTA cap of `max_ctas`, or NcclError if this library has no such cap
    (before 2.17 the library would ignore the field and run uncapped, silently)."""
    if library_version < MIN_CTA_CAP_VERSION:
        raise NcclError(
            f"a CTA cap (max_ctas={max_ctas}) needs NCCL 2.17 or newer, this library is "
            f"{version_string(library_version)}: drop the cap (--farskip-side-max-ctas) or use a newer NCCL")
    if max_ctas < 1:
        raise NcclError(f"max_ctas must be at least 1, not {max_ctas}")
    cfg = Config(size=ctypes.sizeof(Config), magic=_CONFIG_MAGIC, version=CONFIG_VERSION,
                 blocking=_UNDEF_INT, cgaClusterSize=_UNDEF_INT, minCTAs=_UNDEF_INT,
                 maxCTAs=max_ctas, netName=None, splitShare=_UNDEF_INT)
    return cfg


def version_string(code: int) -> str:
    """NCCL_VERSION_CODE -> "2.21.5" (codes before 2.9 used a thousands scheme)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def library_candidates() -> list[str]:
    """Where the library is looked for, in order (see the module docstring)."""
    if os.environ.get(ENV_LIBRARY):
        return [os.environ[ENV_LIBRARY]]
    rocm = bool(getattr(torch.version, "hip", None))
    names = ("librccl.so.1", "librccl.so") if rocm else ("libnccl.so.2",)
    found = _loaded_in_process(names)
    torch_dir = Path(torch.__file__).resolve().parent
    if rocm:
        found += [str(torch_dir / "lib" / n) for n in names]
    else:
        site = torch_dir.parent
        found.append(str(site / "nvidia" / "nccl" / "lib" / "libnccl.so.2"))
        # CUDA 13 wheels of some NVIDIA libraries moved under nvidia/cu13/; look there too.
        found += sorted(glob.glob(str(site / "nvidia" / "*" / "lib" / "libnccl.so.2")))
    found += list(names)
    return list(dict.fromkeys(found))


def _loaded_in_process(names) -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(names)}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


class NcclLibrary:
    """One loaded NCCL/RCCL library: thin, checked wrappers of its C functions."""

    def __init__(self, path: Optional[str] = None):
        tried = []
        for candidate in [path] if path else library_candidates():
            if candidate.startswith("/") and not os.path.exists(candidate):
                tried.append(f"{candidate} (no such file)")
                continue
            try:
                self._lib = ctypes.CDLL(candidate)
                self.path = candidate
                break
            except OSError as e:
                tried.append(f"{candidate} ({e})")
        else:
            raise NcclError(
                "no NCCL/RCCL library could be loaded; tried: " + "; ".join(tried)
                + f". Set {ENV_LIBRARY} to the library's path")
        self._declare()
        v = ctypes.c_int()
        self._check(self._lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        self.version = v.value

    def _declare(self) -> None:
        lib, p, i, size = self._lib, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        self._has_config = True
        signatures = {
            "ncclGetVersion": [ctypes.POINTER(i)],
            "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
            "ncclCommInitRank": [ctypes.POINTER(p), i, UniqueId, i],
            "ncclCommInitRankConfig": [ctypes.POINTER(p), i, UniqueId, i, ctypes.POINTER(Config)],
            "ncclAllReduce": [p, p, size, i, i, p, p],
            "ncclAllGather": [p, p, size, i, p, p],
            "ncclReduceScatter": [p, p, size, i, i, p, p],
            "ncclCommDestroy": [p],
        }
        for name, argtypes in signatures.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                if name == "ncclCommInitRankConfig":  # before 2.14: no config at all
                    self._has_config = False
                    continue
                raise NcclError(f"{self.path} has no {name}: not an NCCL/RCCL library?") from None
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [i], ctypes.c_char_p
        last = getattr(lib, "ncclGetLastError", None)  # 2.13+: the detail behind an error code
        if last is not None:
            last.argtypes, last.restype = [p], ctypes.c_char_p
        self._last_error = last

    def _check(self, result: int, call: str, comm=None) -> None:
        if result == 0:
            return
        text = self._lib.ncclGetErrorString(result)
        msg = f"{call} failed: {text.decode() if text else 'unknown error'} (ncclResult_t {result})"
        if self._last_error is not None:
            detail = self._last_error(comm)
            if detail:
                msg += f": {detail.decode(errors='replace')}"
        raise NcclError(msg)

    @property
    def version_string(self) -> str:
        return version_string(self.version)

    def get_unique_id(self) -> bytes:
        uid = UniqueId()
        self._check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)

    def comm_init_rank(self, world: int, unique_id: bytes, rank: int,
                       max_ctas: Optional[int] = None) -> ctypes.c_void_p:
        """A communicator on the current CUDA device (blocks until all `world` ranks joined)."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise NcclError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, not {len(unique_id)}")
        uid = UniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        if max_ctas is None:
            self._check(self._lib.ncclCommInitRank(ctypes.byref(comm), world, uid, rank),
                        "ncclCommInitRank")
            return comm
        config = make_config(self.version, max_ctas)
        if not self._has_config:
            raise NcclError(f"{self.path} has no ncclCommInitRankConfig: no CTA cap possible")
        self._check(self._lib.ncclCommInitRankConfig(ctypes.byref(comm), world, uid, rank,
                                                     ctypes.byref(config)),
                    f"ncclCommInitRankConfig(maxCTAs={max_ctas})")
        return comm

    def all_reduce(self, comm, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        self._check(self._lib.ncclAllReduce(send, recv, count, dtype, _SUM, comm, stream),
                    "ncclAllReduce", comm)

    def all_gather(self, comm, send: int, recv: int, send_count: int, dtype: int, stream: int) -> None:
        self._check(self._lib.ncclAllGather(send, recv, send_count, dtype, comm, stream),
                    "ncclAllGather", comm)

    def reduce_scatter(self, comm, send: int, recv: int, recv_count: int, dtype: int,
                       stream: int) -> None:
        self._check(self._lib.ncclReduceScatter(send, recv, recv_count, dtype, _SUM, comm, stream),
                    "ncclReduceScatter", comm)

    def comm_destroy(self, comm) -> None:
        self._check(self._lib.ncclCommDestroy(comm), "ncclCommDestroy")


_LIBRARY: Optional[NcclLibrary] = None


def library() -> NcclLibrary:
    """The process's one NcclLibrary, loaded on first use."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = NcclLibrary()
    return _LIBRARY


def nccl_dtype(dtype: torch.dtype) -> int:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise NcclError(f"NCCL has no reduction type for {dtype}") from None


class NcclComm:
    """One NCCL/RCCL communicator of FarSkip's own, on one device. Its collectives run on the
    current stream of that device, sum only, and need contiguous tensors on it."""

    def __init__(self, world: int, rank: int, unique_id: Optional[bytes], device,
                 max_ctas: Optional[int] = None, lib: Optional[NcclLibrary] = None):
        self.lib = lib or library()
        self.world, self.rank = world, rank
        self.device = torch.device(device)
        if unique_id is None:
            if world != 1:
                raise NcclError("a communicator over several ranks needs the unique id of rank 0")
            unique_id = self.lib.get_unique_id()
        with torch.cuda.device(self.device):  # NCCL binds the communicator to the current device
            self._comm = self.lib.comm_init_rank(world, unique_id, rank, max_ctas)

    @classmethod
    def from_group(cls, cpu_group, device, *, max_ctas: Optional[int] = None,
                   lib: Optional[NcclLibrary] = None) -> "NcclComm":
        """Over the ranks of a gloo `cpu_group` (rank 0 of it makes the id and broadcasts it);
        None: one rank."""
        import torch.distributed as dist

        lib = lib or library()
        if cpu_group is None:
            return cls(1, 0, None, device, max_ctas, lib)
        world, rank = dist.get_world_size(cpu_group), dist.get_rank(cpu_group)
        raw = torch.zeros(UNIQUE_ID_BYTES, dtype=torch.uint8)
        if rank == 0:
            raw.copy_(torch.frombuffer(bytearray(lib.get_unique_id()), dtype=torch.uint8))
        dist.broadcast(raw, src=dist.get_process_group_ranks(cpu_group)[0], group=cpu_group)
        return cls(world, rank, bytes(raw.tolist()), device, max_ctas, lib)

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _check_tensor(self, t: torch.Tensor, what: str) -> None:
        if t.device != self.device:
            raise NcclError(f"{what} is on {t.device}, the communicator on {self.device}")
        if not t.is_contiguous():
            # NCCL reads data_ptr() .. data_ptr() + numel(): a strided view would mix in other bytes.
            raise NcclError(f"{what} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")

    def all_reduce_(self, t: torch.Tensor) -> None:
        self._check_tensor(t, "all_reduce_ tensor")
        self.lib.all_reduce(self._comm, t.data_ptr(), t.data_ptr(), t.numel(), nccl_dtype(t.dtype),
                            self._stream())

    def all_gather_(self, out: torch.Tensor, t: torch.Tensor) -> None:
        self._check_tensor(out, "all_gather_ output")
        self._check_tensor(t, "all_gather_ input")
        if out.numel() != t.numel() * self.world or out.dtype != t.dtype:
            raise NcclError(f"all_gather_ output must hold {self.world} x {t.numel()} {t.dtype}, "
                            f"not {out.numel()} {out.dtype}")
        self.lib.all_gather(self._comm, t.data_ptr(), out.data_ptr(), t.numel(), nccl_dtype(t.dtype),
                            self._stream())

    def reduce_scatter_(self, out: torch.Tensor, t: torch.Tensor) -> None:
        self._check_tensor(out, "reduce_scatter_ output")
        self._check_tensor(t, "reduce_scatter_ input")
        if t.numel() != out.numel() * self.world or out.dtype != t.dtype:
            raise NcclError(f"reduce_scatter_ input must hold {self.world} x {out.numel()} "
                            f"{out.dtype}, not {t.numel()} {t.dtype}")
        self.lib.reduce_scatter(self._comm, t.data_ptr(), out.data_ptr(), out.numel(),
                                nccl_dtype(t.dtype), self._stream())

    def destroy(self) -> None:
        """Free the communicator (after every collective on it has finished)."""
        if self._comm is not None:
            self.lib.comm_destroy(self._comm)
            self._comm = None
