#!/usr/bin/env bash
# The test suite, from a fresh clone: installs what it needs (.venv with requirements.txt, the
# trackers, ruff and pytest-xdist from requirements-test.txt, the kit itself), then runs pytest.
#   ./test.sh              everything (about 85 minutes on 2 cores; the Slurm tests install and
#                          start their own local cluster from Debian's packages, as root)
#   ./test.sh -m quick     the everyday tier (about 5 minutes)
# Other arguments go to pytest (e.g. ./test.sh tests/test_resume.py -x).
set -euo pipefail
cd "$(dirname "$0")"
bash install.sh -r requirements-test.txt
# the built-in tiny default, which the scripts (and submit.py's plans) use when given no --model
.venv/bin/python 01_download/download.py --demo --out demo
# Two workers (tests/conftest.py says which tests share one), in the order the tests are collected.
exec .venv/bin/python -m pytest -n 2 --no-loadscope-reorder tests "$@"
