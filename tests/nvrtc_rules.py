"""Which NVRTC compiles what in the NVRTC tests (test_nvrtc.py, test_hopper_nvrtc.py)."""

# CuPy's own NVRTC for the Hopper GPUs compiles every specialization, in every dtype: the (arch, NVRTC
# major) of test_nvrtc.py's primary report; test_hopper_nvrtc.py's sm_90a compiles take its major
PRIMARY = ("sm_90", 13)

# test_nvrtc.py's other reports compile only the kernels PRIMARY's put above limit - REPORT_SLACK registers
# (or spilling), and a sample that parses every source (compiled_rows); each kernel they compile must lie
# fewer than REPORT_SLACK registers above PRIMARY's, so that one left out stays under the limit. Measured
# (benchmarks/results/nvrtc_margins.md): over all 498 mma.sync and SIMT kernels, no row of sm_90 or sm_80
# under NVRTC 12 lay more than 36 registers above PRIMARY's, and none more than 15 where PRIMARY's took 180
# or more; with 40, a report compiles some 120 of the 498 (the highest left out: 207 registers in PRIMARY's).
REPORT_SLACK = 40

# Of those, a report but PRIMARY compiles a bfloat16 tensor-core kernel only where its float16 twin came
# within TWIN_SLACK registers of the limit or spilled (test_hopper_nvrtc.py: the Hopper ones under PRIMARY's
# NVRTC only); every twin pair a report compiles, all of them in PRIMARY's, must lie fewer than TWIN_SLACK
# registers apart with the same spills, so that a twin left out stays under the limit. Measured
# (benchmarks/results/nvrtc_twins.md): every twin took its float16 kernel's registers and spills in the sm_90
# reports and both sm_90a compiles, and within 6 registers in 4 of 92 rows at sm_80 under NVRTC 12.
TWIN_SLACK = 8
