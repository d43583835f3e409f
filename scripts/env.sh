#!/usr/bin/env bash
# Create or refresh the project's virtual environment (.venv) and activate it.
# Sourced by train.sh and test.sh; safe to run again: it reinstalls only when
# pyproject.toml or this script changed since the last successful install.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLLM_SKYRL_VENV:-$ROOT/.venv}"

find_python312() {
  local candidate
  for candidate in "${PYTHON:-}" python3.12; do
    if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 \
      && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$candidate"; return 0
    fi
  done
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  command -v pyenv >/dev/null 2>&1 && root="$(pyenv root)"
  for candidate in "$root"/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
    if [ -x "$candidate" ]; then echo "$candidate"; return 0; fi
  done
  echo "error: Python 3.12 not found (SkyRL 0.4 needs it). Install it (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12." >&2
  return 1
}

stamp_of() {
  cat "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh" | sha256sum | cut -d' ' -f1
}

# Byte-code for the modules a run imports, written once at install. Python writes it on first import
# unless PYTHONDONTWRITEBYTECODE is set (many machines and container images set it): then every
# process compiles torch, transformers and the rest from source again, and a run's start-up takes
# 2-3x as long (bench/README.md: 'Start-up'). pip compiles what it installs into site-packages, uv
# with --compile-bytecode; this does the editable sources. A file that fails to compile is one no run
# imports (some packages ship Python-2 test data), so failures are not errors here.
compile_bytecode() {
  "$VENV/bin/python" -m compileall -qq -j 0 "$@" >/dev/null 2>&1 || true
}

# scripts/install_rllm.sh takes the functions above and does its own installing.
if [ "${RLLM_SKYRL_ENV_FUNCTIONS_ONLY:-0}" = "1" ]; then return 0; fi

if [ ! -x "$VENV/bin/python" ]; then
  PY="$(find_python312)"
  echo "Creating virtual environment in $VENV with $PY"
  "$PY" -m venv "$VENV"
fi

# A venv that scripts/install_rllm.sh built (rLLM with all of its dependencies) is refreshed by that
# script, with its overrides: pip alone would move packages out from under rLLM's dependencies.
if [ -f "$VENV/.rllm_full_source" ] \
  && [ "$(cat "$VENV/.rllm_skyrl_install_stamp" 2>/dev/null)" != "$(stamp_of)" ]; then
  "$ROOT/scripts/install_rllm.sh" "$(cat "$VENV/.rllm_full_source")"
fi

STAMP_FILE="$VENV/.rllm_skyrl_install_stamp"
if [ "$(cat "$STAMP_FILE" 2>/dev/null)" != "$(stamp_of)" ]; then
  echo "Installing dependencies into $VENV (first run takes a few minutes)..."
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # torch first and exactly pinned, so nothing later pulls a different build.
  "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT[dev]"
  compile_bytecode "$ROOT/rllm_skyrl" "$ROOT/examples"
  # rLLM (installed for the tests, see below) comes without its dependencies on purpose.
  broken="$("$VENV/bin/python" -m pip check 2>&1 | grep -v -e '^rllm ' -e '^No broken requirements' || true)"
  if [ -n "$broken" ]; then echo "$broken" >&2; exit 1; fi
  stamp_of > "$STAMP_FILE"
fi

export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"

# rLLM is not on PyPI: the test set-up installs the source snapshot this backend conforms to.
# `--no-deps` because rLLM's full dependency set pulls tinker, litellm and more that the trainer
# does not import; `codetiming` is the one small dependency the project's own set lacks.
# (scripts/install_rllm.sh installs rLLM as its users do, with every dependency; CI runs that.)
install_vendored_rllm() {
  local vendor="${RLLM_SKYRL_RLLM_VENDOR:-$ROOT/../shared/vendor/rllm}"
  local tarballs=("$vendor"/rllm-*.tar.gz)
  local tarball="${tarballs[0]}"
  if [ ! -f "$tarball" ]; then
    if [ "${CI:-}" = "true" ]; then
      echo "error: no rLLM snapshot in $vendor; CI runs the real-rLLM tests (set RLLM_SKYRL_RLLM_VENDOR)" >&2
      return 1
    fi
    return 0
  fi
  if [ -f "$VENV/.rllm_full_source" ]; then return 0; fi  # rLLM is there with all of its dependencies
  local stamp_file="$VENV/.rllm_vendor_stamp" stamp
  stamp="$(sha256sum "$tarball" | cut -d' ' -f1)"
  if [ "$(cat "$stamp_file" 2>/dev/null)" = "$stamp" ]; then return 0; fi
  echo "Installing rLLM from $tarball ..."
  local src="$VENV/src/rllm-vendored"
  rm -rf "$src" && mkdir -p "$src"
  tar xzf "$tarball" -C "$src"
  "$VENV/bin/python" -m pip install --quiet --no-deps -e "$src/rllm"
  "$VENV/bin/python" -m pip install --quiet codetiming
  compile_bytecode "$src"
  echo "$stamp" > "$stamp_file"
}
