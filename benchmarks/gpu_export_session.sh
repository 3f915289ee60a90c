#!/usr/bin/env bash
# Issue #32's GPU checks in one command, each step under its own time limit so a slow one cannot eat the rest:
#   tests     tests/runtimes/test_gpu.py (CUDA provider paths, the CuPy solver path's codes) and the device loop's CI test
#   solver    the rounding solver on numpy vs CuPy (benchmarks/bench_solver_backend.py)
#   bert      export's time to result on the BERT-size encoder, CUDA measurement rollouts, CuPy solver
#   etth1     the same for the bundled ETTh1 example
#   numpy     the BERT-size export again with the solver's products kept on the host (TQS_ARRAYS=numpy)
#   stack     a MatMul stack of STACK_GB gigabytes (default 1)
#
#   benchmarks/gpu_export_session.sh OUT_DIR [STEP ...]     (default: tests solver bert etth1)
#
# Logs go to OUT_DIR/logs; few files, since a lent machine returns at most eight.
# Offline machines: put the packages on PYTHONPATH first (../shared/tools/gpu's unpack script does).
set -uo pipefail
out=${1:?usage: benchmarks/gpu_export_session.sh OUT_DIR [STEP ...]}
shift
steps=${*:-tests solver bert etth1}
mkdir -p "$out/logs"
export PYTHONUNBUFFERED=1
step() { local limit=$1 name=$2; shift 2; echo "== $name (limit ${limit}s)"; local t0=$SECONDS
    timeout "$limit" "$@" > "$out/logs/$name.log" 2>&1; local rc=$?; tail -n 12 "$out/logs/$name.log"; echo "== $name exit $rc in $((SECONDS - t0)) s"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  python3 -c "import onnxruntime as o, cupy, numpy; print('ort', o.__version__, o.get_available_providers()); print('cupy', cupy.__version__, 'numpy', numpy.__version__)"; } 2>&1 | tee "$out/env.txt"
bench=(python3 benchmarks/bench_export.py --results-dir "$out" --logs "$out/logs")
for s in $steps; do
    case $s in
        tests) step 90 tests python3 -m pytest -q -p no:cacheprovider tests/runtimes/test_gpu.py tests/tiers/test_baselines_math.py -k "gpu or cuda or device or cupy" ;;
        solver) step 60 solver python3 benchmarks/bench_solver_backend.py --orders 1024,2048,4096 --out "$out" ;;
        bert) step 200 export_bert "${bench[@]}" --models bert --provider cuda --out export-gpu-bert --note "CUDA measurement rollouts, CuPy solver" ;;
        etth1) step 60 export_etth1 "${bench[@]}" --models etth1_patchtst --provider cuda --out export-gpu-etth1 --note "CUDA measurement rollouts, CuPy solver" ;;
        numpy) step 200 export_bert_numpy "${bench[@]}" --models bert --provider cuda --arrays numpy --out export-gpu-bert-numpy --note "CUDA measurement rollouts, numpy solver" ;;
        stack) step 300 export_stack "${bench[@]}" --models stack --stack-gb "${STACK_GB:-1}" --provider cuda --out export-gpu-stack --note "CUDA measurement rollouts, CuPy solver" ;;
        *) echo "unknown step $s" ;;
    esac
done
rm -f "$out"/*.md  # printed in the logs; the .json files hold the same rows
find "$out" -type f | sort
