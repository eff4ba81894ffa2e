#!/usr/bin/env bash
# The project's test matrix: the README's test command and what .ci/run runs, from the repository root.
#   1. the whole suite on torch 2.13.0, the oldest supported release (a CPU build on these machines' disk), in .venv;
#   2. the suite without the tests marked slow on the newest torch the registry serves, in .venv-newest, so that a
#      new release that breaks a private API autofit relies on (autofit/core/_torch.py) fails here first.
# A venv that already exists is reused (pip then installs only what changed). Both runs always run; the script exits
# with the first failing run's status after a one-line summary of both. -rs prints why each skipped test skipped
# (tests whose truth is a real step on this CPU skip where its kernels cannot run it, Note [CPU kernels]).
set -euo pipefail
cd "$(dirname "$0")/.."

status=0
summary=()
started=$SECONDS

# suite NAME COMMAND...: run a pytest command with its output as usual; keep its closing line for the summary
suite() {
    local name=$1 rc=0 began=$SECONDS log
    shift
    log=$(mktemp)
    "$@" 2>&1 | tee "$log" || rc=$?  # pipefail: rc is pytest's status; || keeps set -e from ending the script here
    summary+=("$name: $(tail -n 1 "$log" | sed 's/^=* *//; s/ *=*$//') [exit $rc, $((SECONDS - began)) s]")
    rm -f "$log"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0 -e ".[test]"
suite "torch $(.venv/bin/python -c 'import torch; print(torch.__version__)')" .venv/bin/python -m pytest -q -rs

python3 -m venv .venv-newest
.venv-newest/bin/pip install -q --upgrade torch
.venv-newest/bin/pip install -q -e ".[test]"
newest=$(.venv-newest/bin/python -c 'import torch; print(torch.__version__)')
echo "newest torch: $newest"
suite "torch $newest, not slow" .venv-newest/bin/python -m pytest -q -rs -m "not slow"

elapsed=$((SECONDS - started))
echo "matrix: ${summary[0]}; ${summary[1]}; $((elapsed / 60)) min $((elapsed % 60)) s in all"
exit "$status"
