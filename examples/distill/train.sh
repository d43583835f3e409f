#!/usr/bin/env bash
# On-policy distillation on the digit task in one command: train the teacher and the student's start
# (once; TEACHER_DIR and STUDENT_DIR keep them), serve the teacher with the CPU inference server,
# distil the student from it, stop the server. The student starts partly taught (20 of the teacher's
# 100 steps: the right digit ~13% of the time); a random one almost never samples the answer, so its
# sampled reverse KL has nothing to pull towards (README: 'On-policy distillation').
# Arguments are Hydra overrides for the student's run (e.g. rllm.trainer.total_batches=100).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env.sh
teacher="${TEACHER_DIR:-runs/distill/teacher}"
student="${STUDENT_DIR:-runs/distill/student_start}"
[ -f "$teacher/config.json" ] || python -m examples.distill.teacher "$teacher"
[ -f "$student/config.json" ] || python -m examples.distill.teacher "$student" 20
port="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
export RLLM_SKYRL_SERVER_TOKEN="${RLLM_SKYRL_SERVER_TOKEN:-$(python -c 'import secrets; print(secrets.token_hex(16))')}"
python -m rllm_skyrl.inference --model "$teacher" --port "$port" --parent-pid $$ &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
python - "$port" "$server" <<'PY'
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
for _ in range(1200):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
        sys.exit(0)
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit("error: the teacher's server exited before it was ready; see its output above")
        time.sleep(0.25)
sys.exit("error: the teacher's server was not ready in 300 s")
PY
python -m examples.distill.train "teacher.url=http://127.0.0.1:$port/v1" "teacher.model_dir=$teacher" \
  "model.path=$student" "$@"
