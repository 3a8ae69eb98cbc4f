#!/usr/bin/env bash
# SIGKILL one container of SERVICE (worker|runner|scheduler|nats|monitor|random, or ps with docker-compose.replicas.yml), then bring it back:
# `docker kill` bypasses restart policies, so the script starts the same container again, as a crashed
# machine's replacement would. Starting that container keeps the scale: a stack started with
# `--scale worker=3` still has 3 workers (compose's `up` would reset it to deploy.replicas).
# Usage: kill.sh [-f FILE]... SERVICE [--every S --count N]
source "$(dirname "$0")/lib.sh"
set -- "${ARGS[@]}"
service=${1:?usage: kill.sh [-f FILE]... SERVICE [--every S --count N]}; shift
every=0; count=1
while [ $# -gt 0 ]; do case $1 in --every) every=$2; shift 2;; --count) count=$2; shift 2;; *) echo "unknown $1" >&2; exit 2;; esac; done
for i in $(seq 1 "$count"); do
  [ "$i" -gt 1 ] && sleep "$every"
  read -r svc id < <(pick "$service")
  log "kill $svc ($id)"
  docker kill --signal KILL "$id" >/dev/null
  docker wait "$id" >/dev/null
  docker start "$id" >/dev/null
  log "restored $svc ($id)"
done
