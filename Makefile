# quantkit developer entry points. Everything runs inside .venv, created on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONFIG ?= configs/digits_cnn.yaml
WORKDIR ?= artifacts

.PHONY: demo test test-fast bench venv data clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[export,dev]'
	touch $(STAMP)

venv: $(STAMP)

## make demo: the whole pipeline on the default model, on CPU, then its result
demo: $(STAMP)
	$(BIN)/quantkit --workdir $(WORKDIR) run $(CONFIG)

## make test: the test suite (GPU tests skip without a GPU)
test: $(STAMP)
	$(BIN)/python -m pytest -q

## make test-fast: skip the slow tests
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

## make bench: build every reference model, then regenerate docs/benchmarks.md (FP32 vs INT8, calibration, build)
bench: $(STAMP)
	for config in configs/*.yaml; do $(BIN)/quantkit -q --workdir $(WORKDIR) run --stop-after build-engine $$config || exit 1; done
	$(BIN)/python scripts/bench_all.py --workdir $(WORKDIR) --duration 1 --repeats 7
	$(BIN)/python scripts/bench_build.py --workdir $(WORKDIR) --docs
	$(BIN)/python scripts/bench_calib.py --workdir $(WORKDIR)/bench-calib
	$(BIN)/python scripts/bench_sensitivity.py --workdir $(WORKDIR)

## make data: regenerate the shipped data and the digits weights (needs the data extra)
data: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[data]'
	$(BIN)/python scripts/train_digits.py
	$(BIN)/python scripts/make_reference_data.py

clean:
	rm -rf $(WORKDIR) .pytest_cache
