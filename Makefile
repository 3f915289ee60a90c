# Two commands do all the set-up on a fresh machine (Python 3.11, 3.12 or 3.13 with venv):
#   make demo   # installs into .venv, then scores, exports, evaluates and gates (on held-out windows) the bundled ETTh1 forecaster
#   make test   # installs into .venv, then runs the test suite
# Another interpreter, in a venv of its own: make test PYTHON=python3.13 VENV=.venv-3.13
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
EXAMPLE ?= examples/etth1_patchtst

.PHONY: demo test lint bench clean oldest-ort

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,ray]'
	touch $(STAMP)

RUN ?= tqs-runs/$(notdir $(EXAMPLE))

demo: $(STAMP)
	$(BIN)/tqsdeploy inspect $(EXAMPLE)/model.onnx --spec $(EXAMPLE)/rollout.toml
	$(BIN)/tqsdeploy score $(EXAMPLE)/model.onnx --contexts $(EXAMPLE)/contexts.npz --spec $(EXAMPLE)/rollout.toml --out $(RUN)
	$(BIN)/tqsdeploy export $(EXAMPLE)/model.onnx --run $(RUN) --C 4,8 --out-dir $(RUN)/export --force
	$(BIN)/tqsdeploy export $(EXAMPLE)/model.onnx --run $(RUN) --uniform int4 --out-dir $(RUN)/export --force
	$(BIN)/tqsdeploy eval $(RUN)/export/$(notdir $(EXAMPLE))_model.C4.onnx --reference $(EXAMPLE)/model.onnx --contexts $(EXAMPLE)/heldout.npz --spec $(EXAMPLE)/rollout.toml --truth $(EXAMPLE)/heldout_truth.npz
	$(BIN)/tqsdeploy gate $(RUN)/export/$(notdir $(EXAMPLE))_model.C4.onnx --reference $(EXAMPLE)/model.onnx --contexts $(EXAMPLE)/heldout.npz --spec $(EXAMPLE)/rollout.toml --truth $(EXAMPLE)/heldout_truth.npz --max-degradation 2% --min-compression 4 --report-dir $(RUN)/gate

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The oldest ONNX Runtime pyproject.toml allows (runtimes.ort_versions.OLDEST_SUPPORTED): the demo and the
# export/load round-trip tests in a venv pinned to it; then a file written for onnxruntime 1.20
# (`--target ort-cpu@1.20`) loaded and run on 1.20 itself (tests/e2e/test_runtime_releases.py). .ci/run calls it.
ORT_OLDEST ?= 1.24.1
ORT_1_20 ?= 1.20.1
ORT_VENV := .venv-ort-$(ORT_OLDEST)
oldest-ort:
	echo "onnxruntime==$(ORT_OLDEST)" > $(ORT_VENV).constraint
	PIP_CONSTRAINT=$(CURDIR)/$(ORT_VENV).constraint $(MAKE) demo VENV=$(ORT_VENV) RUN=tqs-runs/ci-onnxruntime-$(ORT_OLDEST)
	$(ORT_VENV)/bin/python -c "import onnxruntime as o; assert o.__version__ == '$(ORT_OLDEST)', o.__version__"
	test -x .venv-ort-$(ORT_1_20)/bin/python || ($(PYTHON) -m venv .venv-ort-$(ORT_1_20) && \
		.venv-ort-$(ORT_1_20)/bin/python -m pip install --quiet --disable-pip-version-check onnxruntime==$(ORT_1_20) numpy)
	TQS_ORT_1_20_PYTHON=$(CURDIR)/.venv-ort-$(ORT_1_20)/bin/python $(ORT_VENV)/bin/python -m pytest -q \
		tests/e2e/test_runtime_releases.py tests/graph_ops/test_native.py tests/tqsdeploy/export/test_export.py \
		tests/e2e/test_examples.py::test_a_model_from_torchs_default_exporter_reads_as_its_modules_and_says_what_its_numbers_are

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_score.py
	$(BIN)/python benchmarks/bench_export.py

clean:
	rm -rf $(VENV) tqs-runs .pytest_cache
