"""The CUDA emulator itself, on small kernels in tests/emulator_kernels/, against NumPy.

Each kernel file says what it computes; each test compares real numbers, or
checks that a deliberate bug (missing barrier, off-by-one, wrong arguments)
is reported with the kernel's name.
"""

import os
import time

import numpy as np
import pytest

from flashcupy.tools.emulator import (
    SHARED_MEM_OPTIN_MAX,
    THREAD_ORDERS,
    CompileError,
    DeadlockError,
    EmulatedModule,
    KernelError,
    LaunchError,
    OutOfBoundsError,
    garbage,
)

KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "emulator_kernels")
TWO_ORDERS = ("ascending", "descending")


def source(name):
    with open(os.path.join(KERNELS, name)) as f:
        return f.read()


def kernel(file, name, options=(), **kw):
    return EmulatedModule(source(file), [name], options, **kw).get_function(name)


# ----------------------------------------------------------------------------
# barriers and thread order


def block_sum(x, order, options=()):
    out = garbage(-(-x.size // 128), np.float32)
    kernel("block_reduce.cu", "block_sum", options, thread_order=order)((out.size,), (128,), (x, out, np.int32(x.size)))
    return out


def block_sum_numpy(x):
    padded = np.zeros(-(-x.size // 128) * 128, np.float32)
    padded[:x.size] = x
    return padded.reshape(-1, 128).sum(axis=1)


@pytest.mark.parametrize("order", THREAD_ORDERS)
def test_block_reduction_is_right_under_every_order(order, rng):
    x = rng.standard_normal(1000).astype(np.float32)
    np.testing.assert_allclose(block_sum(x, order), block_sum_numpy(x), rtol=1e-5, atol=1e-5)


def test_missing_barrier_gives_a_wrong_answer_under_one_of_two_orders(rng):
    x = rng.standard_normal(1000).astype(np.float32)
    want = block_sum_numpy(x)
    right = [np.allclose(block_sum(x, order, ("-DMISSING_BARRIER",)), want, rtol=1e-5, atol=1e-5)
             for order in TWO_ORDERS]
    assert not all(right), "the race went unnoticed under both orders"


@pytest.mark.parametrize("seed", [1, 2])
def test_shuffled_order_is_seeded(seed, rng):
    x = rng.standard_normal(1000).astype(np.float32)
    k = kernel("block_reduce.cu", "block_sum", thread_order="shuffled", seed=seed)
    outs = []
    for _ in range(2):
        out = garbage(8, np.float32)
        k((8,), (128,), (x, out, np.int32(x.size)))
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], block_sum_numpy(x), rtol=1e-5, atol=1e-5)


def test_twenty_barriers_128_threads_64_blocks_well_under_a_second(rng):
    """Speed: 64 blocks x 128 threads x 20 barriers (about 170k fiber switches)."""
    x = rng.standard_normal(64 * 128).astype(np.float32)
    y = garbage(x.shape, np.float32)
    k = kernel("block_reduce.cu", "neighbour_rounds")
    k((64,), (128,), (x, y))  # warm-up
    start = time.perf_counter()
    k((64,), (128,), (x, y))
    elapsed = time.perf_counter() - start
    want = x.reshape(64, 128).copy()
    for _ in range(10):
        want = np.float32(0.5) * np.roll(want, -1, axis=1) + want
    np.testing.assert_array_equal(y.reshape(64, 128), want)
    assert elapsed < 0.5, f"{elapsed:.3f} s"


def test_ucontext_fibers_give_the_same_answer(rng):
    x = rng.standard_normal(300).astype(np.float32)
    out = garbage(3, np.float32)
    kernel("block_reduce.cu", "block_sum", ucontext=True)((3,), (128,), (x, out, np.int32(x.size)))
    np.testing.assert_allclose(out, block_sum_numpy(x), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# warps

WARP_TYPES = {np.float32: "float", np.float64: "double", np.int32: "int"}


def warp_ops_numpy(x, src_lane):
    v = x.reshape(-1, 32)
    lane = np.arange(32)

    def butterfly(width):
        b = v.copy()
        m = width // 2
        while m:
            b = b + b[:, lane ^ m]
            m //= 2
        return b

    d = v.copy()
    for offset in (16, 8, 4, 2, 1):
        src = lane + offset
        d = d + np.where(src < 32, d[:, np.minimum(src, 31)], d)
    s = v.copy()
    for offset in (1, 2, 4, 8, 16):
        up = s[:, np.maximum(lane - offset, 0)]
        s = np.where(lane >= offset, s + up, s)
    broadcast = np.repeat(v[:, src_lane:src_lane + 1], 32, axis=1)
    return [a.reshape(-1) for a in (butterfly(32), butterfly(16), d, s, broadcast)]


@pytest.mark.parametrize("order", TWO_ORDERS)
@pytest.mark.parametrize("dtype", list(WARP_TYPES))
def test_warp_shuffles_match_numpy(dtype, order, rng):
    names = [f"warp_ops<{t}>" for t in WARP_TYPES.values()]
    module = EmulatedModule(source("warp_ops.cu"), names, (), thread_order=order)
    k = module.get_function(f"warp_ops<{WARP_TYPES[dtype]}>")
    x = (rng.standard_normal(256) * 100).astype(dtype)
    outs = [garbage(x.shape, dtype) for _ in range(5)]
    k((2,), (128,), (x, *outs, np.int32(5)))
    for got, want in zip(outs, warp_ops_numpy(x, 5)):
        np.testing.assert_array_equal(got, want)


def test_warp_collective_waiting_on_a_barrier_is_a_deadlock():
    x = np.ones(64, np.float32)
    with pytest.raises(DeadlockError, match="warp_misuse.*deadlock"):
        kernel("warp_ops.cu", "warp_misuse")((1,), (64,), (x, np.int32(0)))


def test_shuffle_mask_without_the_caller_is_reported():
    x = np.ones(32, np.float32)
    with pytest.raises(KernelError, match="warp_misuse.*mask 0x00000001.*lane 1"):
        kernel("warp_ops.cu", "warp_misuse")((1,), (32,), (x, np.int32(1)))


# ----------------------------------------------------------------------------
# shared memory


@pytest.mark.parametrize("order", THREAD_ORDERS)
def test_dynamic_shared_memory(order, rng):
    x = rng.standard_normal(200).astype(np.float32)
    y = garbage(x.shape, np.float32)
    k = kernel("shared_memory.cu", "reverse_blocks", thread_order=order)
    k((4,), (64,), (x, y, np.int32(x.size), np.int32(0)), shared_mem=64 * 4)
    want = np.concatenate([x, np.zeros(56, np.float32)]).reshape(4, 64)[:, ::-1].reshape(-1)[:200]
    np.testing.assert_array_equal(y, want)


def test_off_by_one_in_dynamic_shared_memory_is_caught(rng):
    x = rng.standard_normal(64).astype(np.float32)
    y = garbage(x.shape, np.float32)
    k = kernel("shared_memory.cu", "reverse_blocks")
    with pytest.raises(OutOfBoundsError, match=r"reverse_blocks.*thread \(63, 0, 0\).*write of dynamic shared"):
        k((1,), (64,), (x, y, np.int32(64), np.int32(1)), shared_mem=64 * 4)


@pytest.mark.parametrize("which", [0, 1], ids=["dynamic", "static"])
def test_shared_memory_starts_every_block_as_garbage(which):
    y = np.zeros(3 * 64, np.float32)
    kernel("shared_memory.cu", "stale_shared")((3,), (64,), (y, np.int32(which)), shared_mem=64 * 4)
    assert (y[:64] == 1).all()
    assert np.isnan(y[64:]).all()


def test_static_shared_memory_of_a_template_starts_every_block_as_garbage():
    y = np.zeros(3 * 64, np.float32)
    kernel("shared_memory.cu", "stale_shared_template<64>")((3,), (64,), (y,))
    assert (y[:64] == 1).all()
    assert np.isnan(y[64:]).all()


def test_static_shared_memory_of_a_module_with_templates_only_starts_every_block_as_garbage():
    # the SIMT kernels' case: no __shared__ object outside a template, so no input section is named
    # emu_shared and the linker script itself must bound the templates' statics (emu_shared.ld)
    code = """
    template <int N>
    __global__ void only_template(float* __restrict__ y) {
        __shared__ float tile[N];
        if (blockIdx.x == 0) tile[threadIdx.x] = 1.0f;
        __syncthreads();
        y[blockIdx.x * blockDim.x + threadIdx.x] = tile[threadIdx.x];
    }
    """
    y = np.zeros(2 * 64, np.float32)
    EmulatedModule(code, ["only_template<64>"]).get_function("only_template<64>")((2,), (64,), (y,))
    assert (y[:64] == 1).all()
    assert np.isnan(y[64:]).all()


def test_shared_memory_limit():
    x = np.zeros(64, np.float32)
    args = (x, x.copy(), np.int32(64), np.int32(0))
    k = kernel("shared_memory.cu", "reverse_blocks")
    with pytest.raises(LaunchError, match="reverse_blocks.*shared_mem=65536.*49152"):
        k((1,), (64,), args, shared_mem=64 * 1024)
    k.max_dynamic_shared_size_bytes = 100 * 1024  # opt in, as with CuPy
    k((1,), (64,), args, shared_mem=64 * 1024)
    with pytest.raises(LaunchError):
        k.max_dynamic_shared_size_bytes = SHARED_MEM_OPTIN_MAX + 1
    small = kernel("shared_memory.cu", "reverse_blocks", shared_mem_limit=128)
    with pytest.raises(LaunchError, match="limit of 128 bytes"):
        small((1,), (64,), args, shared_mem=256)


# ----------------------------------------------------------------------------
# global memory


@pytest.mark.parametrize("n", [17, 1024])
def test_out_of_bounds_read_is_caught_and_named(n, rng):
    x = rng.standard_normal(n).astype(np.float32)
    y = np.zeros(n, np.float32)
    k = kernel("memory.cu", "bounded_copy")
    with pytest.raises(OutOfBoundsError, match=r"'bounded_copy'.*read of argument 0 \(float32.*element offset "
                                               f"{n} ") as info:
        k((n // 64 + 1,), (64,), (x, y, np.int32(n + 1), np.int32(n)))
    assert info.value.argument == 0 and info.value.access == "read" and info.value.kernel == "bounded_copy"
    assert info.value.block == (n // 64, 0, 0) and info.value.thread == (n % 64, 0, 0)
    k((-(-n // 64),), (64,), (x, y, np.int32(n), np.int32(n)))  # the same kernel, in bounds
    np.testing.assert_array_equal(y, x)


def test_out_of_bounds_write_is_caught_and_named(rng):
    x = np.zeros(100, np.float32)
    y = np.zeros(99, np.float32)
    with pytest.raises(OutOfBoundsError, match=r"'bounded_copy'.*write of argument 1") as info:
        kernel("memory.cu", "bounded_copy")((2,), (64,), (x, y, np.int32(100), np.int32(100)))
    assert info.value.argument == 1 and info.value.access == "write"


def test_unguarded_side_catches_writes_after_the_launch():
    x = np.zeros(100, np.float32)
    y = np.zeros(99, np.float32)
    k = kernel("memory.cu", "bounded_copy", oob_guard="start")
    with pytest.raises(OutOfBoundsError, match=r"'bounded_copy'.*write after the bytes of argument 1.*after the launch"):
        k((2,), (64,), (x, y, np.int32(100), np.int32(100)))


@pytest.mark.parametrize("order", TWO_ORDERS)
def test_strided_and_negative_stride_views(order, rng):
    base_x = rng.standard_normal(300).astype(np.float32)
    base_y = rng.standard_normal(400).astype(np.float32)
    x = base_x[::-3]          # negative stride: the pointer is the last element of base_x
    y = base_y[7:][::2][:90]  # offset and stride 2
    n = 90
    want_y = base_y.copy()
    want_y[7:7 + 2 * n:2] = np.float32(1.5) * x[:n] + want_y[7:7 + 2 * n:2]
    k = kernel("memory.cu", "strided_axpy", thread_order=order)
    k((2,), (64,), (x, np.int64(x.strides[0] // 4), y, np.int64(y.strides[0] // 4), np.float32(1.5), np.int32(n)))
    np.testing.assert_array_equal(base_y, want_y)  # elements between y's are untouched


def mappings():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts mappings in Linux's /proc/self/maps")
def test_a_process_holds_the_fiber_stacks_of_one_module_only(rng):
    # Every module is its own library with its own pool of fiber stacks (two mappings each). One
    # pytest worker loads hundreds of modules; when each kept its stacks, CI's worker ran out of its
    # 65,530 mappings (vm.max_map_count) and crashed.
    x = rng.standard_normal(1024).astype(np.float32)
    y = np.zeros(1024, np.float32)
    counts = []
    for variant in range(4):  # the same kernel, four libraries (the build hash covers the source)
        k = EmulatedModule(source("memory.cu") + f"\n// variant {variant}\n", ["strided_axpy"]).get_function("strided_axpy")
        k((1,), (1024,), (x, np.int64(1), y, np.int64(1), np.float32(1.0), np.int32(1024)))
        counts.append(mappings())
    np.testing.assert_array_equal(y, 4 * x)
    assert counts[-1] - counts[0] < 1024, f"mappings after each module's launch: {counts}"


def test_aliased_arguments_share_memory(rng):
    y = rng.standard_normal(50).astype(np.float32)
    want = np.float32(2.0) * y + y
    kernel("memory.cu", "strided_axpy")((1,), (64,), (y, np.int64(1), y, np.int64(1), np.float32(2.0), np.int32(50)))
    np.testing.assert_array_equal(y, want)


def test_atomics_across_blocks(rng):
    n = 1000
    keys = rng.integers(0, 10, n).astype(np.int32)
    x = rng.standard_normal(n).astype(np.float32)
    hist = np.zeros(10, np.int32)
    fsum, dsum, imax = np.zeros(1, np.float32), np.zeros(1, np.float64), np.full(1, -100, np.int32)
    kernel("memory.cu", "atomics", thread_order="shuffled")((8,), (128,), (keys, x, np.int32(n), hist, fsum, dsum, imax))
    np.testing.assert_array_equal(hist, np.bincount(keys, minlength=10))
    assert imax[0] == keys.max() * 7 - 3
    np.testing.assert_allclose(dsum[0], x.astype(np.float64).sum(), rtol=1e-12)
    np.testing.assert_allclose(fsum[0], x.sum(dtype=np.float64), rtol=1e-4)


# ----------------------------------------------------------------------------
# launches and arguments


def test_argument_checks():
    x, y = np.zeros(4, np.float32), np.zeros(4, np.float32)
    k = kernel("memory.cu", "bounded_copy")
    with pytest.raises(LaunchError, match="'bounded_copy': takes 4 arguments, got 3"):
        k((1,), (4,), (x, y, np.int32(4)))
    with pytest.raises(LaunchError, match="argument 2 is a 4-byte signed integer parameter, got float32"):
        k((1,), (4,), (x, y, np.float32(4), np.int32(4)))
    with pytest.raises(LaunchError, match="argument 3 is a 4-byte signed integer parameter, got int64"):
        k((1,), (4,), (x, y, np.int32(4), 4))
    with pytest.raises(LaunchError, match="argument 0 points to 4-byte elements, got a float64"):
        k((1,), (4,), (x.astype(np.float64), y, np.int32(4), np.int32(4)))
    with pytest.raises(LaunchError, match="argument 1 is a pointer parameter"):
        k((1,), (4,), (x, np.float32(1), np.int32(4), np.int32(4)))
    with pytest.raises(LaunchError, match="2048 threads"):
        k((1,), (2048,), (x, y, np.int32(4), np.int32(4)))
    y.flags.writeable = False
    with pytest.raises(LaunchError, match="wrote into argument 1, a read-only"):
        k((1,), (4,), (np.ones(4, np.float32), y, np.int32(4), np.int32(4)))


def test_grid_and_block_coordinates():
    grid, block = (3, 2, 2), (4, 2, 3)
    threads, blocks = np.prod(block), np.prod(grid)
    out = garbage((blocks, threads, 12), np.uint32)
    kernel("numerics.cu", "coords", thread_order="shuffled")(grid, block, (out,))
    bz, by, bx, tz, ty, tx = np.meshgrid(*(np.arange(d) for d in grid[::-1] + block[::-1]), indexing="ij")
    want = np.stack([tx, ty, tz, bx, by, bz, *(np.full_like(tx, d) for d in block + grid)], axis=-1)
    np.testing.assert_array_equal(out, want.reshape(blocks, threads, 12))


def test_failed_assert_is_reported():
    k = kernel("numerics.cu", "checked")
    k((1,), (4,), (np.ones(4, np.float32),))
    with pytest.raises(KernelError, match=r"'checked' in block \(0, 0, 0\) thread \(2, 0, 0\): abort\(\)"):
        k((1,), (4,), (np.array([1, 1, -1, 1], np.float32),))


def test_stack_overflow_is_reported():
    with pytest.raises(KernelError, match="stack_hog.*stack overflow"):
        kernel("numerics.cu", "stack_hog")((1,), (2,), (np.ones(2, np.float32),))


def test_compile_error_carries_diagnostics():
    with pytest.raises(CompileError, match="undeclared_thing"):
        EmulatedModule('extern "C" __global__ void k(float* x) { x[0] = undeclared_thing; }', ["k"])


def test_defines_include_dirs_and_cache(tmp_path, rng):
    (tmp_path / "block.cuh").write_text("#define BLOCK 32\n")
    code = ('#include "block.cuh"\n#if __CUDA_ARCH__ != 800 || X != 3 || Y != 4\n#error options ignored\n#endif\n'
            + source("block_reduce.cu"))
    options = ("-std=c++17", "--use_fast_math", "-I", str(tmp_path), "-arch=sm_80", "-D", "X=3", "--define-macro=Y=4")
    x = rng.standard_normal(100).astype(np.float32)
    out = garbage(4, np.float32)
    EmulatedModule(code, ["block_sum"], options).get_function("block_sum")((4,), (32,), (x, out, np.int32(100)))
    np.testing.assert_allclose(out, np.pad(x, (0, 28)).reshape(4, 32).sum(1), rtol=1e-5, atol=1e-5)
    start = time.perf_counter()
    EmulatedModule(code, ["block_sum"], options)  # cached: no compile
    assert time.perf_counter() - start < 0.2


def test_modules_take_cuda_emu_h_precompiled(tmp_path, monkeypatch, rng):
    # one precompiled cuda_emu.h for the modules built with the same flags, which each module's build
    # takes: one that g++ finds but may not use is an error (-Werror=invalid-pch), so a module built
    # with the same flags after the header's PCH is spoilt fails, and one with other flags builds its own
    monkeypatch.setenv("FLASHCUPY_EMULATOR_CACHE", str(tmp_path))
    x = rng.standard_normal(256).astype(np.float32)
    out = garbage(2, np.float32)
    EmulatedModule(source("block_reduce.cu"), ["block_sum"]).get_function("block_sum")((2,), (128,), (x, out, np.int32(256)))
    np.testing.assert_allclose(out, x.reshape(2, 128).sum(1), rtol=1e-5, atol=1e-5)
    (pch,) = tmp_path.glob("pch-*/cuda_emu.h.gch")
    assert (pch.parent / "cuda_emu.h").resolve().read_bytes() == pch.parent.joinpath("cuda_emu.h").read_bytes()
    pch.write_bytes(b"gpch" + bytes(4096))  # not a header g++ can use
    with pytest.raises(CompileError, match="pch|precompiled"):
        EmulatedModule(source("block_reduce.cu") + "\n// another module\n", ["block_sum"])
    EmulatedModule(source("block_reduce.cu") + "\n// another module\n", ["block_sum"], ("-D", "X=1"))
    assert len(list(tmp_path.glob("pch-*/cuda_emu.h.gch"))) == 2


# ----------------------------------------------------------------------------
# numerics


def bf16_bits_numpy(x):
    """Round-to-nearest-even float32 -> bfloat16 bit patterns; NaN becomes the canonical 0x7fff."""
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FFF), rounded)


def f16_bits_numpy(x):
    with np.errstate(over="ignore"):
        return np.where(np.isnan(x), np.uint16(0x7FFF), x.astype(np.float16).view(np.uint16))


def test_half_and_bfloat16_round_trips(rng):
    edges = np.array([0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0001,
                      3 * 2.0**-26, 2.0**-14, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, np.inf, -np.inf, np.nan,
                      1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.0e38, -1e-40], np.float32)
    x = np.concatenate([edges, (rng.standard_normal(2000) * 10.0 ** rng.integers(-8, 6, 2000)).astype(np.float32),
                        rng.integers(0, 2**32, 2000, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    xd = np.concatenate([edges.astype(np.float64), rng.standard_normal(x.size - edges.size) * 1e3])
    n = x.size
    h, b, hd, h_square = (garbage(n, np.uint16) for _ in range(4))
    h_back, b_back = garbage(n, np.float32), garbage(n, np.float32)
    kernel("numerics.cu", "narrow")((-(-n // 128),), (128,), (x, xd, np.int32(n), h, b, h_back, b_back, hd, h_square))
    np.testing.assert_array_equal(h, f16_bits_numpy(x))
    np.testing.assert_array_equal(b, bf16_bits_numpy(x))
    np.testing.assert_array_equal(h_back, h.view(np.float16).astype(np.float32))
    np.testing.assert_array_equal(b_back, (b.astype(np.uint32) << 16).view(np.float32))
    np.testing.assert_array_equal(hd, f16_bits_numpy(xd))
    hf = h.view(np.float16)
    with np.errstate(all="ignore"):
        want_square = hf * hf + hf
    np.testing.assert_array_equal(h_square, f16_bits_numpy(want_square))


@pytest.mark.parametrize("options, flushed", [
    ((), False), (("-ftz=false",), False), (("--use_fast_math", "-ftz=false"), False),
    (("-ftz=true",), True), (("--ftz=true",), True), (("--use_fast_math",), True),
])
def test_ftz_flushes_float32_subnormals(options, flushed):
    tiny = np.finfo(np.float32).tiny  # the smallest normal float32
    x = np.array([1e-20, tiny / 4, tiny, -tiny / 8, 1.5 * tiny, 3.0], np.float32)
    y = np.array([1e-20, 2.0**60, 0.5, 0.0, -tiny, 4.0], np.float32)
    product, total = garbage(x.size, np.float32), garbage(x.size, np.float32)
    kernel("numerics.cu", "subnormal", options)((1,), (x.size,), (x, y, product, total))
    with np.errstate(under="ignore"):
        want_product, want_total = x * y, x + y
    if flushed:  # subnormal results: products 0 and 2, sums 3 and 4; subnormal operands: x[1], x[3]
        want_product[[0, 1, 2]] = 0.0
        want_total[[3, 4]] = 0.0
    np.testing.assert_array_equal(product, want_product)
    np.testing.assert_array_equal(np.signbit(product), np.signbit(want_product))
    np.testing.assert_array_equal(total, want_total)


def test_ftz_takes_true_or_false():
    with pytest.raises(ValueError, match="options: '-ftz=yes' must be -ftz=true or -ftz=false"):
        EmulatedModule(source("numerics.cu"), ["subnormal"], ("-ftz=yes",))


def test_umulhi_and_the_low_product_are_the_halves_of_the_64_bit_product(rng):
    n = 300
    a, b = (np.concatenate([[0, 1, 0xFFFFFFFF], rng.integers(0, 2**32, n - 3)]).astype(np.uint32) for _ in range(2))
    hi, lo = garbage((n,), np.uint32), garbage((n,), np.uint32)
    kernel("numerics.cu", "mulhi")((3,), (128,), (a, b, hi, lo, np.int32(n)))
    product = a.astype(np.uint64) * b.astype(np.uint64)
    np.testing.assert_array_equal(hi, (product >> np.uint64(32)).astype(np.uint32))
    np.testing.assert_array_equal(lo, (product & np.uint64(0xFFFFFFFF)).astype(np.uint32))


def test_maths_functions(rng):
    n = 500
    x = np.concatenate([[0.0, -1.0, np.inf, -np.inf, np.nan], rng.standard_normal(n - 5) * 10]).astype(np.float32)
    xd = x.astype(np.float64) / 3
    out = garbage((n, 16), np.float32)
    outd = garbage((n, 4), np.float64)
    kernel("numerics.cu", "maths")((4,), (128,), (x, xd, out, outd, np.int32(n)))
    a = np.abs(x)
    i = np.arange(n)
    with np.errstate(all="ignore"):
        want = [np.exp(x), np.exp2(x), np.exp(x), np.log(a), np.log2(a), np.fmax(x, 0.25), np.fmin(x, 0.25),
                np.sqrt(a), 1 / np.sqrt(a), np.where(np.isinf(x), 1, np.where(np.isnan(x), 2, 0)), -x,
                np.where(x > 0, np.inf, -np.inf), np.maximum(i, 7) + np.minimum(i, 7), np.fmax(x, 1), np.fmin(x, 1),
                x.astype(np.float64)[:, None] * np.arange(299, -1, -3) @ np.ones(100)]
        wantd = [np.exp(xd), np.exp2(xd), np.log(np.abs(xd)), np.fmax(xd, 0.5)]
    for column, w in enumerate(want):
        np.testing.assert_allclose(out[:, column], w.astype(np.float32), rtol=2e-6, atol=1e-4 * (column == 15),
                                   err_msg=f"column {column}")
    for column, w in enumerate(wantd):
        np.testing.assert_allclose(outd[:, column], w, rtol=1e-15, err_msg=f"double column {column}")
