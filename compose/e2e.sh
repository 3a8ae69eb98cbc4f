#!/usr/bin/env bash
# `docker compose up` end to end on a real engine: builds the images (from Debian packages and the host's
# pip configuration when no registry is reachable), runs a job of E2E_STEPS tiny steps on
# `--scale worker=3`, kills a worker, freezes and thaws one, kills the PS, restarts a worker (the chaos
# scripts), waits for the job and checks that every step appears exactly once and the losses equal
# `cleave train --reference` of the same job; tears everything down. One summary line; non-zero on failure;
# `SKIPPED: why` (exit 0) where it cannot run. Usage: compose/e2e.sh (as root)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
source "$HERE/e2e/engine.sh"
STEPS=${E2E_STEPS:-200}
RUN="$E2E_DIR/run"
t0=$(date +%s); built=0; kills=0
e2e_can_run
[ -x "$REPO/.venv/bin/cleave" ] || e2e_skip "no $REPO/.venv (the reference run needs it: pip install -e '.[dev]')"
e2e_engine_start
export CLEAVE_COMPOSE_NATS_PORT=${CLEAVE_COMPOSE_NATS_PORT:-14222} CLEAVE_COMPOSE_MONITOR_PORT=${CLEAVE_COMPOSE_MONITOR_PORT:-18787}
export CLEAVE_E2E_RUN_DIR=$RUN
FILES=(-f "$HERE/docker-compose.yml" -f "$HERE/e2e/job.yml")
dc() { docker compose --project-directory "$HERE" "${FILES[@]}" "$@"; }
trap 'dc down -v --timeout 20 >/dev/null 2>&1 || true; e2e_engine_stop' EXIT
fail() { echo "e2e: FAILED: $*" >&2; dc logs --tail 30 ps >&2 || true; exit 1; }
steps_done() { [ -f "$RUN/metrics.jsonl" ] && wc -l <"$RUN/metrics.jsonl" || echo 0; }
wait_step() {  # until the PS has committed $1 steps
  local deadline=$(( $(date +%s) + 600 ))
  while [ "$(steps_done)" -lt "$1" ]; do [ "$(date +%s)" -lt "$deadline" ] || fail "step $1 not reached"; sleep 1; done
}

e2e_compose_plugin >/dev/null
if docker pull -q python:3.11-slim >/dev/null 2>&1 && docker pull -q nats:2.15.1-alpine >/dev/null 2>&1; then
  dc build -q; export CLEAVE_COMPOSE_IMAGE=cleave:latest; built="1 (Cleave on the public images)"
else  # no registry: Debian packages and the host's pip configuration
  e2e_base_images; e2e_cleave_image cleave-e2e:latest; built="3 (Debian base, NATS, Cleave)"
  export CLEAVE_COMPOSE_IMAGE=cleave-e2e:latest CLEAVE_COMPOSE_NATS_IMAGE=$E2E_NATS_IMAGE
fi
rm -rf "$RUN"; mkdir -p "$RUN"; chmod 0777 "$RUN"  # the PS runs as uid 10001
job="e2e-$(date +%s)"
# the same text on both sides ("builtin" is CPython's own docs, which differ between Debian's and the host's)
cat "$REPO/README.md" "$REPO"/docs/*.md >"$RUN/data.txt"
printf '{"job_id": "%s", "preset": "tiny", "steps": %d, "data": "/e2e/data.txt"}\n' "$job" "$STEPS" >"$RUN/job.json"
nice -n 5 "$REPO/.venv/bin/cleave" train --config "$RUN/job.json" --data "$RUN/data.txt" --reference \
  --metrics-out "$RUN/reference.jsonl" --run-dir "$RUN/reference" >"$RUN/reference.log" 2>&1 &
ref_pid=$!
dc up -d --no-build --scale worker=3 >/dev/null 2>&1 || fail "compose up"
wait_step 20;  "$HERE/chaos/kill.sh" "${FILES[@]}" worker; kills=$((kills + 1))
wait_step 50;  "$HERE/chaos/freeze.sh" "${FILES[@]}" worker 3
wait_step 80;  "$HERE/chaos/kill.sh" "${FILES[@]}" ps; kills=$((kills + 1))
wait_step 110; "$HERE/chaos/restart.sh" "${FILES[@]}" worker
code=$(timeout 900 docker wait "$(dc ps -q -a ps)") || fail "the PS did not finish"
[ "$code" = 0 ] || fail "the PS exited with $code"
wait "$ref_pid" || fail "the reference run failed: $(tail -3 "$RUN/reference.log")"
summary=$(python3 - "$RUN/metrics.jsonl" "$RUN/reference.jsonl" "$STEPS" <<'PY'
import json, sys
got = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
ref = {m["step"]: m["loss"] for m in map(json.loads, open(sys.argv[2])) if m}
steps = [m["step"] for m in got]
if steps != list(range(int(sys.argv[3]))):
    sys.exit(f"steps are not 0..{int(sys.argv[3]) - 1} exactly once: {len(steps)} lines, {len(set(steps))} distinct")
diff = max(abs(m["loss"] - ref[m["step"]]) / abs(ref[m["step"]]) for m in got)
if diff > 1e-4:
    sys.exit(f"losses differ from the reference by up to {diff:.2e} (relative)")
print(f"{len(steps)} steps once, max loss diff {diff:.1e}")
PY
) || fail "$summary"
echo "e2e: ok: images built $built, kills $kills (+1 freeze/thaw, 1 restart), $summary, $(( $(date +%s) - t0 ))s"
