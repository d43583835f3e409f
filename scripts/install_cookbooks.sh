#!/usr/bin/env bash
# Install rLLM cookbooks into the project's environment as their READMEs do, each with the
# dependencies its pyproject.toml declares, plus rLLM's `rewards` extra (sympy, pylatexenc), which the
# math cookbooks' graders import. rLLM must already be installed from its source (scripts/install_rllm.sh).
#
#   scripts/install_cookbooks.sh math solver_judge_flow math_tool_agent frozenlake 'agent_frameworks[langgraph]'
#
# A cookbook's optional extras go in brackets after its name, as pip takes them.
#
# Safe to run again: uv finds everything in place and installs nothing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RLLM_SKYRL_ENV_FUNCTIONS_ONLY=1 source "$ROOT/scripts/env.sh"
OVERRIDES="$ROOT/constraints/rllm-overrides.txt"

if [ $# -eq 0 ]; then
  echo "usage: $0 COOKBOOK... (folder names under rLLM's cookbooks/)" >&2
  exit 2
fi

# What a cookbook needs beyond this environment, and how to tell it is there: without it the cookbook
# would train on rewards that mean nothing, so it is refused before anything else.
needs() {
  case "$1" in
    finqa) [ -n "${OPENAI_API_KEY:-}" ] \
      || echo "its evaluator grades every answer with OpenAI's API (a judge LLM): set OPENAI_API_KEY on a machine that reaches api.openai.com (without it every episode scores 0)" ;;
  esac
}

for name in "$@"; do
  missing="$(needs "${name%%\[*}")"
  [ -z "$missing" ] || { echo "error: ${name%%\[*} is left out: $missing" >&2; exit 2; }
done

RLLM_DIR="$(cd / && "$VENV/bin/python" -c 'import pathlib, rllm; print(pathlib.Path(rllm.__file__).resolve().parent.parent)' 2>/dev/null)" \
  || { echo "error: rLLM is not installed in $VENV; run scripts/install_rllm.sh first" >&2; exit 1; }
UV="$(command -v uv || echo "$VENV/bin/uv")"
[ -x "$UV" ] || { echo "error: no uv on PATH or in $VENV; run scripts/install_rllm.sh first" >&2; exit 1; }

# rLLM and this package by name, so the installed editables stay as they are while the resolver
# keeps to their requirements: reinstalling them would leave any process starting meanwhile (a Ray
# worker of a run going on beside) unable to import them.
targets=("rllm[rewards]" "rllm-skyrl[dev]")
for name in "$@"; do
  folder="${name%%\[*}"
  [ -f "$RLLM_DIR/cookbooks/$folder/pyproject.toml" ] \
    || { echo "error: $RLLM_DIR/cookbooks/$folder is not a cookbook (no pyproject.toml)" >&2; exit 2; }
  targets+=(-e "cookbooks/$name")
done
(cd "$RLLM_DIR" && "$UV" pip install --quiet --python "$VENV/bin/python" --compile-bytecode \
  --override "$OVERRIDES" "${targets[@]}")
