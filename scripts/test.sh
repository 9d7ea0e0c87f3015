#!/usr/bin/env bash
# The test suite. On a CPU the real Triton kernels run in interpret mode in multi-rank CPU worlds; GPU tests skip.
# Extra arguments go to pytest (e.g. -m gpu on the device machine, -m soak for the long soaks); test paths among them
# select those files or folders only (`bash scripts/test.sh tests/docs -x`), none: the whole suite (pyproject testpaths).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then . .venv/bin/activate; fi
if ! python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export TRITON_INTERPRET=1
fi
set +e
python -m pytest -q -ra "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing on purpose"; exit 1; fi
exit $rc
