#!/bin/bash
# One lease's GPU checks (docs/BENCHMARKS.md, "CUDA"), run from the repository root on the device
# machine: its python3 holds a CUDA torch; ckptzip's compiled needs travel as cp312 wheels in .whl/
# (python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 -d .whl zstandard blake3 constriction). Logs go to $OUT (or /tmp/gpu-out).
#   bench/gpu_check.sh [tests|bench|all] [extra args for bench/gpu.py]
set -u
what=${1:-all}; shift || true
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:$PWD/tests:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, numba, numpy, zstandard; print('torch', torch.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__, 'zstd', zstandard.ZSTD_VERSION, torch.cuda.get_device_name())"
rc=0
if [ "$what" != bench ]; then
  # every CUDA test (tests/test_cuda.py, the kernels' CUDA-vs-CPU tests), and the CPU golden bytes beside them
  timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout=120 -rfEs tests/test_cuda.py \
    tests/test_kmeans.py tests/test_quant_baselines.py tests/test_quant_dqbatch.py tests/test_quant_excp.py \
    tests/test_sketch.py tests/test_codec_delta.py tests/test_rle.py tests/test_golden_methods.py \
    -k "cuda or reproduces_the_golden_bytes" 2>&1 | tee "$out/tests.log" | tail -40
  rc=${PIPESTATUS[0]}
fi
if [ "$what" != tests ]; then
  timeout 300 python3 bench/gpu.py "$@" 2>&1 | tee "$out/bench.log"
fi
exit $rc
