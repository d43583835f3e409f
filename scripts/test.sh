#!/usr/bin/env bash
# Run the test suite (creates/refreshes .venv first). Extra arguments go to pytest.
# Slow tests (learning curves on a real model) are opt-in: RLLM_SKYRL_SLOW=1.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
marker="not slow"
[ "${RLLM_SKYRL_SLOW:-0}" = "1" ] && marker=""
set +e
python -m pytest -m "$marker" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests; refusing to report success." >&2
  exit 1
fi
exit "$rc"
