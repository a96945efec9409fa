#!/usr/bin/env bash
# Build Replica's image on a local Debian base and check, inside it, a short demo and a 2-process
# torchrun job. No image registry is needed: the base comes from debootstrap + docker import.
#
#   sudo docker/test.sh            # as root: installs docker.io/debootstrap and starts dockerd if needed
#   KEEP_IMAGE=1 docker/test.sh    # keep replica:test afterwards (the bases are always kept)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEBIAN_IMAGE=local/debian:bookworm
BASE=${REPLICA_DOCKER_BASE:-local/replica-python:bookworm}
IMAGE=${REPLICA_DOCKER_IMAGE:-replica:test}
CA=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
MIRROR=${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
say() { echo "[docker/test.sh] $*"; }
fail() { echo "[docker/test.sh] FAIL: $*" >&2; exit 1; }

# 1. the engine
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    say "installing docker.io and debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap
fi
if ! docker info >/dev/null 2>&1; then
    say "starting dockerd (log: /var/tmp/dockerd.log)"
    nohup dockerd >/var/tmp/dockerd.log 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || fail "dockerd did not start: see /var/tmp/dockerd.log"
fi

# 2. a Debian bookworm base, made here (about two minutes, once)
if ! docker image inspect "$DEBIAN_IMAGE" >/dev/null 2>&1; then
    say "debootstrap bookworm from $MIRROR"
    dir=$(mktemp -d)
    debootstrap --variant=minbase bookworm "$dir" "$MIRROR" >/var/tmp/debootstrap.log 2>&1 \
        || fail "debootstrap failed: see /var/tmp/debootstrap.log"
    tar -C "$dir" -c . | docker import - "$DEBIAN_IMAGE" >/dev/null
    rm -rf "$dir"
fi

# 3. Python on it, trusting this machine's certificates (for the test base only: the project's
#    Dockerfile stays clean)
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    say "building $BASE"
    ctx=$(mktemp -d)
    cp "$CA" "$ctx/host-ca.crt"
    cat >"$ctx/Dockerfile" <<DOCKERFILE
FROM $DEBIAN_IMAGE
COPY host-ca.crt /etc/ssl/host-ca.crt
ENV PIP_CERT=/etc/ssl/host-ca.crt SSL_CERT_FILE=/etc/ssl/host-ca.crt REQUESTS_CA_BUNDLE=/etc/ssl/host-ca.crt
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-pip ca-certificates && rm -rf /var/lib/apt/lists/*
DOCKERFILE
    docker build -q -t "$BASE" "$ctx" >/dev/null
    rm -rf "$ctx"
fi

# 4. torch's CPU wheel for bookworm's Python 3.11, where pip finds local wheels on this machine
for dir in ${REPLICA_TORCH_WHEELS:-} ${PIP_FIND_LINKS:-} /opt/wheels; do
    wheel=$(ls "$dir"/torch-2.13.0*cpu*-cp311-*linux*x86_64.whl 2>/dev/null | head -1 || true)
    if [ -n "$wheel" ]; then
        cp -u "$wheel" "$ROOT/docker/wheels/" && say "torch wheel: $(basename "$wheel")"
        break
    fi
done

# 5. the image, as a user builds it, on that base
say "building $IMAGE"
start=$(date +%s)
docker build -t "$IMAGE" --build-arg BASE="$BASE" "$ROOT" >/var/tmp/replica-docker-build.log 2>&1 \
    || { tail -30 /var/tmp/replica-docker-build.log; fail "docker build failed: see /var/tmp/replica-docker-build.log"; }
say "built in $(($(date +%s) - start)) s: $(docker image inspect -f '{{.Size}}' "$IMAGE" | numfmt --to=iec)"

# 6. the default command is the demo; a short run of it trains and reports a validation loss
cmd=$(docker image inspect -f '{{json .Config.Cmd}}' "$IMAGE")
[ "$cmd" = '["python","examples/gpt/train.py"]' ] || fail "the image's default command is $cmd, not the demo"
out=$(docker run --rm "$IMAGE" python examples/gpt/train.py --steps 20 --log-every 10 --max-bytes 200000 \
      --sample-tokens 20 2>&1) || { echo "$out"; fail "the demo failed"; }
echo "$out" | grep -E "trained|val loss" || true
echo "$out" | grep -q "trained 20 steps" && echo "$out" | grep -q "val loss" || fail "the demo did not train"

# 7. torchrun inside the container: 2 processes, gloo, the CIFAR-10 trainer on synthetic data
out=$(docker run --rm "$IMAGE" torchrun --nproc-per-node 2 examples/cifar10/train.py --synthetic \
      --synthetic-size 256 --epochs 1 --batch-size 32 --num-stages 2 2>&1) || { echo "$out"; fail "torchrun failed"; }
echo "$out" | grep -E "stages ×|test accuracy" || true
echo "$out" | grep -q "test accuracy" || fail "the 2-process torchrun job did not finish"
echo "$out" | grep -q "2 stages × 1 replica" || fail "the torchrun job did not run a 2-stage pipeline on 2 ranks"

# 8. the hyper-parameter search (the hpo extra) inside it: 2 trials side by side, each planned, then trained
out=$(docker run --rm "$IMAGE" python examples/cifar10/hpo.py --trials 2 --train-size 64 --epochs 1 \
      --report /tmp/hpo.html 2>&1) || { echo "$out"; fail "the hpo example failed"; }
echo "$out" | tail -3
echo "$out" | grep -q "trial 1:" || fail "the hpo example did not run its trials"

if [ -z "${KEEP_IMAGE:-}" ]; then
    docker image rm "$IMAGE" >/dev/null && docker image prune -f >/dev/null
fi
say "OK: the image builds, its demo trains, torchrun runs 2 processes in it, the hpo example searches"
