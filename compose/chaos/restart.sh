#!/usr/bin/env bash
# Graceful restart (SIGTERM, then start) of one container of SERVICE, once or on a schedule.
# Usage: restart.sh [-f FILE]... SERVICE [--every S --count N]
source "$(dirname "$0")/lib.sh"
set -- "${ARGS[@]}"
service=${1:?usage: restart.sh [-f FILE]... SERVICE [--every S --count N]}; shift
every=0; count=1
while [ $# -gt 0 ]; do case $1 in --every) every=$2; shift 2;; --count) count=$2; shift 2;; *) echo "unknown $1" >&2; exit 2;; esac; done
for i in $(seq 1 "$count"); do
  [ "$i" -gt 1 ] && sleep "$every"
  read -r svc id < <(pick "$service")
  log "restart $svc ($id)"
  docker restart --time 15 "$id" >/dev/null
done
