# ds_megatron: `make demo` trains the tiny GPT on 4 CPU processes; `make test` runs the test suite.
# Both create and reuse the virtual environment .venv (scripts/bootstrap.sh picks the right torch build).

VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv demo demo-llama demo-moe test test-fast lint clean

venv:
	@bash scripts/bootstrap.sh

demo: venv
	DEEPSPEED=$(VENV)/bin/deepspeed bash recipes/gpt_tiny.sh --save checkpoints/gpt_tiny

# The same demo with the Llama family (RoPE, RMSNorm, SwiGLU, grouped-query attention).
demo-llama: venv
	DEEPSPEED=$(VENV)/bin/deepspeed bash recipes/llama_tiny.sh --save checkpoints/llama_tiny

# The mixture-of-experts demo: moe-tiny (Qwen3-MoE layout, 8 experts, top 2) at tp 2 x pp 2 with SP.
demo-moe: venv
	DEEPSPEED=$(VENV)/bin/deepspeed bash recipes/moe_tiny.sh --save checkpoints/moe_tiny

test: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

# The unit tier: tests/unit, in-process only (no deepspeed launcher), for use while you work.
test-fast: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/unit

lint: venv
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
