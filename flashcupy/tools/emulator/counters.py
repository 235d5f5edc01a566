"""What a counted launch asks of memory: the emulator's performance counters and their model.

``EmulatedModule(..., counters=True)`` builds the module so that every load and store the kernel
makes calls the runtime first (g++'s ``-fsanitize=kernel-address`` instrumentation, used only for
its callbacks), and each launch of its functions leaves a ``Counters`` in ``kern.last_counters``
(and in every ``recording()`` list open at the time). A module built without it is the ordinary
build, byte for byte: counting costs nothing when it is off.

The model (runtime/counters.h, ``note`` and ``evaluate``)
--------------------------------------------------------
Warp-wide requests. A lane's n-th execution of one memory instruction (its call site in the
compiled kernel) is grouped with the n-th execution of that instruction by the other lanes of its
warp, and the group is one warp-wide request, as converged SIMT lanes issue it; lanes that skip the
instruction are inactive in it. Loads and stores are counted as g++ compiles them (at -O1, the
build's level): nvcc may merge or split accesses differently (vectorised loads, values kept in
registers), so the plain ld/st counts of the SIMT kernels are an approximation. ldmatrix and
cp.async are counted as the instructions they are. Accesses to a thread's stack and to kernel
parameters are not memory traffic here and are not counted.

Shared memory: 32 banks of 4 bytes; a bank serves one 4-byte word per wavefront (cycle), and lanes
reading the same word share it (broadcast). A request is served in phases, each of which needs
as many wavefronts as the most distinct words any one bank holds among the phase's accesses:
- ld/st of up to 4 bytes a lane: one phase of 32 lanes; 8 bytes: two phases of 16 lanes; 16 bytes
  (and cp.async's 16-byte shared write): four phases of 8 lanes (quarter warps), so each phase asks
  for at most 128 bytes, what 32 banks give in one wavefront (CUDA C++ Programming Guide, "Shared
  Memory" of compute capability 5.x and later; the Nsight Compute "Memory Workload Analysis"
  counts wavefronts the same way);
- ldmatrix: one phase per 8x8 matrix, whose 8 row addresses (lanes 8m .. 8m+7, 16 bytes each)
  are one 128-byte access (PTX ISA, "Warp-level matrix load instruction: ldmatrix").
Shared memory returns 128 bytes a clock per SM, so a 16-byte load needs at least 4 requests per
instruction (NVIDIA's answer in forums.developer.nvidia.com/t/unexpected-shared-memory-bank-
conflict/77228, which also describes a case this model leaves out: on sm_70-75, lanes paired on one
address let LDS.128 return in 2 requests instead of 4).
``ideal`` is one wavefront per non-empty phase (more when a phase asks for more than 32 distinct
words), so ``conflicts = wavefronts - ideal``: extra wavefronts, 0 for a conflict-free request, 1
for a 2-way conflict of 32 lanes, 31 for a 32-way one. Bank numbers are taken from offsets in the
shared window (dynamic shared memory from its start; static __shared__ objects from the start of
the emulator's shared section, where g++ lays them out, not nvcc).

Global memory: a request costs the number of distinct 32-byte sectors its lanes' bytes fall in
(coalescing); ``ideal`` is the sectors of the distinct bytes it asks for, so ``excess_sectors`` is 0
for a fully coalesced request and a strided one pays a sector per lane. Sector boundaries are
counted from the start of each argument's bytes, as if each argument began 256-byte aligned, as
CuPy's allocations do. cp.async counts twice: its global read (``cp_async_global``; none for a
zero-fill copy with src-size 0) and its shared write (``cp_async_shared``).

Barriers: ``__syncthreads()`` completed, once per CTA per barrier. mma: ``mma.sync`` instructions,
one per warp. What this cannot show: caches (L1, L2: every sector is counted as requested, not as
fetched from HBM), latency, overlap, issue rates; it is a model of traffic, not of time.

The sm_90 instructions (runtime/wgmma.h, tma.h, hopper.h)
---------------------------------------------------------
wgmma: ``wgmma.mma_async`` issued, one per warpgroup (its 128 threads issue it together); of them
``wgmma_rs`` with A from registers. ``wgmma_flops``: 2 * 64 * N * 16 for each m64nNk16, so a
kernel's FLOPs are known whatever its shapes. ``wgmma_shared_bytes``: the operand bytes each reads
from shared memory, 16-bit elements: A (64 x 16, 2048 bytes) for the SS form, none for RS; B
(N x 16) for both. They are not wavefronts: wgmma reads its operands through its own path (the 128B
swizzle makes the lines conflict-free), so they are bytes, not costed as ld.shared requests.

TMA: each ``cp.async.bulk.tensor`` box is one request in two rows of ``access``: its shared side
(``tma_load_shared``: bytes a load writes; ``tma_store_shared``: bytes a store, or a bulk reduce-add
of ``cp.reduce.async.bulk``, reads), costed at 128
bytes a wavefront (the unit moves whole swizzled lines; bank conflicts not modelled), and its global
side (``tma_load_global``, ``tma_store_global``): the bytes of the box's elements inside the tensor,
costed in 32-byte sectors as above (elements outside it are zero-filled or dropped and move none).
They are in neither SHARED nor GLOBAL, whose meaning is unchanged: TMA_SHARED and TMA_GLOBAL.

mbarrier: ``mbarrier_waits`` counts ``mbarrier.try_wait.parity`` per thread that executes it,
``mbarrier_blocked`` those of them that found the awaited phase not yet complete and blocked. Which
waits block depends on the emulator's schedule (its thread order, TMA landing at issue), not on a
GPU's timing: a sign of where a pipeline waits, not a measurement. ``named_barriers``: named-barrier
instances completed (``bar.sync`` / ``bar.arrive`` of one id reaching its count), like ``barriers``.

ex2: ``ex2.approx`` executed (tensor_core.cuh's ex2_approx: the softmax's exponentials), per thread:
results of the MUFU unit, whose throughput perfmodel.py takes from tools/hardware.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

# the order of runtime.cpp's enum Category
CATEGORIES = ("shared_load", "shared_store", "ldmatrix", "cp_async_shared",
              "global_load", "global_store", "cp_async_global",
              "tma_load_shared", "tma_load_global", "tma_store_shared", "tma_store_global")
SHARED = CATEGORIES[:4]      # ordinary shared-memory instructions: wavefronts, bank conflicts
GLOBAL = CATEGORIES[4:7]     # the instructions of the threads: sectors, coalescing
TMA_SHARED = ("tma_load_shared", "tma_store_shared")
TMA_GLOBAL = ("tma_load_global", "tma_store_global")
# the counts after `access`, in the order of runtime.cpp's EmuCounters
SCALARS = ("barriers", "mma", "ctas", "warps", "wgmma", "wgmma_rs", "wgmma_flops", "wgmma_shared_bytes",
           "mbarrier_waits", "mbarrier_blocked", "named_barriers", "ex2")
FIELDS = ("requests", "bytes", "cost", "ideal")  # cost: wavefronts (shared) or sectors (global)
MMA_FLOPS = 2 * 16 * 8 * 16  # one m16n8k16


@dataclass(frozen=True)
class Counters:
    """One launch's counters (or a sum or difference of them).

    access[category] = (requests, bytes, cost, ideal) for each of CATEGORIES; the other fields are
    SCALARS (the module's docstring says what each counts).
    """

    access: dict
    barriers: int = 0
    mma: int = 0
    ctas: int = 0
    warps: int = 0
    wgmma: int = 0
    wgmma_rs: int = 0
    wgmma_flops: int = 0
    wgmma_shared_bytes: int = 0
    mbarrier_waits: int = 0
    mbarrier_blocked: int = 0
    named_barriers: int = 0
    ex2: int = 0

    def get(self, category: str, what: str) -> int:
        return self.access[category][FIELDS.index(what)]

    def total(self, categories, what: str) -> int:
        return sum(self.get(c, what) for c in categories)

    def conflicts(self, categories=SHARED) -> int:
        """Extra shared-memory wavefronts (bank conflicts) in these categories."""
        if isinstance(categories, str):
            categories = (categories,)
        return self.total(categories, "cost") - self.total(categories, "ideal")

    def excess_sectors(self, categories=GLOBAL) -> int:
        """Global sectors fetched beyond those the requested bytes need (uncoalesced accesses)."""
        if isinstance(categories, str):
            categories = (categories,)
        return self.total(categories, "cost") - self.total(categories, "ideal")

    def sectors_per_request(self, categories) -> float:
        if isinstance(categories, str):
            categories = (categories,)
        requests = self.total(categories, "requests")
        return self.total(categories, "cost") / requests if requests else 0.0

    @property
    def shared_bytes(self) -> int:
        """Bytes moved to or from shared memory: ld/st shared, ldmatrix, cp.async's writes."""
        return self.total(SHARED, "bytes")

    @property
    def wavefronts(self) -> int:
        return self.total(SHARED, "cost")

    @property
    def global_bytes(self) -> int:
        return self.total(GLOBAL, "cost") * 32  # as sectors move them

    def _combine(self, other: "Counters", sign: int) -> "Counters":
        access = {c: tuple(a + sign * b for a, b in zip(self.access[c], other.access[c])) for c in CATEGORIES}
        return Counters(access, **{name: getattr(self, name) + sign * getattr(other, name) for name in SCALARS})

    def __add__(self, other: "Counters") -> "Counters":
        return self._combine(other, 1)

    def __sub__(self, other: "Counters") -> "Counters":
        return self._combine(other, -1)

    def scaled(self, factor: float) -> dict:
        """Every count divided by `factor` (e.g. per (query block, key block) pass), as a flat dict."""
        flat = {f"{c}.{w}": self.get(c, w) / factor for c in CATEGORIES for w in FIELDS}
        flat.update({name: getattr(self, name) / factor for name in SCALARS if name not in ("ctas", "warps")})
        return flat

    @staticmethod
    def zero() -> "Counters":
        return Counters({c: (0, 0, 0, 0) for c in CATEGORIES})


@dataclass(frozen=True)
class LaunchCounters:
    """A counted launch: the kernel's name, its grid, block and dynamic shared memory, its Counters."""

    kernel: str
    grid: tuple
    block: tuple
    shared_mem: int
    counters: Counters = field(repr=False)


_recordings: list = []


def _record(launch: LaunchCounters) -> None:
    for log in _recordings:
        log.append(launch)


@contextlib.contextmanager
def recording():
    """Collect the LaunchCounters of every counted launch made inside the block, in order."""
    log: list = []
    _recordings.append(log)
    try:
        yield log
    finally:
        _recordings.remove(log)
