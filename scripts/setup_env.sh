#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment and installs moeify into it.
#
#   scripts/setup_env.sh VENV_DIR EXTRAS
#
# torch: on a machine with an NVIDIA GPU and a CUDA torch already installed for python3, the venv
# sees that torch (--system-site-packages) and nothing replaces it. Everywhere else the CPU build
# torch==$MOEIFY_TORCH_VERSION is installed; pip finds it in a local wheel directory when the
# machine has one. On a machine without one, set MOEIFY_TORCH_PIP_ARGS, e.g.
#   MOEIFY_TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# so that pip does not pull a multi-GB CUDA build from PyPI.
#
# Triton (the fused expert-matmul kernels) runs only on CUDA: the `triton` extra is added where
# the venv's torch is a CUDA build, and left out elsewhere (about 1 GB a CPU-only machine cannot
# use). Ask for it in EXTRAS to have it anyway: `make test` does, for the tests that check the
# kernels in Triton's CPU interpreter.
#
# MOEIFY_SETUP_DRY_RUN=1: print the extras that would be installed, change nothing.
set -euo pipefail
venv=${1:-.venv}
extras=${2:-dev}
torch_version=${MOEIFY_TORCH_VERSION:-2.13.0}
stamp="$venv/.moeify-installed-$extras"

if [ -z "${MOEIFY_SETUP_DRY_RUN:-}" ] && [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi

# The extras plus triton where torch is a CUDA build (the python given as $1 decides).
with_triton_where_it_runs() {
  local python=$1
  case ",$extras," in
    *,triton,*|*,all,*) echo "$extras"; return ;;
  esac
  if "$python" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
    echo "$extras,triton"
  else
    echo "$extras"
  fi
}

if [ -n "${MOEIFY_SETUP_DRY_RUN:-}" ]; then
  if [ -x "$venv/bin/python" ]; then probe="$venv/bin/python"; else probe=python3; fi
  echo "[setup] would install moeify[$(with_triton_where_it_runs "$probe")]"
  exit 0
fi

system_cuda_torch=0
if command -v nvidia-smi >/dev/null 2>&1 && python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  system_cuda_torch=1
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating virtual environment in $venv"
  if [ "$system_cuda_torch" = 1 ]; then
    python3 -m venv --system-site-packages "$venv"
  else
    python3 -m venv "$venv"
  fi
fi
py="$venv/bin/python"

# pip's own output is the progress of the two long steps (a few minutes each on a fresh
# machine): what it collects and downloads, with a progress bar on a terminal.
if ! "$py" -c 'import torch' 2>/dev/null; then
  echo "[setup] installing the CPU build of torch==$torch_version (a large download: a few minutes)"
  # shellcheck disable=SC2086
  "$py" -m pip install --disable-pip-version-check --progress-bar on "torch==$torch_version" ${MOEIFY_TORCH_PIP_ARGS:-}
fi

install=$(with_triton_where_it_runs "$py")
if [ "$install" != "$extras" ]; then
  echo "[setup] torch is a CUDA build: adding the triton extra (the fused expert-matmul kernels)"
fi
echo "[setup] installing moeify[$install] in editable mode (its dependencies: a minute or two)"
"$py" -m pip install --disable-pip-version-check --progress-bar on -e ".[$install]"
touch "$stamp"
echo "[setup] done: $venv"
