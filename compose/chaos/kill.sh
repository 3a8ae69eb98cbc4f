#!/usr/bin/env bash
# SIGKILL one container of SERVICE (worker|ps|scheduler|nats|monitor|random), then bring it back:
# `docker kill` bypasses restart policies, so the script restores the service itself, as a crashed
# machine's replacement would. Usage: kill.sh SERVICE [--every SECONDS --count N]
source "$(dirname "$0")/lib.sh"
service=${1:?usage: kill.sh SERVICE [--every S --count N]}; shift
every=0; count=1
while [ $# -gt 0 ]; do case $1 in --every) every=$2; shift 2;; --count) count=$2; shift 2;; *) echo "unknown $1" >&2; exit 2;; esac; done
for i in $(seq 1 "$count"); do
  [ "$i" -gt 1 ] && sleep "$every"
  read -r svc id < <(pick "$service")
  log "kill $svc ($id)"
  docker kill --signal KILL "$id" >/dev/null
  compose up -d --no-recreate "$svc" >/dev/null   # starts the stopped container again (scale is kept)
  docker start "$id" >/dev/null 2>&1 || true
  log "restored $svc"
done
