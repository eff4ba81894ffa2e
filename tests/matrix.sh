#!/usr/bin/env bash
# The project's test matrix: the README's test command and what .ci/run runs, from the repository root.
#   1. the whole suite (every tier: quick, sim, slow) on torch 2.13.0, the oldest supported release (a CPU build on
#      these machines' disk), in .venv-test;
#   2. the quick and sim tiers (not slow) on the newest torch the registry serves, in .venv-newest, so that a new
#      release that breaks a private API autofit relies on (autofit/core/_torch.py) fails here first.
# Both environments are the script's own: the .venv that the README's first command makes is left as the user made it.
# A venv that already exists is reused (pip then installs only what changed). Tests run on as many pytest-xdist
# workers as there are cores (most tests are one Python thread: a simulation on fake tensors), AUTOFIT_TEST_WORKERS
# overrides (1: one process, no xdist). Both runs always run; the script exits with the first failing run's status
# after a one-line summary of both. --durations=15 prints the slowest tests of each run (where the time goes).
# -rfEs lists failures, errors and why each skipped test skipped (tests whose truth is a real step on this CPU skip
# where its kernels cannot run it, Note [CPU kernels]).
# A test's call that runs 20 minutes fails there with its stack (pytest-timeout, fixtures not counted), instead of
# holding a worker until CI's 90 minutes end with no word of where: the slowest test takes about 10 minutes on the
# slowest machine seen, and one that had grown to 90 (a compiled simulation running real matmuls, Note [values inside
# compiled code] in autofit/core/_torch_compile.py) once timed CI out.
set -euo pipefail
cd "$(dirname "$0")/.."

status=0
summary=()
started=$SECONDS
workers=${AUTOFIT_TEST_WORKERS:-$(python3 -c 'import os; print(len(os.sched_getaffinity(0)))')}
parallel=()
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist worksteal); fi
ceiling=(--timeout=1200 -o timeout_func_only=true)

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

python3 -m venv .venv-test
.venv-test/bin/pip install -q torch==2.13.0 -e ".[test]"
suite "torch $(.venv-test/bin/python -c 'import torch; print(torch.__version__)')" \
    .venv-test/bin/python -m pytest -q -rfEs --durations=15 "${ceiling[@]}" "${parallel[@]}"

python3 -m venv .venv-newest
.venv-newest/bin/pip install -q --upgrade torch
.venv-newest/bin/pip install -q -e ".[test]"
newest=$(.venv-newest/bin/python -c 'import torch; print(torch.__version__)')
echo "newest torch: $newest"
suite "torch $newest, not slow" .venv-newest/bin/python -m pytest -q -rfEs --durations=15 -m "not slow" "${ceiling[@]}" "${parallel[@]}"

elapsed=$((SECONDS - started))
echo "matrix: ${summary[0]}; ${summary[1]}; $((elapsed / 60)) min $((elapsed % 60)) s in all"
exit "$status"
