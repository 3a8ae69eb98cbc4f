#!/usr/bin/env bash
# The container chaos scripts on a real engine and the real compose file, with stand-in workers:
# kill.sh keeps `--scale worker=3` (the killed container comes back, no fourth one appears), every script
# takes the stack's `-f` files, freeze.sh thaws what it froze, restart.sh restarts. Exits non-zero on a
# failure and prints one summary line. Usage: compose/e2e/chaos-check.sh (as root; see engine.sh)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
COMPOSE="$(cd "$HERE/.." && pwd)"
source "$HERE/engine.sh"
t0=$(date +%s)
e2e_can_run
e2e_engine_start
trap 'compose_ down -v --timeout 5 >/dev/null 2>&1 || true; e2e_engine_stop' EXIT
e2e_compose_plugin
e2e_base_images
export CLEAVE_COMPOSE_IMAGE=$E2E_BASE_IMAGE CLEAVE_COMPOSE_NATS_IMAGE=$E2E_NATS_IMAGE
FILES=(-f "$COMPOSE/docker-compose.yml" -f "$HERE/standin.yml")
compose_() { docker compose --project-directory "$COMPOSE" "${FILES[@]}" "$@"; }
running() { compose_ ps -q --status running worker | wc -l; }
fail() { echo "e2e chaos-check: FAILED: $*" >&2; exit 1; }

compose_ up -d --scale worker=3 --no-build worker >/dev/null 2>&1 || { compose_ up -d --scale worker=3 --no-build worker; exit 1; }
[ "$(running)" = 3 ] || fail "$(running) workers running after up --scale worker=3"
started() { for id in $(compose_ ps -q -a worker); do docker inspect -f '{{.Id}} {{.State.StartedAt}}' "$id"; done | sort; }
before=$(started)
"$COMPOSE/chaos/kill.sh" "${FILES[@]}" worker
[ "$(compose_ ps -q -a worker | wc -l)" = 3 ] || fail "kill.sh changed the scale: $(compose_ ps -q -a worker | wc -l) workers"
[ "$(running)" = 3 ] || fail "$(running) of 3 workers running after kill.sh"
changed=$(comm -13 <(echo "$before") <(started) | wc -l)
[ "$changed" = 1 ] || fail "$changed workers restarted by one kill (want the victim only)"
"$COMPOSE/chaos/kill.sh" "${FILES[@]}" worker --count 2 --every 0
[ "$(running)" = 3 ] && [ "$(compose_ ps -q -a worker | wc -l)" = 3 ] || fail "scale not kept after 3 kills"
"$COMPOSE/chaos/freeze.sh" "${FILES[@]}" worker 1
[ "$(compose_ ps -q --status paused worker | wc -l)" = 0 ] || fail "freeze.sh left a worker paused"
"$COMPOSE/chaos/restart.sh" "${FILES[@]}" worker
[ "$(running)" = 3 ] || fail "$(running) of 3 workers running after restart.sh"
echo "e2e chaos-check: ok: kill x3, freeze/thaw, restart; 3 of 3 workers running, scale kept; $(( $(date +%s) - t0 ))s"
