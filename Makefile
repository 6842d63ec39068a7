# Two commands for a fresh machine: `make demo` (fine-tune on real text) and `make test`.
# Each creates .venv on first use. torch is installed first, alone, so that the CPU build is taken
# and nothing later pulls the multi-GB CUDA build (pip keeps an installed torch that satisfies >=2.6).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: venv demo demo-grpo test clean

$(VENV)/.installed: setup.cfg setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,demo]"
	$(PY) -m pip install -q --no-deps dashscope  # ships the Qwen BPE file; its web stack is not needed
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m hf_fused.demo sft

demo-grpo: venv
	$(PY) -m hf_fused.demo grpo

test: venv
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) outputs
