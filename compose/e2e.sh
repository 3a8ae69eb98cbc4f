#!/usr/bin/env bash
# `docker compose up` end to end on a real engine, as docs/deploy.md deploys it: builds the images (from Debian
# packages and the host's pip configuration when no registry is reachable); `cleave auth init --tls --sites`;
# a hub from docker-compose.yml + docker-compose.auth.yml (NATS with credentials and TLS, scheduler, monitor,
# runner, `--scale worker=3`) and a site from docker-compose.site.yml (a leaf node dialling the hub's leaf-node
# port with the site's credential, 2 workers); a job of E2E_STEPS tiny steps submitted from this host with the
# submitter's credential (`cleave submit`); meanwhile a worker killed, one frozen and thawed, the runner killed
# (its PS with it: it resumes), a worker restarted (the chaos scripts). It waits for `cleave status` to say
# done and checks that every step appears exactly once, that the losses equal `cleave train --reference` of
# the same job, that the site's workers computed tiles, and that `cleave export` over the network loads; tears
# everything down. One summary line; non-zero on failure; `SKIPPED: why` (exit 0) where it cannot run.
# Then the replicas scenario: the stack again with docker-compose.replicas.yml (2 PS replicas, 4 workers, no
# credentials), a job of E2E_REPLICA_STEPS, replica 1 killed (the group re-forms from the last commit), the
# same checks against the same job with micro_batches 2 (E2E_REPLICA_STEPS=0 skips it).
# Usage: compose/e2e.sh (as root)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
source "$HERE/e2e/engine.sh"
STEPS=${E2E_STEPS:-200}
REPLICA_STEPS=${E2E_REPLICA_STEPS:-40}
RUN="$E2E_DIR/run"
CLEAVE="$REPO/.venv/bin/cleave"
SITE=e2e-site
t0=$(date +%s); built=0; kills=0
e2e_can_run
[ -x "$CLEAVE" ] || e2e_skip "no $REPO/.venv (the reference run needs it: pip install -e '.[dev]')"
e2e_engine_start
export CLEAVE_COMPOSE_NATS_PORT=${CLEAVE_COMPOSE_NATS_PORT:-14222} CLEAVE_COMPOSE_MONITOR_PORT=${CLEAVE_COMPOSE_MONITOR_PORT:-18787}
export CLEAVE_COMPOSE_LEAF_PORT=${CLEAVE_COMPOSE_LEAF_PORT:-17422} CLEAVE_COMPOSE_SITE_PORT=${CLEAVE_COMPOSE_SITE_PORT:-14223}
export CLEAVE_E2E_RUN_DIR=$RUN CLEAVE_COMPOSE_AUTH_DIR=$RUN/auth
export CLEAVE_COMPOSE_SITE=$SITE CLEAVE_COMPOSE_SITE_DIR=$RUN/auth/sites/$SITE
NATS="tls://127.0.0.1:$CLEAVE_COMPOSE_NATS_PORT"
FILES=(-f "$HERE/docker-compose.yml" -f "$HERE/docker-compose.auth.yml" -f "$HERE/e2e/job.yml")
dc() { docker compose --project-directory "$HERE" "${FILES[@]}" "$@"; }
ds() { docker compose --project-directory "$HERE" -f "$HERE/docker-compose.site.yml" -f "$HERE/e2e/site.yml" "$@"; }
trap 'ds down -v --timeout 20 >/dev/null 2>&1 || true; dc down -v --timeout 20 >/dev/null 2>&1 || true; e2e_engine_stop' EXIT
fail() { echo "e2e: FAILED: $*" >&2; dc logs --tail 30 runner >&2 || true; ds logs --tail 20 site >&2 || true; exit 1; }
metrics() { echo "$RUN/runner/jobs/$job/metrics.jsonl"; }
steps_done() { [ -f "$(metrics)" ] && wc -l <"$(metrics)" || echo 0; }
wait_step() {  # until the PS has committed $1 steps
  local deadline=$(( $(date +%s) + 600 ))
  while [ "$(steps_done)" -lt "$1" ]; do [ "$(date +%s)" -lt "$deadline" ] || fail "step $1 not reached"; sleep 1; done
}
state() { "$CLEAVE" status --nats "$NATS" --auth "$RUN/auth" --job-id "$job" --json 2>/dev/null \
            | python3 -c 'import json, sys; print(json.load(sys.stdin)["state"])' || echo unknown; }
wait_done() {  # until `cleave status` says the job is done (or failed: then fail)
  local deadline=$(( $(date +%s) + 900 )) s
  while s=$(state); [ "$s" != done ]; do
    [ "$s" != failed ] || fail "the job failed: $("$CLEAVE" status --nats "$NATS" --auth "$RUN/auth" --job-id "$job")"
    [ "$(date +%s)" -lt "$deadline" ] || fail "the job did not finish (state $s)"; sleep 5
  done
}

