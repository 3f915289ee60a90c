#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: install the [gpu] extra, run tests/runtimes/test_gpu.py and
# benchmarks/bench_gpu.py, and keep every log in OUT_DIR.
#
#   benchmarks/gpu_session.sh OUT_DIR [bench_gpu.py arguments...]
#
# Offline machines: set TQS_SITE to a folder already holding the packages (onnxruntime-gpu, polars, ...);
# it is put first on PYTHONPATH and nothing is installed. CUDA libraries are taken from the nvidia-* wheels
# of the Python environment (PyTorch's or onnxruntime-gpu's own), which ONNX Runtime does not search by itself.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_session.sh OUT_DIR [bench_gpu.py arguments...]}
shift
mkdir -p "$out"
if [ -n "${TQS_SITE:-}" ]; then
    export PYTHONPATH="$TQS_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    python3 -m pip install -q -e '.[gpu,test]' 2>&1 | tee "$out/install.log"
fi
nvidia_libs=$(python3 - <<'PY'
import glob, os
try:
    import nvidia
except ImportError:
    raise SystemExit
print(":".join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + "/**/lib*.so*", recursive=True)})))
PY
)
export LD_LIBRARY_PATH="${nvidia_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import sys, onnxruntime as o; print(sys.version); print('onnxruntime', o.__version__, o.get_available_providers())"
    python3 -c "import tensorrt; print('tensorrt', tensorrt.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$out/env.txt"
python3 -m pytest -q -p no:cacheprovider tests/runtimes/test_gpu.py 2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
python3 benchmarks/bench_gpu.py --out "$out" "$@" 2>&1 | tee "$out/bench_gpu.log"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, benchmark exit $bench" | tee -a "$out/env.txt"
exit $(( tests || bench ))
