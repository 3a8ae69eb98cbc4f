# Shared helpers for the chaos scripts: run from anywhere, act on the compose project in ../
# The scripts take the stack's own compose files, as `docker compose` does: leading `-f FILE` options
# (relative to the current directory) or COMPOSE_FILE; by default ../docker-compose.yml. An auth stack:
#   kill.sh -f docker-compose.yml -f docker-compose.auth.yml worker
set -euo pipefail
COMPOSE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
COMPOSE_FILES=()
while [ $# -gt 0 ] && [ "$1" = -f ]; do
  COMPOSE_FILES+=(-f "$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"); shift 2
done
if [ ${#COMPOSE_FILES[@]} -eq 0 ] && [ -z "${COMPOSE_FILE:-}" ]; then
  COMPOSE_FILES=(-f "$COMPOSE_DIR/docker-compose.yml")
fi
ARGS=("$@")  # what is left for the script itself
compose() { docker compose --project-directory "$COMPOSE_DIR" "${COMPOSE_FILES[@]}" "$@"; }
log() { echo "$(date +%H:%M:%S) $*"; }

# pick SERVICE: "random" picks one of the roles; prints the service and one running container id of it
pick() {
  local service=$1
  if [ "$service" = random ]; then
    service=$(printf '%s\n' worker worker worker runner scheduler nats | shuf -n1)
  fi
  local id
  id=$(compose ps -q "$service" | shuf -n1)
  [ -n "$id" ] || { echo "no running container for service '$service'" >&2; exit 2; }
  echo "$service $id"
}
