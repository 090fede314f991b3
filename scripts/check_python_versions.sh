#!/usr/bin/env bash
# Check the Python versions meshforge declares (requires-python) beyond the one `make` uses.
#
# Usage: scripts/check_python_versions.sh [python3.12 python3.13 ...]
#
# For each interpreter: a fresh venv under build/py-check/, meshforge installed from this checkout
# without its heavy dependencies (torch's wheels are per interpreter, and only the CPU build of the
# `make` interpreter may be installed here), then the torch-free config layer's tests (loading,
# validation, the unsupported and no-op lists, the field walk, the import layering). A full check on
# another version runs `make test` with that interpreter as `python3`.
set -euo pipefail
cd "$(dirname "$0")/.."
interpreters=("$@")
if [ ${#interpreters[@]} -eq 0 ]; then
  for v in 3.12 3.13; do
    if command -v "python$v" >/dev/null 2>&1 && "python$v" -c '' 2>/dev/null; then
      interpreters+=("python$v")
    elif [ -d "$HOME/.pyenv/versions" ]; then
      found=$(ls -d "$HOME"/.pyenv/versions/"$v".* 2>/dev/null | tail -n 1 || true)
      [ -n "$found" ] && interpreters+=("$found/bin/python")
    fi
  done
fi
if [ ${#interpreters[@]} -eq 0 ]; then
  echo "no other Python interpreter found (tried python3.12, python3.13)"; exit 0
fi
status=0
for py in "${interpreters[@]}"; do
  version=$("$py" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
  venv="build/py-check/$version"
  echo "== Python $version ($py)"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q pydantic==2.14.4 pyyaml==6.0.4 pytest==9.2.0
  "$venv/bin/python" -m pip install -q --no-deps .
  # Run from a copy of the tests so `import meshforge` is the installed package, not src/.
  if ! "$venv/bin/python" -m pytest -q -p no:cacheprovider \
      tests/unit/test_config_good.py tests/unit/test_config_bad.py tests/unit/test_config_unsupported.py \
      tests/unit/test_config_fields.py tests/unit/test_layering.py; then
    status=1
  fi
done
exit $status
