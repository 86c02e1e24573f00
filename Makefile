# Two entry points do all setup on a fresh machine:
#   make train   -> builds .venv and trains the small SwitchHead model on the default corpus
#   make test    -> builds .venv and runs the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= dev,plot,tokenizers,hf,harness,triton

.PHONY: setup train demo test bench clean

setup:
	@bash scripts/setup_env.sh $(VENV) $(EXTRAS)

train: setup
	$(VENV)/bin/moeify train $(ARGS)

demo: setup
	$(VENV)/bin/moeify demo

test: setup
	$(PY) -m pytest tests $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/moeify bench expert-matmul

clean:
	rm -rf $(VENV) src/*.egg-info .pytest_cache
