#!/usr/bin/env bash
# Download into .whl/ (gitignored) exactly the wheels the torchtitan benchmarks need on the GPU machine, which has
# torch + triton but no internet and no torchtitan: torchtitan 0.3.0 and what importing its MoE / dispatcher /
# MinimalAsyncEP / override modules pulls in beyond torch (measured: spmd_types, tyro and tyro's docstring-parser,
# typeguard, typing-extensions). All are pure-python wheels (py3-none-any), so only the Python version is pinned.
# On the device:  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#                     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for req in "torchtitan==0.3.0" "spmd_types==0.2.3" "tyro==1.0.17" "docstring-parser==0.18.0" "typeguard==4.6.1" \
           "typing-extensions==4.16.0"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl "$req"
done
ls -l .whl
