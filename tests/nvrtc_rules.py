"""Which NVRTC compiles what in the NVRTC tests (test_nvrtc.py, test_hopper_nvrtc.py)."""

# CuPy's own NVRTC for the Hopper GPUs compiles every specialization, in every dtype: the (arch, NVRTC
# major) of test_nvrtc.py's primary report; test_hopper_nvrtc.py's sm_90a compiles take its major
PRIMARY = ("sm_90", 13)

# Elsewhere a bfloat16 tensor-core kernel is compiled only where its float16 twin came within TWIN_SLACK
# registers of the limit, or spilled (the Hopper kernels, far from it, not at all), and every twin pair a
# report compiles, all of them in PRIMARY's, must lie fewer than TWIN_SLACK registers apart with the same
# spills: so a twin left out stays under the limit. Measured (benchmarks/results/nvrtc_twins.md): every
# twin took its float16 kernel's registers and spills in the sm_90 reports and both sm_90a compiles, and
# within 6 registers in 4 of 92 rows at sm_80 under NVRTC 12, none of them within 18 of the limit. The
# bfloat16 twins were half of each report's tensor-core compiles.
TWIN_SLACK = 8
