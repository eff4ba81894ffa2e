#!/usr/bin/env bash
# The project's test matrix: the README's test command and what .ci/run runs, from the repository root.
#   1. the whole suite on torch 2.13.0, the oldest supported release (a CPU build on these machines' disk), in .venv;
#   2. the suite without the tests marked slow on the newest torch the registry serves, in .venv-newest, so that a
#      new release that breaks a private API autofit relies on (autofit/_torch.py) fails here first.
# A venv that already exists is reused (pip then installs only what changed).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0 -e ".[test]"
.venv/bin/python -m pytest -q

python3 -m venv .venv-newest
.venv-newest/bin/pip install -q --upgrade torch
.venv-newest/bin/pip install -q -e ".[test]"
.venv-newest/bin/python -c 'import torch; print("newest torch:", torch.__version__)'
.venv-newest/bin/python -m pytest -q -m "not slow"
