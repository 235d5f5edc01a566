"""The one table of hardware figures the developer tools use.

Two kinds of figure, one lookup: an architecture's per-SM limits (`Sm`, in `SMS` by "sm_XY"), which
the NVRTC report's occupancy takes (tools/nvrtc.py), and a GPU's roofline figures (`Gpu`, in `GPUS`),
which the performance model takes (tools/perfmodel.py); each GPU names its architecture, so
`gpu.sm` is the other half of the same row. No runtime code reads this: the kernels' own limits
(tiles, shared memory, grid sizes) are in backends/cupy_backend/specs.py and backends/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sm:
    """Per-SM limits of an architecture, for occupancy."""

    threads: int        # resident threads
    ctas: int           # resident CTAs
    registers: int      # 32-bit registers
    smem: int           # shared memory for CTAs, bytes
    smem_reserved: int  # shared memory the driver reserves per CTA, bytes


# Per-SM limits used for occupancy: max threads, max CTAs, registers, shared memory (bytes) and
# the shared memory the driver reserves per CTA (the CUDA C++ Programming Guide's table per compute
# capability). sm_50, sm_60, sm_70, sm_75: Maxwell, P100, V100, Turing (the SIMT kernels alone run there,
# but Turing's float16 tensor-core ones: specs.TC_COMPUTE_CAPABILITY); sm_80: A100; sm_86/89: consumer
# Ampere/Ada; sm_100: B200; sm_120: consumer Blackwell.
SMS = {
    "sm_50": Sm(threads=2048, ctas=32, registers=65536, smem=65536, smem_reserved=0),
    "sm_60": Sm(threads=2048, ctas=32, registers=65536, smem=65536, smem_reserved=0),
    "sm_70": Sm(threads=2048, ctas=32, registers=65536, smem=98304, smem_reserved=0),
    "sm_75": Sm(threads=1024, ctas=16, registers=65536, smem=65536, smem_reserved=0),
    "sm_80": Sm(threads=2048, ctas=32, registers=65536, smem=167936, smem_reserved=1024),
    "sm_86": Sm(threads=1536, ctas=16, registers=65536, smem=102400, smem_reserved=1024),
    "sm_89": Sm(threads=1536, ctas=24, registers=65536, smem=102400, smem_reserved=1024),
    "sm_90": Sm(threads=2048, ctas=32, registers=65536, smem=233472, smem_reserved=1024),
    "sm_100": Sm(threads=2048, ctas=32, registers=65536, smem=233472, smem_reserved=1024),
    "sm_120": Sm(threads=1536, ctas=32, registers=65536, smem=102400, smem_reserved=1024),
}
REGISTER_GRANULE = 256  # registers are allocated per warp in multiples of this
MAX_REGISTERS = 255  # per thread, on every architecture here


def sm(arch: str) -> Sm:
    """The per-SM limits of `arch` ("sm_90"; "sm_90a" is sm_90's); an architecture not in SMS gets sm_80's."""
    return SMS.get(arch.rstrip("a"), SMS["sm_80"])


@dataclass(frozen=True)
class Gpu:
    name: str
    part: str
    arch: str               # its key in SMS
    sms: int
    clock_ghz: float        # boost clock the dense tensor peak is quoted at
    tensor_tflops: float    # dense fp16/bf16 with fp32 accumulation
    hbm_tbs: float          # HBM bandwidth, TB/s
    smem_bytes_per_clk: int  # shared memory per SM per clock: 32 banks x 4 bytes, one wavefront
    ex2_per_clk: int        # MUFU ex2 (2^x, ex2.approx.f32) results per SM per clock
    gemm_tflops: float | None = None  # a dense bf16 GEMM measured on this part here (None: not measured)

    @property
    def sm(self) -> Sm:
        """The per-SM limits of its architecture."""
        return SMS[self.arch]


# Vendor datasheets and whitepapers; ../shared/ANCHORS.md has the H100/H200 peak and HBM figures;
# 128 B/clk/SM is 32 banks of 4 bytes, one wavefront a clock.
# 312 = 108 SMs x 4 tensor cores x 512 FLOP/clk x 1.41 GHz; 989 = 132 x 4 x 1024 x 1.83 GHz.
# ex2: 16 results per SM per clock. The FlashAttention-3 paper (arXiv 2407.08608, section 3.1): "the
# H100 SXM5 GPU has 989 TFLOPS of FP16 matmul but only 3.9 TFLOPS of special functions such as
# exponential" = 132 SMs x 16 x 1.83 GHz (3.87); the CUDA C++ Programming Guide's table of arithmetic
# throughput (reciprocal, rsqrt, log2, exp2, sin, cos: the MUFU) gives 16 per SM per clock from
# compute capability 8.0 on (not re-read for 9.0 here: the FA3 figure is the one checked).
# gemm_tflops: bf16 8192^3 matmul on this workplace's H200, ~790 (../shared/SM90.md, section 1): what
# wgmma reaches in practice there (clocks under load, the GEMM's own overheads), against 989 on paper.
GPUS = (
    Gpu("A100", "A100 SXM4 80GB", "sm_80", 108, 1.410, 312.0, 2.039, 128, 16),
    Gpu("H100", "H100 SXM5", "sm_90", 132, 1.830, 989.0, 3.35, 128, 16),
    Gpu("H200", "H200 SXM", "sm_90", 132, 1.830, 989.0, 4.8, 128, 16, gemm_tflops=790.0),
)
