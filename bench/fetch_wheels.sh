#!/usr/bin/env bash
# Download the wheels that megatrain needs and the GPU machine's image lacks (pydantic and what it
# requires), built for that image's CPython 3.12 on x86-64 Linux, into .whl/ at the repository root.
# .whl/ is git-ignored; a device `run` takes it along with carry: [".whl"] (bench/README.md).
#
# The versions are those of the development venv (pyproject.toml asks pydantic>=2.5); pydantic 2.14.3
# pins pydantic-core 2.50.4 and needs typing-extensions>=4.16.0, annotated-types>=0.6.0 and
# typing-inspection>=0.4.4 (its METADATA's Requires-Dist). typing-extensions is in the image, but
# not necessarily at 4.16, so it travels too. About 2.8 MB together.
#
# Usage: bench/fetch_wheels.sh            (PYTHON=... to choose the interpreter that runs pip)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0)

"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"

# pip install stops when .whl/ holds two versions of one distribution: refuse that here, by name.
"$PYTHON" - <<'EOF'
import collections, pathlib, re, sys
names = collections.defaultdict(list)
for whl in sorted(pathlib.Path(".whl").glob("*.whl")):
    names[re.sub(r"[-_.]+", "-", whl.name.split("-")[0]).lower()].append(whl.name)
dups = {k: v for k, v in names.items() if len(v) > 1}
if dups:
    sys.exit(f".whl/ holds more than one version of {sorted(dups)}: {dups}; delete all but one of each")
print(f".whl/: {sum(len(v) for v in names.values())} wheels, "
      f"{sum(p.stat().st_size for p in pathlib.Path('.whl').glob('*.whl')) / 1e6:.1f} MB")
EOF
