# Everything runs from a project-local virtual environment, created on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_CKPT := demo_out/Kimi-K3-tiny
DEMO_OUT  := demo_out/Kimi-K3-tiny-w4a8

.PHONY: install demo test test-fast lint bench clean

$(STAMP): setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch (a bare `torch` would pull a multi-GB CUDA build).
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The release environment of Kimi-K3 (seed 004's install line): the stand-in's remote code and the Kimi-K3 path of
# the toolkit must run there too. transformers 4.57 has no native Kimi-Linear, and compressed-tensors 0.13 lacks the
# MXFP4 reference codec that one test compares against: those tests run in the main environment only.
SEED_VENV  := .venv-seed
SEED_STAMP := $(SEED_VENV)/.installed
SEED_TESTS := test/standin/test_vllm_names.py test/standin/test_make_checkpoint.py test/app/test_quant_e2e_kimi_k3.py \
	test/quarot/test_adapter_invariance.py test/eval/test_eval_kimi_k3_tiny.py \
	--deselect test/standin/test_make_checkpoint.py::test_router_matches_transformers_native_topk_router \
	--deselect test/standin/test_make_checkpoint.py::test_mxfp4_experts_hold_the_generated_weights

$(SEED_STAMP): setup.py pyproject.toml
	$(PYTHON) -m venv $(SEED_VENV)
	$(SEED_VENV)/bin/python -m pip install -q --upgrade pip
	$(SEED_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(SEED_VENV)/bin/python -m pip install -q "transformers==4.57.6" "compressed-tensors==0.13.0"
	$(SEED_VENV)/bin/python -m pip install -q -e ".[dev]"
	touch $(SEED_STAMP)

demo: install
	rm -rf $(DEMO_CKPT) $(DEMO_OUT)
	$(PY) example/multimodal_vlm/Kimi-K3/make_checkpoint.py --preset tiny --out $(DEMO_CKPT)
	$(VENV)/bin/msmodelslim quant --model_path $(DEMO_CKPT) --save_path $(DEMO_OUT) --device cpu \
		--model_type Kimi-K3 --quant_type w4a8 --trust_remote_code True

test: install $(SEED_STAMP)
	$(VENV)/bin/ruff check msmodelslim test bench example
	$(PY) -m pytest -q --durations=15 test
	$(SEED_VENV)/bin/python -c "import transformers, compressed_tensors as c; print('Kimi-K3 tests under transformers', transformers.__version__, 'compressed-tensors', c.__version__)"
	$(SEED_VENV)/bin/python -m pytest -q $(SEED_TESTS)

test-fast: install  # while working: everything but the tests marked slow (whole quantization runs), no seed env
	$(VENV)/bin/ruff check msmodelslim test bench example
	$(PY) -m pytest -q -m "not slow" test

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
	rm -rf demo_out bench_out .pytest_cache $(SEED_VENV)
