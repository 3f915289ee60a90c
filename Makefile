# Two commands do all the set-up on a fresh machine (Python 3.11, 3.12 or 3.13 with venv):
#   make demo   # installs into .venv, then scores, exports, evaluates and gates (on held-out windows) the bundled ETTh1 forecaster
#   make test   # installs into .venv, then runs the test suite
# Another interpreter, in a venv of its own: make test PYTHON=python3.13 VENV=.venv-3.13
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
EXAMPLE ?= examples/etth1_patchtst

.PHONY: demo test lint bench clean

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

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_score.py
	$(BIN)/python benchmarks/bench_export.py

clean:
	rm -rf $(VENV) tqs-runs .pytest_cache
