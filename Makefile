# Everything runs from a project-local virtual environment, created on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_CKPT := demo_out/Kimi-K3-tiny
DEMO_OUT  := demo_out/Kimi-K3-tiny-w4a8

.PHONY: install demo test lint bench clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch (a bare `torch` would pull a multi-GB CUDA build).
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	rm -rf $(DEMO_CKPT) $(DEMO_OUT)
	$(PY) example/multimodal_vlm/Kimi-K3/make_checkpoint.py --preset tiny --out $(DEMO_CKPT)
	$(VENV)/bin/msmodelslim quant --model_path $(DEMO_CKPT) --save_path $(DEMO_OUT) --device cpu \
		--model_type Kimi-K3 --quant_type w4a8 --trust_remote_code True

test: install
	$(VENV)/bin/ruff check msmodelslim test bench example
	$(PY) -m pytest -q --durations=15 test

lint: install
	$(VENV)/bin/ruff check msmodelslim test bench example

bench: install
	$(PY) bench/mxfp4.py
	$(PY) bench/kda.py
	$(PY) bench/load.py
	$(PY) bench/pipeline.py
	$(PY) bench/accuracy.py --model ../shared/models/kimi-linear-mini --recipe full
	$(PY) bench/dp.py

clean:
	rm -rf demo_out bench_out .pytest_cache
