#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs, then runs pytest.
# The Slurm tests install and start their own local cluster (Debian packages; root needed).
set -euo pipefail
cd "$(dirname "$0")"
bash install.sh -r requirements-tracking.txt
# the built-in tiny default, which the scripts (and submit.py's plans) use when given no --model
.venv/bin/python 01_download/download.py --demo --out demo
exec .venv/bin/python -m pytest tests "$@"
