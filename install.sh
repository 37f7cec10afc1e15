#!/usr/bin/env bash
# Creates the kit's virtual environment once and installs the pinned packages into it, and the kit
# itself (editable), so every script imports `common` as an installed package: `bash install.sh [-r extra.txt]`.
# Re-installs only when a requirements file changes, so the demo and the tests can both call it.
#
#   PYTHON=python3.11 bash install.sh                  # the Python to build it with (>= 3.10; default python3)
#   KIT_VENV=/scratch/$USER/chess-venv bash install.sh # where it goes (default ./.venv), and pip's cache with it
#
# With KIT_VENV the environment and pip's cache (gigabytes of CUDA wheels) live there, e.g. on scratch
# rather than a small $HOME quota, and ./.venv links to it: `source .venv/bin/activate` works either way.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PYTHON=${PYTHON:-python3}

if [ -n "${KIT_VENV:-}" ]; then
  export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$KIT_VENV/pip-cache}
  if [ ! -e .venv ] && [ ! -L .venv ]; then
    mkdir -p "$KIT_VENV"
    ln -s "$KIT_VENV" .venv
  elif [ "$(realpath .venv)" != "$(realpath -m "$KIT_VENV")" ]; then
    echo "error: ./.venv already exists and is not KIT_VENV=$KIT_VENV: remove it (rm -r .venv) to build the" \
      "environment there" >&2
    exit 2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  # Checked before anything is built: login nodes often have an old python3 (3.6 on RHEL 8).
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    found=$("$PYTHON" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo "not found")
    echo "error: the kit needs Python >= 3.10 and $PYTHON is $found: choose another with" \
      "PYTHON=python3.11 bash install.sh (or after \`module load python/3.11\`, or a conda environment's python)" >&2
    exit 2
  fi
  "$PYTHON" -m venv .venv
fi
stamp=".venv/installed-$(cat requirements*.txt pyproject.toml | sha256sum | cut -c1-16)-$(echo "$*" | sha256sum | cut -c1-8)"
if [ ! -f "$stamp" ]; then
  # torch is pinned to one exact version: a looser pin would pull gigabytes of CUDA packages on CPU machines.
  .venv/bin/pip install --quiet --disable-pip-version-check -r requirements.txt "$@"
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
  touch "$stamp"
fi
