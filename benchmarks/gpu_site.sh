#!/usr/bin/env bash
# The Python packages baton needs beyond a GPU machine's own image (which has torch, pyarrow,
# numpy, pandas, matplotlib, yaml, but not Ray or MLflow), for a machine that reaches no
# package index: downloaded here for its Python (PY, default 3.12) and packed into one file,
# .gpu/site.tar.xz (58 MB: Ray's Java jars, dashboard client and the libraries baton does not
# use are left out; the carry limit of a device call is 64 MiB).
#
#   bash benchmarks/gpu_site.sh                  # here, once (needs pip and a package index)
#   mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/site.tar.xz \
#     && PYTHONPATH=/tmp/site:$PWD/platform LIMIT=540 bash benchmarks/gpu_suite.sh   # there
#
# The versions are this machine's (its .venv's), so the GPU machine runs what CI tests.
# --no-deps: each needed package is named.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-3.12}
PIP=${PIP:-.venv/bin/pip}
PIP_PYTHON=${PIP_PYTHON:-.venv/bin/python}
# The packages: what baton's own requirements need on Python $PY, found by walking the
# installed distributions' metadata, less the image's own large builds (torch, numpy,
# pandas, pyarrow, matplotlib). ray[default] is among them: Ray Train's controller polls
# Ray's state API, and on a bare ray it waited past its step's limit (H100, 2026-11-27).
specs=($($PIP_PYTHON - "$PY" <<'PYEOF'
import sys
from importlib import metadata
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

py = sys.argv[1]


def closure(roots, skip=frozenset()):
    """name -> (version, extras) of every installed distribution that `roots` need on `py`."""
    seen, todo = {}, list(roots)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in skip or (name in seen and set(req.extras) <= seen[name][1]):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"not installed here: {name}")
        extras = seen.get(name, ("", set()))[1] | set(req.extras)
        seen[name] = (dist.version, extras)
        for dep in map(Requirement, dist.requires or []):
            if dep.marker is None or any(dep.marker.evaluate({"python_version": py, "extra": e})
                                         for e in extras or {""}):
                todo.append(dep)
    return seen


# skipped by name only, not with what they need: the image's versions of what they need may
# differ from this machine's (its pandas needed no `six`, which opencensus does)
image = frozenset({"torch", "numpy", "pandas", "pyarrow", "matplotlib"})
baton = [Requirement(text) for text in metadata.requires("baton")]
roots = [r for r in baton if r.marker is None or r.marker.evaluate({"python_version": py, "extra": ""})]
print(*sorted(f"{n}=={v}" for n, (v, _) in closure(roots, image).items()))
PYEOF
))
[ ${#specs[@]} -gt 0 ] || exit 1
echo "${#specs[@]} packages: ${specs[*]}"
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