# PyTorch's own run-to-run spread: the reference again as other machines sum (OUT.NAME), each combination of one
# thread, ATen's kernels at AVX2 width or not vectorised and MKL's GEMMs without AVX-512
# (cleave.runtime.threads.spread_runs: "NAME VAR=VALUE ..." each)
mapfile -t SPREAD_RUNS < <("$REPO/.venv/bin/python" -c 'from cleave.runtime.threads import spread_runs
for n, e in spread_runs().items(): print(n, *(f"{k}={v}" for k, v in e.items()))')
[ "${#SPREAD_RUNS[@]}" -gt 0 ] || fail "cleave.runtime.threads.spread_runs could not be read"
reference() {  # reference JOB OUT: `cleave train --reference` of the job (OUT.jsonl), and each of SPREAD_RUNS
  for run in "" "${SPREAD_RUNS[@]}"; do
    local suffix=${run:+.${run%% *}}
    env ${run:+${run#* }} nice -n 5 "$CLEAVE" train --config "$1" \
      --data "$RUN/data.txt" --reference --metrics-out "$2$suffix.jsonl" --run-dir "$2$suffix" \
      >"$RUN/reference.log" 2>&1 || return 1
  done
}

check_run() {  # check_run METRICS REFERENCE STEPS: every step once, losses equal the reference within the envelope
  python3 - "$@" "${SPREAD_RUNS[@]%% *}" <<'PY'
import json, sys

def losses(path):
    return {m["step"]: m["loss"] for m in map(json.loads, open(path)) if m}

def spread(a, b):
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in a)

got = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
ref = losses(sys.argv[2] + ".jsonl")
steps = [m["step"] for m in got]
if steps != list(range(int(sys.argv[3]))):
    sys.exit(f"steps are not 0..{int(sys.argv[3]) - 1} exactly once: {len(steps)} lines, {len(set(steps))} distinct")
diff = spread({m["step"]: m["loss"] for m in got}, ref)
# PyTorch's own run-to-run spread: the largest difference of the same reference run as other machines sum it
# (SPREAD_RUNS); over hundreds of steps it reaches 1e-4 and more on some data. The fleet must stay inside it.
envelope = max(spread(losses(f"{sys.argv[2]}.{name}.jsonl"), ref) for name in sys.argv[4:])
limit = max(1e-4, 2 * envelope)
if diff > limit:
    sys.exit(f"losses differ from the reference by up to {diff:.2e} (relative), over {limit:.1e} "
             f"(PyTorch's own spread over {', '.join(sys.argv[4:])}: {envelope:.1e}, x2, at least 1e-4)")
print(f"{len(steps)} steps once, max loss diff {diff:.1e} (PyTorch's own spread {envelope:.1e})")
PY
}

site_tiles() {  # the site's workers and the tiles they report done (the hub's registry, operators' credential)
  "$REPO/.venv/bin/python" "$HERE/e2e/registry_tiles.py" "$NATS" "$RUN/auth/admin.nk" "$RUN/auth/tls/ca.pem" "$SITE-w" \
    | "$REPO/.venv/bin/python" -c "import json, sys; done = json.load(sys.stdin); print(len(done), sum(done.values()))"
}

e2e_compose_plugin >/dev/null
if docker pull -q python:3.11-slim >/dev/null 2>&1 && docker pull -q nats:2.15.1-alpine >/dev/null 2>&1; then
  dc build -q; export CLEAVE_COMPOSE_IMAGE=cleave:latest; built="1 (Cleave on the public images)"
else  # no registry: Debian packages and the host's pip configuration
  e2e_base_images; e2e_cleave_image cleave-e2e:latest; built="3 (Debian base, NATS, Cleave)"
  export CLEAVE_COMPOSE_IMAGE=cleave-e2e:latest CLEAVE_COMPOSE_NATS_IMAGE=$E2E_NATS_IMAGE
fi
rm -rf "$RUN"; mkdir -p "$RUN"; chmod 0777 "$RUN"  # the runner runs as uid 10001
"$CLEAVE" auth init --out "$RUN/auth" --tls --server-dir /etc/nats/auth --sites "$SITE" >/dev/null || fail "auth init"
job="e2e-$(date +%s)"
# the same text on both sides ("builtin" is CPython's own docs, which differ between Debian's and the host's),
# and the same text every run: PyTorch's spread and the fleet's differences depend on it (e2e/corpus.txt.zst)
"$REPO/.venv/bin/python" -c 'import sys, zstandard; sys.stdout.buffer.write(zstandard.ZstdDecompressor().decompress(open(sys.argv[1], "rb").read()))' \
  "$HERE/e2e/corpus.txt.zst" >"$RUN/data.txt"
printf '{"job_id": "%s", "preset": "tiny", "steps": %d, "data": "/e2e/data.txt"}\n' "$job" "$STEPS" >"$RUN/job.json"
reference "$RUN/job.json" "$RUN/reference" &
ref_pid=$!
dc up -d --no-build --scale worker=3 >/dev/null 2>&1 || fail "compose up (the hub)"
ds up -d --no-build >/dev/null 2>&1 || fail "compose up (the site)"
"$CLEAVE" submit --nats "$NATS" --auth "$RUN/auth" --config "$RUN/job.json" --workers 5 --wait 300 >"$RUN/submit.log" 2>&1 \
  || fail "cleave submit: $(cat "$RUN/submit.log")"
wait_step 20;  "$HERE/chaos/kill.sh" "${FILES[@]}" worker; kills=$((kills + 1))
wait_step 50;  "$HERE/chaos/freeze.sh" "${FILES[@]}" worker 3
wait_step 80;  "$HERE/chaos/kill.sh" "${FILES[@]}" runner; kills=$((kills + 1))
wait_step 110; "$HERE/chaos/restart.sh" "${FILES[@]}" worker
wait_done
wait "$ref_pid" || fail "the reference run failed: $(tail -3 "$RUN/reference.log")"
summary=$(check_run "$(metrics)" "$RUN/reference" "$STEPS") || fail "$summary"
read -r site_workers site_done < <(site_tiles) || fail "the hub's registry could not be read"
[ "$site_done" -gt 0 ] || fail "the site's $site_workers workers computed no tile"
"$CLEAVE" export --nats "$NATS" --auth "$RUN/auth" --job-id "$job" --out "$RUN/model" >/dev/null 2>&1 \
  || fail "cleave export over the network"
"$REPO/.venv/bin/python" -c "import sys, transformers; transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])" \
  "$RUN/model" 2>/dev/null || fail "the exported model does not load in transformers"
hub="$summary, the site's $site_workers workers computed $site_done tiles, exported over the network"
replicas=""
if [ "$REPLICA_STEPS" -gt 0 ]; then  # the replicas scenario, on a fresh stack (down -v: no JetStream left)
  t1=$(date +%s); ds down -v --timeout 20 >/dev/null 2>&1; dc down -v --timeout 20 >/dev/null 2>&1
  FILES=(-f "$HERE/docker-compose.yml" -f "$HERE/docker-compose.replicas.yml" -f "$HERE/e2e/replicas.yml")
  job="e2e-replicas-$(date +%s)"; rm -f "$RUN/metrics.jsonl"
  metrics() { echo "$RUN/metrics.jsonl"; }
  printf '{"job_id": "%s", "preset": "tiny", "steps": %d, "data": "/e2e/data.txt"}\n' "$job" "$REPLICA_STEPS" >"$RUN/job.json"
  # the same-option reference: two replicas' mean gradient over their halves of each batch is PyTorch's gradient
  # accumulation over two micro-batches (against the plain reference, the fleet's spread reached 1.1e-4 here)
  printf '{"job_id": "%s-ref", "preset": "tiny", "steps": %d, "micro_batches": 2, "data": "/e2e/data.txt"}\n' "$job" "$REPLICA_STEPS" >"$RUN/job-ref.json"
  reference "$RUN/job-ref.json" "$RUN/reference-replicas" || fail "the reference run failed: $(tail -3 "$RUN/reference.log")"
  dc up -d --no-build --scale worker=4 >/dev/null 2>&1 || fail "compose up (replicas)"
  wait_step $(( REPLICA_STEPS / 3 )); "$HERE/chaos/kill.sh" "${FILES[@]}" ps-1; kills=$((kills + 1))
  wait_step "$REPLICA_STEPS"  # replica 0 exits 5 and comes back once after the kill: wait for the job, not for it
  for svc in ps ps-1; do
    code=$(timeout 900 docker wait "$(dc ps -q -a "$svc")") || fail "the PS replica $svc did not finish"
    [ "$code" = 0 ] || fail "the PS replica $svc exited with $code"
  done
  r=$(check_run "$RUN/metrics.jsonl" "$RUN/reference-replicas" "$REPLICA_STEPS") || fail "replicas: $r"
  again=$(docker inspect -f '{{.RestartCount}}' "$(dc ps -q -a ps)")  # replica 0's exits 5, restarted by compose
  replicas=", 2 PS replicas (replica 1 killed, replica 0 restarted by compose $again time(s)): $r in $(( $(date +%s) - t1 ))s"
fi
echo "e2e: ok: images built $built, a hub and a site with credentials and TLS, kills $kills (+1 freeze/thaw, 1 restart), $hub$replicas, $(( $(date +%s) - t0 ))s"
