#!/usr/bin/env bash
# Freeze one container of SERVICE (SIGSTOP via `docker pause`) for SECONDS, then thaw it: it wakes up and
# sends stale results, which the PS must drop. Usage: freeze.sh [-f FILE]... SERVICE SECONDS
source "$(dirname "$0")/lib.sh"
set -- "${ARGS[@]}"
service=${1:?usage: freeze.sh [-f FILE]... SERVICE SECONDS}; seconds=${2:?usage: freeze.sh [-f FILE]... SERVICE SECONDS}
read -r svc id < <(pick "$service")
log "freeze $svc ($id) for ${seconds}s"
docker pause "$id" >/dev/null
sleep "$seconds"
docker unpause "$id" >/dev/null
log "thaw $svc"
