#!/usr/bin/env bash
# Creates .venv once and installs the pinned packages into it, and the kit itself (editable), so
# every script imports `common` as an installed package: `bash install.sh [-r extra.txt]`.
# Re-installs only when a requirements file changes, so the demo and the tests can both call it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
stamp=".venv/installed-$(cat requirements*.txt pyproject.toml | sha256sum | cut -c1-16)-$(echo "$*" | sha256sum | cut -c1-8)"
if [ ! -f "$stamp" ]; then
  # torch is pinned to one exact version: a looser pin would pull gigabytes of CUDA packages on CPU machines.
  .venv/bin/pip install --quiet --disable-pip-version-check -r requirements.txt "$@"
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
  touch "$stamp"
fi
