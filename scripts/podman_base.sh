#!/usr/bin/env bash
# Prepares this machine to build and run the project's image with Podman when no Docker engine
# and no container registry can be reached (tests/slow/test_container_image.py): installs Debian's
# podman, buildah, runc and debootstrap if they are missing, and makes a Debian base image from a
# debootstrapped root, the local stand-in for debian:bookworm-slim. The image is built once and
# reused while `podman image exists` finds it; prints its name on the last line.
#
#   sudo bash scripts/podman_base.sh [NAME]        # NAME: localhost/torchrec-dlrm-base:bookworm
#   MIRROR=http://deb.debian.org/debian SUITE=bookworm bash scripts/podman_base.sh
#
# The suite fixes the image's python3 (bookworm: 3.11); the mirror must be reachable from here
# and, by the same address, from inside `podman build` (its apt-get runs against it).
set -euo pipefail

NAME=${1:-localhost/torchrec-dlrm-base:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SUITE=${SUITE:-bookworm}
# Every download is bounded: a stalled mirror fails the step instead of hanging it.
APT_TIMEOUT=${APT_TIMEOUT:-900}

log() { echo "podman_base.sh: $*" >&2; }

need_root() {
  if [ "$(id -u)" != 0 ]; then
    log "needs root (apt-get, debootstrap, rootful podman): run it with sudo"
    exit 1
  fi
}

install_tools() {
  local missing=()
  for tool in podman:podman buildah:buildah runc:runc debootstrap:debootstrap; do
    command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
  done
  [ ${#missing[@]} = 0 ] && return
  need_root
  log "installing ${missing[*]}"
  timeout "$APT_TIMEOUT" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive timeout "$APT_TIMEOUT" \
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The apt sources of the official debian image: without the updates and security suites the
# build would install the point release's python3 and CA certificates.
write_sources() {
  local root=$1
  rm -f "$root/etc/apt/sources.list"
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${MIRROR%/debian}/debian-security
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
}

make_base() {
  need_root
  local root
  root=$(mktemp -d /var/tmp/podman-base.XXXXXX)
  # shellcheck disable=SC2064  # expand now: the trap must remove this root, not a later one
  trap "rm -rf '$root'" EXIT
  log "debootstrap --variant=minbase $SUITE from $MIRROR (a few minutes)"
  timeout "$APT_TIMEOUT" debootstrap --variant=minbase "$SUITE" "$root" "$MIRROR" >/dev/null
  write_sources "$root"
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/log/*.log "$root"/var/cache/debconf/*-old
  # An imported image has no configuration: give it the official image's PATH and CMD (the
  # Dockerfile's `ENV PATH=/opt/venv/bin:$PATH` extends this PATH).
  tar -C "$root" -c . | podman import --quiet \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' - "$NAME" >/dev/null
  rm -rf "$root"
  trap - EXIT
}

install_tools
# One preparer at a time: a second test run waits for the first's import (bounded) and reuses it.
exec 9>/var/tmp/podman_base.lock
flock -w "$APT_TIMEOUT" 9 || { log "another podman_base.sh has held /var/tmp/podman_base.lock for ${APT_TIMEOUT}s"; exit 1; }
if podman image exists "$NAME"; then
  log "$NAME is there already (podman rmi $NAME to rebuild it)"
else
  make_base
  log "made $NAME"
fi
echo "$NAME"
