# Shared helpers for the chaos scripts: run from anywhere, act on the compose project in ../
set -euo pipefail
COMPOSE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
compose() { docker compose -f "$COMPOSE_DIR/docker-compose.yml" "$@"; }
log() { echo "$(date +%H:%M:%S) $*"; }

# pick SERVICE: "random" picks one of the roles; prints one container id of that service
pick() {
  local service=$1
  if [ "$service" = random ]; then
    service=$(printf '%s\n' worker worker worker ps scheduler nats | shuf -n1)
  fi
  local id
  id=$(compose ps -q "$service" | shuf -n1)
  [ -n "$id" ] || { echo "no running container for service '$service'" >&2; exit 2; }
  echo "$service $id"
}
