#!/usr/bin/env bash
# Run the test suite (creates/refreshes .venv first). Extra arguments go to pytest.
# The real rLLM the backend conforms to is installed from its source snapshot in
# ../shared/vendor/rllm when that folder exists (or RLLM_SKYRL_RLLM_VENDOR points at one):
# locally without its dependencies (quick), in CI (CI=true) with all of them, as rLLM's users
# install it (scripts/install_rllm.sh). RLLM_SKYRL_RLLM_INSTALL=full or =no-deps picks either.
# CI fails when rLLM's tests would skip.
# Slow tests (long learning curves, the realistic SmolLM2 runs) are opt-in locally with
# RLLM_SKYRL_SLOW=1, and always run in CI (CI=true), which has the time for them.
set -euo pipefail
cd "$(dirname "$0")/.."
rllm_install="${RLLM_SKYRL_RLLM_INSTALL:-$([ "${CI:-}" = "true" ] && echo full || echo no-deps)}"
case "$rllm_install" in
  full)
    vendor="${RLLM_SKYRL_RLLM_VENDOR:-../shared/vendor/rllm}"
    tarballs=("$vendor"/rllm-*.tar.gz)
    if [ ! -f "${tarballs[0]}" ]; then
      echo "error: no rLLM snapshot in $vendor; the full install needs one (set RLLM_SKYRL_RLLM_VENDOR)" >&2
      exit 1
    fi
    scripts/install_rllm.sh "${tarballs[0]}"
    source scripts/env.sh
    ;;
  no-deps)
    source scripts/env.sh
    install_vendored_rllm
    ;;
  *)
    echo "error: RLLM_SKYRL_RLLM_INSTALL=$rllm_install; use full or no-deps" >&2
    exit 2
    ;;
esac
marker="not slow"
if [ "${RLLM_SKYRL_SLOW:-0}" = "1" ] || [ "${CI:-}" = "true" ]; then marker=""; fi
# CI lists its 25 longest tests on every run, so the suite's cost stays in view.
durations=()
if [ "${CI:-}" = "true" ]; then durations=(--durations=25); fi
# Two test processes, a module at a time each (test/conftest.py: 'two test processes');
# RLLM_SKYRL_TEST_PROCESSES=0 runs the suite in this one.
processes=(-n "${RLLM_SKYRL_TEST_PROCESSES:-2}" --dist loadfile)
set +e
python -m pytest -m "$marker" "${processes[@]}" "${durations[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests; refusing to report success." >&2
  exit 1
fi
exit "$rc"
