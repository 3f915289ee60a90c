#!/usr/bin/env bash
# Issue #32's GPU checks in one command, each step under its own time limit so a slow one cannot eat the rest:
# tests/test_gpu.py (CUDA provider and the CuPy solver path), the solver on numpy vs CuPy, and export's time to
# result with CUDA measurement rollouts (CuPy products, then numpy products for the same model), then a MatMul stack.
#
#   benchmarks/gpu_export_session.sh OUT_DIR [STACK_GB]
#
# Offline machines: put the packages on PYTHONPATH first (../shared/tools/gpu's unpack script does).
set -uo pipefail
out=${1:?usage: benchmarks/gpu_export_session.sh OUT_DIR [STACK_GB]}
stack_gb=${2:-1}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() { local limit=$1 name=$2; shift 2; echo "== $name (limit ${limit}s)"; local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1; local rc=$?; tail -n 25 "$out/$name.log"; echo "== $name exit $rc in $((SECONDS - t0)) s"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  python3 -c "import onnxruntime as o, cupy, numpy; print('ort', o.__version__, o.get_available_providers()); print('cupy', cupy.__version__, 'numpy', numpy.__version__)"; } 2>&1 | tee "$out/env.txt"
step 120 gpu_tests python3 -m pytest -q -p no:cacheprovider -x tests/test_gpu.py
step 75 solver_backend python3 benchmarks/bench_solver_backend.py --orders 1024,2048,4096 --out "$out"
step 150 export_cuda python3 benchmarks/bench_export.py --models bert,etth1_patchtst --provider cuda --out export-gpu --results-dir "$out" --note "CUDA measurement rollouts, CuPy products"
step 80 export_cuda_numpy python3 benchmarks/bench_export.py --models bert --provider cuda --arrays numpy --out export-gpu-numpy --results-dir "$out" --note "CUDA measurement rollouts, numpy products"
step 150 export_stack python3 benchmarks/bench_export.py --models stack --stack-gb "$stack_gb" --provider cuda --out export-gpu-stack --results-dir "$out" --note "CUDA measurement rollouts, CuPy products"
ls -la "$out"
