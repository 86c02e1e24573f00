# Two entry points do all setup on a fresh machine:
#   make train   -> builds .venv and trains the small SwitchHead model on the default corpus
#   make test    -> builds .venv, runs the test suite and builds the docs (make docs)
#   make docs    -> builds the documentation site (MkDocs) into site/, warnings as errors
VENV ?= .venv
PY := $(VENV)/bin/python
# Triton: setup_env.sh adds it where torch is a CUDA build (the only place its kernels run);
# `make test` adds it everywhere, for the tests that run the kernels in Triton's CPU interpreter
# (tests/ops/test_triton_matmul.py), so `make train` on a CPU-only machine does not carry it.
EXTRAS ?= dev,plot,tokenizers,hf,harness
# `make test` and `make docs` also add the docs extra (MkDocs, mkdocstrings).
TEST_EXTRAS ?= $(EXTRAS),docs,triton

.PHONY: setup setup-test train demo test docs bench clean

setup:
	@bash scripts/setup_env.sh $(VENV) $(EXTRAS)

setup-test:
	@bash scripts/setup_env.sh $(VENV) $(TEST_EXTRAS)

train: setup
	$(VENV)/bin/moeify train $(ARGS)

demo: setup
	$(VENV)/bin/moeify demo

# The second run is the GPU suite's checks on the CPU (MOEIFY_SUITE_DEVICE=cpu), to keep the
# suite itself working on machines without a GPU; its compiled and FSDP cases are left to the
# main suite's CPU counterparts (tests/models/test_compile.py, tests/train/test_scale.py,
# tests/train/test_fsdp.py): inductor's CPU code generation takes four minutes there.
# PYTEST_ARGS (e.g. -k NAME, -x) apply to the main run only; the second runs when it is unset.
test: setup-test
	$(PY) -m pytest tests $(PYTEST_ARGS)
ifeq ($(strip $(PYTEST_ARGS)),)
	MOEIFY_SUITE_DEVICE=cpu $(PY) -m pytest -m cuda tests/train/test_cuda.py \
		-k "not compiled_training and not fsdp" -p no:cacheprovider
	$(MAKE) --no-print-directory docs
endif

# The site (mkdocs.yml, docs/): every link and #anchor must resolve and the API reference's
# docstrings must parse; --strict makes each warning an error. The docs extra installs MkDocs.
docs: setup-test
	$(VENV)/bin/mkdocs build --strict --quiet

bench: setup
	$(VENV)/bin/moeify bench expert-matmul

clean:
	rm -rf $(VENV) src/*.egg-info .pytest_cache site
