#!/usr/bin/env bash
# Install rLLM with all of its declared dependencies into the project's virtual environment, beside
# rllm-skyrl: rLLM from its checkout, as its users install it (uv), plus this backend.
#
#   scripts/install_rllm.sh PATH_TO_RLLM_CHECKOUT      (or a snapshot tarball, e.g. rllm-9beb6e0f.tar.gz)
#
# The environment is .venv, or RLLM_SKYRL_VENV as for scripts/env.sh: new, the project's own, or one
# that has rLLM installed already. The two dependencies of rLLM that cannot coexist with SkyRL 0.4.0's
# own requirements are overridden by constraints/rllm-overrides.txt (README: "Installing next to
# rLLM"); afterwards `pip check` lists those conflicts and nothing else, or this script fails. Safe to
# run again: it reinstalls only when the rLLM source's dependencies, the overrides, pyproject.toml or
# these scripts changed. Uses `uv` from PATH, or installs it into the environment with pip.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RLLM_SKYRL_ENV_FUNCTIONS_ONLY=1 source "$ROOT/scripts/env.sh"
OVERRIDES="$ROOT/constraints/rllm-overrides.txt"
FULL_STAMP_FILE="$VENV/.rllm_full_stamp"
FULL_RLLM_SOURCE_FILE="$VENV/.rllm_full_source"  # env.sh refreshes a venv that has it through this script

if [ $# -ne 1 ]; then
  echo "usage: $0 PATH_TO_RLLM_CHECKOUT (or an rLLM snapshot tarball)" >&2
  exit 2
fi
SOURCE="$(realpath "$1")"

is_rllm_project() {
  [ -f "$1/pyproject.toml" ] && grep -q '^name = "rllm"' "$1/pyproject.toml"
}

# What the installed dependencies depend on: rLLM's declared dependencies (its pyproject files; the
# checkout is installed editable, so its code is live) and everything on this side.
if [ -d "$SOURCE" ]; then
  is_rllm_project "$SOURCE" || { echo "error: $SOURCE is not an rLLM checkout (no pyproject.toml naming rllm)" >&2; exit 2; }
  RLLM_DIR="$SOURCE"
  source_id="$(echo "$SOURCE"; cat "$SOURCE/pyproject.toml" "$SOURCE"/rllm-model-gateway/pyproject.toml 2>/dev/null)"
elif [ -f "$SOURCE" ]; then
  source_id="$(sha256sum "$SOURCE" | cut -d' ' -f1)"
  RLLM_DIR=""
else
  echo "error: $1 does not exist" >&2
  exit 2
fi
stamp="$( { echo "$source_id"; cat "$OVERRIDES" "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh" "${BASH_SOURCE[0]}"; } | sha256sum | cut -d' ' -f1)"

if [ ! -x "$VENV/bin/python" ]; then
  py="$(find_python312)"
  echo "Creating virtual environment in $VENV with $py"
  "$py" -m venv "$VENV"
fi
if [ "$(cat "$FULL_STAMP_FILE" 2>/dev/null)" = "$stamp" ]; then
  stamp_of > "$VENV/.rllm_skyrl_install_stamp"
  echo "rLLM and its dependencies in $VENV are up to date ($SOURCE)."
  exit 0
fi

if [ -z "$RLLM_DIR" ]; then  # a tarball: unpack it beside the environment, where the editable install points
  unpacked="$VENV/src/rllm-${source_id:0:12}"
  if [ ! -d "$unpacked" ]; then
    rm -rf "$unpacked.tmp" && mkdir -p "$unpacked.tmp"
    tar xzf "$SOURCE" -C "$unpacked.tmp"
    mv "$unpacked.tmp" "$unpacked"
  fi
  for candidate in "$unpacked" "$unpacked"/*; do
    if is_rllm_project "$candidate"; then RLLM_DIR="$candidate"; break; fi
  done
  [ -n "$RLLM_DIR" ] || { echo "error: $SOURCE holds no rLLM project (pyproject.toml naming rllm)" >&2; exit 2; }
fi

UV="$(command -v uv || true)"
if [ -z "$UV" ]; then
  if [ ! -x "$VENV/bin/uv" ]; then
    echo "Installing uv into $VENV (rLLM's installer; it applies the overrides)..."
    "$VENV/bin/python" -m pip install --quiet "uv>=0.5"
  fi
  UV="$VENV/bin/uv"
fi

echo "Installing rLLM from $RLLM_DIR with its dependencies into $VENV, overrides from $OVERRIDES ..."
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# One resolution for both projects, run in rLLM's checkout as its install guide does, so that rLLM's
# own uv settings apply as they do for its users (its overrides; rllm-model-gateway from the checkout).
(cd "$RLLM_DIR" && "$UV" pip install --python "$VENV/bin/python" --compile-bytecode --override "$OVERRIDES" \
  -e "$ROOT[dev]" -e .)
compile_bytecode "$RLLM_DIR" "$ROOT/rllm_skyrl" "$ROOT/examples"  # the editable sources (env.sh)

# The overrides must leave exactly the conflicts they name, and rLLM's dependencies must import.
"$VENV/bin/python" "$ROOT/build_backend/rllm_overrides.py" pip-check "$VENV/bin/python"
# (From /: a folder named rllm in the working directory would shadow the installed package.)
(cd / && LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/python" -c \
  "import rllm, litellm.proxy.proxy_server, tinker, tinker_cookbook, rllm_model_gateway, rllm_skyrl") \
  || { echo "error: rLLM or one of its dependencies does not import in $VENV" >&2; exit 1; }

echo "$SOURCE" > "$FULL_RLLM_SOURCE_FILE"
stamp_of > "$VENV/.rllm_skyrl_install_stamp"  # the project's own install is part of this one
echo "$stamp" > "$FULL_STAMP_FILE"
echo "rLLM and its dependencies are installed in $VENV beside rllm-skyrl; overridden (README: 'Installing next to rLLM'):"
"$VENV/bin/python" - "$ROOT/build_backend" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import rllm_overrides

for line in rllm_overrides.overridden_requirements(rllm_overrides.target_site_dirs()):
    print(f"  {line}")
PY
