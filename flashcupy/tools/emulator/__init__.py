"""A CPU emulator for flashcupy's CUDA kernels: the very .cu files CuPy loads, run by g++.

Import as ``from flashcupy.tools.emulator import ...``. Infrastructure of a checkout, not of the
package: the tests, ``python -m flashcupy kernels --counters`` and the GPU session's dry run use it,
and the wheel leaves it out (setup.cfg), with its C++ runtime and headers. ``cupy.py`` runs the
cupy backend on it; ``counters.py`` is the counting build's model; the emulator's own test kernels
are tests/emulator_kernels/.

API
---
``EmulatedModule(code, name_expressions=(), options=(), *, thread_order="ascending", seed=0,
shared_mem_limit=48 KiB, stack_size=256 KiB, oob_guard="end", cp_async="deferred", counters=False)``
stands in for ``cupy.RawModule(code=..., name_expressions=..., options=...)``:

    mod = EmulatedModule(source, ["flash_fwd<float, 64>"], ("-DBLOCK_M=64",), thread_order="descending")
    kern = mod.get_function("flash_fwd<float, 64>")
    kern((blocks_x, blocks_y), (128,), (q, k, v, out, np.int32(n), np.float32(scale)), shared_mem=nbytes)

- ``code`` is compiled with ``g++ -std=c++20 -O1`` against the shim in ``include/`` (force-included
  ``cuda_emu.h``; ``#include <cuda_fp16.h>`` / ``<cuda_bf16.h>`` resolve to the shim's), linked with
  ``runtime.cpp`` (one translation unit with its parts in ``runtime/``) into a shared library loaded
  with ctypes. Builds are cached by a hash of (source, name expressions, defines, include-dir
  headers, arch, compiler, emulator sources) under
  ``$FLASHCUPY_EMULATOR_CACHE`` or ``$TMPDIR/flashcupy-emulator-$UID``, so a specialisation compiles
  once, across test sessions too.
- ``options``: ``-D NAME=VALUE``/``-DNAME=VALUE``/``--define-macro=``, ``-I dir``/``-Idir``/
  ``--include-path=``, ``-arch=sm_XY``/``--gpu-architecture=`` (sets ``__CUDA_ARCH__``, default 900)
  and ``-ftz=true|false``/``--ftz=`` (flush subnormals to zero; ``--use_fast_math`` implies
  ``-ftz=true``, as in NVRTC; CuPy always passes ``-ftz=true``) are honoured; every other flag
  (``-std=...``, the rest of ``--use_fast_math``, ...) is ignored.
  ``__CUDACC__`` and ``__CUDACC_RTC__`` are defined, as under NVRTC.
- ``name_expressions``: plain ``extern "C"`` names or template instantiations (``flash_fwd<float, 64>``).
  Each gets a generated trampoline that deduces the parameter types from the kernel's function
  pointer. ``get_function`` of a name not listed rebuilds the module with it added (one more compile).
- The function object is called like ``cupy.RawKernel``: ``kern(grid, block, args, *, shared_mem=0)``;
  grid and block are ints or 1- to 3-tuples. Array arguments are NumPy arrays of any strides (negative
  too, views with offsets); the bytes a view spans are copied into a guarded buffer, the kernel gets
  the guarded address of the view's first element, and changed bytes are copied back after the launch.
  Arrays whose spans overlap share one buffer, so aliasing behaves as on a GPU. Scalars are NumPy
  scalars passed by value (Python int -> int64, float -> float64, as CuPy converts them). The arity,
  and each argument's kind and size (array vs pointer, itemsize vs pointee size, scalar dtype vs
  parameter type), are checked before the launch: ``LaunchError`` names the kernel and the argument.
- ``kern.max_dynamic_shared_size_bytes`` (CuPy's attribute) starts at ``shared_mem_limit`` (48 KiB)
  and may be raised to ``SHARED_MEM_OPTIN_MAX`` (227 KiB); a launch requesting more is a
  ``LaunchError``. Block size (<= 1024 threads, z <= 64) and grid limits are checked too.
- ``thread_order`` is one of ``THREAD_ORDERS = ("ascending", "descending", "shuffled", "warp_skew")``:
  the order in which the threads of a block run between blocking points, and the order of the blocks.
  "shuffled" draws a fresh permutation (from ``seed``) for every pass. Run correctness tests under at
  least ascending and descending: a missing ``__syncthreads()`` shows up as a wrong answer under one
  of them. Under those three, every warp collective of a block completes in the same pass, so warps
  that meet at warp collectives (mma, ldmatrix, shuffles) move in lockstep; "warp_skew" runs one warp
  at a time, the last first, each as far as it can go before the next starts (descending lanes), so
  warps drift as far apart as the barriers allow. Kernels built on warp collectives need it to show
  a missing barrier between warps.
- ``cp_async`` (one of ``CP_ASYNC_MODES``): when the copies of ``cp.async`` (``emu_tensor_core.h``)
  write shared memory: "deferred" (default) at the ``cp.async.wait_group`` that completes them, so a
  missing wait reads stale memory; "eager" when issued, so a prefetch into a buffer that other warps
  still read lands at once (with "warp_skew", a missing barrier before the prefetch gives a wrong
  answer). A GPU may do either; test both. The TMA loads of ``cp.async.bulk.tensor`` (``emu_tma.h``)
  follow the same mode: "deferred" lands a box when a thread waits on its mbarrier, "eager" at issue, so
  that a ring stage released (its empty barrier arrived on) before the wgmma reading it has landed
  gives that wgmma the next tile. In either mode a thread that exits with copies it never
  waited for (``cp.async.wait_group``) is a ``KernelError``: a CTA's copies may still be landing
  after it exits, in shared memory that the next CTA on the SM may already own.
- ``stack_size`` is each CUDA thread's stack; ``ucontext=True`` forces the portable fiber switch
  (glibc ucontext) that machines other than x86-64 use, so it can be tested here.
- ``time_limit`` (default 600): seconds of CPU time one launch may use; past it the launch stops with
  a ``KernelError`` naming the thread that was running (a thread spinning on a flag that another
  thread sets never yields to it here). ``None``: no limit.
- ``garbage(shape, dtype)``: an array of 0xFF bytes (NaN, or -1), for outputs a kernel must fully write.
- ``counters=True`` builds the module to count its memory traffic (a separate build: g++'s
  kernel-address instrumentation calls the runtime before every load and store), and each launch
  leaves a ``Counters`` in ``kern.last_counters``: shared-memory bytes and wavefronts (bank
  conflicts), global sectors per request, barriers and mma.sync; on sm_90, wgmma (with FLOPs and the
  shared-memory operand bytes), TMA boxes (shared bytes, global sectors), mbarrier waits (and those
  that blocked) and named barriers; and ex2.approx. ``counters.recording()`` collects every counted
  launch in a block. ``counters.py`` documents the model.

Execution model
---------------
Blocks run one after another, but for a block whose threads all wait and some of them in
``flag_wait_at_least`` (hopper.cuh: an int in global memory that another CTA raises): it is parked (its
shared memory, stacks and per-block state kept aside) and resumed, in the same shared memory, once the
int has reached the value (runtime/grid.h); parked blocks nothing can wake are a ``DeadlockError``. So a
kernel that orders its CTAs' work through such flags gives the same result in every block order. Each CUDA thread is a fiber (hand-written x86-64 stack switch; ucontext
on other machines) with its own stack of ``stack_size`` bytes and a guard page below it. A fiber runs
until ``__syncthreads()`` (waits for every live thread of the block), a warp collective (``__syncwarp``,
``__shfl_sync``, ``__shfl_up/down/xor_sync``: waits for every live lane named in the mask, then
exchanges and continues), an sm_90 wait (below) or the end of the kernel; a thread that has returned
drops out of later barriers, as on a GPU. Static ``__shared__`` objects (one per block, as
static storage in a dedicated section) and dynamic shared memory are filled with 0xFF at the start of
every block, and locals start as garbage (``-ftrivial-auto-var-init=pattern``), so reading
uninitialised memory gives wrong answers.

Errors (all subclasses of ``EmulatorError``): ``CompileError`` (g++ diagnostics), ``LaunchError``
(invalid launch), ``KernelError`` (with ``.kernel``, ``.block``, ``.thread``): ``OutOfBoundsError``
(``.argument``, ``.access``), ``DeadlockError``; a failed ``assert``, ``__trap()``, integer division
by zero, a stack overflow or a misused warp collective are ``KernelError``.

Hopper (sm_90) synchronisation, wgmma and TMA
----------------------------------------------
``flashcupy/backends/cupy_backend/kernels/hopper.cuh`` wraps one PTX instruction per function; under
the emulator ``include/emu_hopper.h`` (which it includes when ``FLASHCUPY_EMULATOR`` is defined)
provides the same names, modelled in runtime.cpp (its part runtime/hopper.h):

- mbarrier: per block, by shared address, the phase, the arrivals pending of the init count and the
  tx-count (``arrive.expect_tx`` adds bytes; ``complete_tx``, hopper.cuh's and the hook a TMA model
  calls, subtracts them); a phase completes when both reach zero. ``try_wait.parity p`` returns at once
  if the phase of parity p has completed, else blocks until it does (it never returns false). Use
  before init, one arrival too many, an init count outside [1, 2^20 - 1] are ``KernelError``.
- named barriers ``bar.sync`` / ``bar.arrive`` (id, count): ids 1..15 (0 is ``__syncthreads()``'s),
  counts positive multiples of 32 no larger than the block, the same count for every arrival of one
  instance; counted per thread (a GPU counts whole warps).
- ``elect.sync``: a warp collective; the lowest live lane of the mask is elected.
- ``setmaxnreg.{inc,dec}``: the 128 threads of a warpgroup meet; the count must be a multiple of 8
  in [24, 256], the same in every warp, and not lower (.inc) or raise (.dec) the warpgroup's last
  one. The register file itself is not modelled (nor that ptxas drops it without a register cap).
- wgmma (``include/emu_wgmma.h`` says exactly what is modelled, ``runtime/wgmma.h``
  models it): ``mma_async`` m64nNk16 f32 from f16/bf16, SS and RS, K-major or transposed operands, is
  a warpgroup rendezvous (the 128 threads issue the same instruction, or a ``KernelError`` names the
  warps that differ); each descriptor is decoded field by field (start address, LBO, SBO, base
  offset, swizzle none/32B/64B/128B) and a tile not aligned to its swizzle's repeat, a non-zero base
  offset, reserved bits, a zero LBO/SBO the layout uses, or an element outside shared memory is a
  ``KernelError`` naming the thread; so is an ``mma_async`` without a ``wgmma.fence`` since the
  thread's last ``wait_group``. The accumulators are NaN from issue until the ``wait_group`` that
  covers their commit group, when the result is computed (shared memory read then) and written;
  chained operations into the same accumulators take the previous result. ``smem_address`` gives
  dynamic shared memory addresses from 0 and static ones after it, keeping the low 10 bits.
- TMA (``include/emu_tma.h`` says exactly what is modelled, ``runtime/tma.h`` models it, ``tma.py``
  makes the maps): ``tma_load_2d/3d/4d`` (cp.async.bulk.tensor onto an mbarrier) copies the box at
  issue as the hardware lays it in shared memory (dense, dim 0 innermost, swizzled none/32B/64B/128B
  with the wgmma descriptor's XOR on the absolute shared address, so wgmma reads a 128B-swizzled box
  with a 128B descriptor), elements outside the tensor as zeros, then ``complete_tx`` of the whole
  box on the mbarrier; ``tma_store_Nd`` writes the box back, skipping elements outside the tensor
  (reading it at the ``wait_group`` that covers it, writing it at a ``wait_group`` without ``.read``
  or the block's end; ``bulk_reduce_add_f32`` the same).
- Flags between CTAs: ``flag_wait_at_least`` (ld.acquire.gpu in a loop) parks the block (above);
  ``flag_release_add`` (red.release.gpu) adds. A bulk reduce-add after a flag wait needs
  ``fence_proxy_async_global()`` between them, and a release needs the thread's bulk writes complete
  (``tma_store_wait_group<0>()``) and fenced the same way since: otherwise a ``KernelError``.
  The map argument is ``encode_tiled(array, box, swizzle)`` (box and any ``dims``/``strides``/
  ``element_strides`` innermost first, as ``cuTensorMapEncodeTiled``, whose argument checks it makes:
  ``TensorMapError`` names the argument); the launch guards the array like a pointer argument and
  packs the emulator's 128-byte map with the guarded address, 64-byte aligned, for the kernel's
  ``const __grid_constant__ TensorMap`` parameter. A destination not 128-byte (128B swizzle) or
  16-byte aligned, a box outside shared memory, a map reaching outside its array, a map of another
  rank or not made by ``encode_tiled`` are ``KernelError`` naming the thread. ``tma.py`` documents
  the GPU path (cuda-bindings' ``cuTensorMapEncodeTiled``); the cupy backend does not use TMA yet.
- The async proxy (``include/emu_hopper.h`` states the model, ``runtime/proxy.h`` implements it):
  per byte of the block's shared memory (dynamic and static, by its ``smem_address``), the thread
  that last wrote it with an ordinary store (or a cp.async landing) and whether that thread has
  executed ``fence.proxy.async`` (``fence_proxy_async()``) since. A wgmma operand read (when the
  operation completes) or a TMA store's source read of a byte whose last ordinary write its own
  writer has not fenced is a ``KernelError`` naming the kernel, the writer (the reported thread),
  the reader, the byte's shared address and the instruction; a fence in another thread does not
  count. A TMA load's bytes are async-written: ordinary reads of them after the mbarrier wait are
  legal (reads are not checked), an ordinary write over them needs a fence again before an async
  read. Stores are seen through store-only ``-fsanitize=kernel-address`` callbacks, compiled in
  only for modules that include ``hopper.cuh`` (from the source or a header in an ``-I``
  directory): every other module is built as before and pays nothing.
- A block whose live threads all wait, none able to go on, is a ``DeadlockError`` naming every
  mbarrier waited on (shared-memory offset, phase, arrivals and tx-count outstanding), named barrier
  and warpgroup rendezvous.

Out-of-bounds detection
-----------------------
Each argument buffer sits between two PROT_NONE pages, flush against the upper one
(``oob_guard="end"``, default) or the lower one (``"start"``). A fault is caught by a SIGSEGV handler
on an alternate signal stack, which siglongjmps back to the launcher; the fault address names the
argument, the element offset from the pointer passed, read vs write, and the block and thread.
On the other side of the buffer, the slack up to the page boundary holds 0xFF: a write there is
reported after the launch (without the thread), a read returns garbage. Accesses more than a page
away from any buffer are reported as wild pointers. Dynamic shared memory ends (16-byte aligned)
against a guard page too; a write into the slack before or after it is reported after the block.

Not faithful (by design or not yet)
-----------------------------------
- Floating point: intrinsics such as ``__expf`` are exact, ``--use_fast_math`` is ignored but for
  its ``-ftz=true``, and g++ does not contract ``a*b+c`` into FMAs. Compare with tolerances. With
  ``-ftz=true`` a launch runs with the CPU's flush-to-zero (x86-64: MXCSR's FTZ and DAZ; AArch64:
  FPCR.FZ), which flushes float32 subnormal operands and results as CUDA does, but float64 ones too,
  which CUDA keeps (``-ftz`` is about single precision only); and conversions to bfloat16 see a
  float32 subnormal as zero. Without ``-ftz=true`` nothing is flushed.
- Memory is sequentially consistent and atomics are trivially atomic; weak-memory effects and races
  inside one blocking-point interval are only exposed through the thread order.
- Warps are not lockstep (the Volta+ model): warp-synchronous code without ``__syncwarp`` may fail,
  as it may on a modern GPU. Lanes named in a mask that have exited or do not exist are left out of
  the collective; a shuffle reading such a lane receives garbage.
- Cooperative fibers: a thread or block spinning on a flag set by another never finishes, unless it
  waits through ``flag_wait_at_least`` (above).
- Static ``__shared__`` size is not counted against the shared-memory limit; static shared memory
  has no guard pages. Underflow reads just before dynamic shared memory are not caught.
- sm_90: a TMA load lands when a thread waits on its mbarrier (include/emu_tma.h), not at issue.
  Not modelled yet: L2 promotion, interleaved maps, NaN OOB fill, im2col, reduce-adds and multicast,
  clusters, wgmma's base offset and its timing.
- Modules are built with ``-fno-gnu-unique``: a template kernel's static ``__shared__`` objects would
  otherwise be bound, across modules that instantiate the same kernel (a test's mutant beside the
  original), to the first module's.
- Not provided: ``__half2``/``__nv_bfloat162`` and h* intrinsics, ``__ballot_sync`` and friends,
  cooperative groups, inline PTX, textures, ``RawModule.get_global``, streams (ignored). The inline PTX
  that ``flashcupy/backends/cupy_backend/kernels/tensor_core.cuh`` wraps (mma.sync m16n8k16,
  ldmatrix, cp.async, ex2.approx, cvt to f16x2/bf16x2) is provided under the same function names by
  ``include/emu_tensor_core.h``, which that header includes when ``FLASHCUPY_EMULATOR`` is defined
  (``cuda_emu.h`` defines it); that file says what is and is not bit-faithful.
- g++ ignores the section attribute on the static locals of function templates, so the link step
  gathers them into the shared section with ``include/emu_shared.ld``: ``__shared__`` arrays of
  kernel templates are refilled with garbage per block and count as shared memory for
  ``cp.async``/``ldmatrix`` like any other (``test_static_shared_memory_of_a_template_...``).
"""

from .driver import (
    CP_ASYNC_MODES,
    SHARED_MEM_DEFAULT,
    SHARED_MEM_OPTIN_MAX,
    THREAD_ORDERS,
    CompileError,
    DeadlockError,
    EmulatedFunction,
    EmulatedModule,
    EmulatorError,
    KernelError,
    LaunchError,
    OutOfBoundsError,
    cache_dir,
    garbage,
)
from .tma import TensorMap, TensorMapError, encode_tiled

__all__ = [
    "CP_ASYNC_MODES",
    "SHARED_MEM_DEFAULT",
    "SHARED_MEM_OPTIN_MAX",
    "THREAD_ORDERS",
    "CompileError",
    "DeadlockError",
    "EmulatedFunction",
    "EmulatedModule",
    "EmulatorError",
    "KernelError",
    "LaunchError",
    "OutOfBoundsError",
    "TensorMap",
    "TensorMapError",
    "cache_dir",
    "encode_tiled",
    "garbage",
]
