#!/usr/bin/env bash
# The Python packages baton needs beyond a GPU machine's own image (which has torch, pyarrow,
# numpy, pandas, matplotlib, yaml, but not Ray or MLflow), for a machine that reaches no
# package index: downloaded here for its Python (PY, default 3.12) and packed into one file,
# .gpu/site.tar.xz (about 40 MB: Ray's Java jars, dashboard client and the libraries baton
# does not use are left out).
#
#   bash benchmarks/gpu_site.sh                  # here, once (needs pip and a package index)
#   mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/site.tar.xz \
#     && PYTHONPATH=/tmp/site:$PWD/platform LIMIT=540 bash benchmarks/gpu_suite.sh   # there
#
# The versions are this machine's (its .venv's), so the GPU machine runs what CI tests.
# --no-deps: each needed package is named; those the GPU image lacked on 2026-11-27 are.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-3.12}
PIP=${PIP:-.venv/bin/pip}
NAMES="ray mlflow-skinny databricks-sdk google-auth pyasn1-modules pyasn1 cachetools
opentelemetry-api opentelemetry-sdk opentelemetry-proto opentelemetry-semantic-conventions
alembic sqlalchemy mako sqlparse gitpython gitdb smmap python-dotenv pydantic pydantic-core
annotated-types typing-inspection fastapi starlette uvicorn importlib-metadata jsonschema
referencing rpds-py jsonschema-specifications cryptography cffi pycparser"
specs=()
for name in $NAMES; do
  version=$($PIP show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
  if [ -z "$version" ]; then echo "not installed here: $name" >&2; exit 1; fi
  specs+=("$name==$version")
done
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
$PIP install -q --target "$site" --no-deps --only-binary=:all: --python-version "$PY" \
  --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any "${specs[@]}"
rm -rf "$site"/ray/jars "$site"/ray/dashboard/client/build "$site"/ray/rllib "$site"/ray/llm \
  "$site"/ray/serve "$site"/bin
find "$site" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p .gpu
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
tar -C "$site" -cf - . | xz -T0 -6 > .gpu/site.tar.xz
ls -l .gpu/site.tar.xz
