#!/usr/bin/env bash
# Install the package with its test extras and run the whole test suite (what CI runs): without arguments the
# default run, then the sweep tier (every shipped config rehearsed and re-planned, the long convergence runs);
# with arguments, pytest with them (e.g. -m quick).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]"

run() {  # pytest's status; 5 (no test collected) is a failure
  local status=0
  python -m pytest -q "$@" || status=$?
  if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure" >&2
    status=1
  fi
  return "$status"
}

if [ "$#" -gt 0 ]; then
  run "$@"
  exit
fi
status=0
run || status=$?
run -m sweep || status=$?
exit "$status"
