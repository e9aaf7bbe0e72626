#!/usr/bin/env bash
# Builds the project's images from its Dockerfile with buildah (no Docker daemon), once per source
# hash, and keeps each as a docker-archive under ~/.cache/rlhf-operator/images/ for a node to load.
#
#   bash scripts/images.sh                          # operator and trainer-cpu (what the real node runs)
#   bash scripts/images.sh operator trainer         # any targets of the Dockerfile
#
# Prints one line per target on stdout: "<target> <image reference> <archive>".
#
# The base: $RLHF_BASE_IMAGE when set; else docker.io/library/python:3.11-slim when buildah has it
# locally; else a Debian bookworm base with python3 made here by mmdebstrap from Debian's packages
# (no container registry needed). pip's cache ($PIP_CACHE_DIR or ~/.cache/pip) is mounted into the
# build, so wheels the host already downloaded are not fetched again.
#
# Pins: each target installs the exact versions of constraints/<target>.txt when that file exists
# (operator.txt, trainer-cpu.txt, trainer-gpu.txt for `trainer`; `name==version` per line), so two
# builds of one commit get the same packages; the files are part of the source hash.
#
# The `trainer` (GPU) target is a CPU build of CUDA wheels: ~10 GB of downloads, never part of the
# cold test path (scripts/test.sh); scripts/check_gpu_image.sh checks its archive without a GPU.
#
# Environment: RLHF_CACHE_DIR (default ~/.cache/rlhf-operator), RLHF_BASE_IMAGE, RLHF_DEBIAN_MIRROR
# (default http://deb.debian.org/debian), RLHF_IMAGES_KEEP (archives kept per target, default 1: a trainer archive is 6-7 GB).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "==> [images] $*" >&2; }
die() { echo "error: [images] $*" >&2; exit 1; }
# Say where the script stopped (set -e would otherwise end it without a word).
trap 'die "stopped at line $LINENO: $BASH_COMMAND"' ERR

TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(operator trainer-cpu)
valid=$(sed -n 's/^FROM .* AS \([a-z-]*\)$/\1/p' Dockerfile | tr '\n' ' ')
for t in "${TARGETS[@]}"; do
  case " $valid " in *" $t "*) ;; *) die "unknown target '$t'; the Dockerfile's targets are: $valid" ;; esac
done
command -v buildah >/dev/null || die "buildah is not installed (Debian: apt-get install buildah)"

CACHE="${RLHF_CACHE_DIR:-$HOME/.cache/rlhf-operator}"
OUT="$CACHE/images"
PIP_CACHE="${PIP_CACHE_DIR:-$HOME/.cache/pip}"
KEEP="${RLHF_IMAGES_KEEP:-1}"
mkdir -p "$OUT" "$PIP_CACHE"
exec 9>"$OUT/.lock"
flock 9  # one build at a time per cache

# ---- the base ---------------------------------------------------------------------------------
DEBIAN_SUITE=bookworm
DEBIAN_BASE="localhost/rlhf-operator/debian-python:$DEBIAN_SUITE-1"
base="${RLHF_BASE_IMAGE:-}"
if [ -z "$base" ]; then
  if buildah inspect --type image docker.io/library/python:3.11-slim >/dev/null 2>&1; then
    base=docker.io/library/python:3.11-slim
  else
    base=$DEBIAN_BASE
    if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
      command -v mmdebstrap >/dev/null || die "no base image and no mmdebstrap to make one (apt-get install mmdebstrap, or set RLHF_BASE_IMAGE)"
      log "making the base $base from Debian's packages (mmdebstrap, about a minute)"
      tmp=$(mktemp -d)
      trap 'rm -rf "$tmp"' EXIT
      mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
        "$DEBIAN_SUITE" "$tmp/rootfs.tar" "${RLHF_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >&2 \
        || die "mmdebstrap failed"
      ctr=$(buildah from scratch)
      buildah add --quiet "$ctr" "$tmp/rootfs.tar" / >/dev/null
      buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --cmd /usr/bin/python3 "$ctr"
      buildah commit --quiet --rm "$ctr" "$base" >/dev/null
      rm -rf "$tmp"; trap - EXIT
    fi
  fi
fi
log "base image: $base"

# ---- the source hash --------------------------------------------------------------------------
# What the Dockerfile copies (tracked and untracked-but-not-ignored files), plus the base.
hash=$( {
  echo "$base"
  git ls-files -co --exclude-standard -- Dockerfile .dockerignore pyproject.toml README.md \
    scripts/image_requirements.py constraints api operator trainer | LC_ALL=C sort | while read -r f; do
      [ -f "$f" ] && printf '%s %s\n' "$f" "$(sha256sum <"$f" | cut -c1-64)"
    done
} | sha256sum | cut -c1-12)

# The host's trust store and pip configuration, during RUN steps only (not in the image): where
# the network to PyPI passes a TLS-inspecting proxy, its CA is in the host's bundle.
host_trust=()
for f in /etc/ssl/certs/ca-certificates.crt /etc/pip.conf; do
  [ -f "$f" ] && host_trust+=(--volume "$f:$f:ro")
done

# The pin file of a target (the Dockerfile applies it when present).
pins() { case "$1" in trainer) echo constraints/trainer-gpu.txt ;; *) echo "constraints/$1.txt" ;; esac; }
[ -d constraints ] || die "no constraints/ directory (the Dockerfile copies it; it may hold only .gitkeep)"

for target in "${TARGETS[@]}"; do
  ref="localhost/rlhf-operator/$target:$hash"
  if [ -f "$(pins "$target")" ]; then
    log "$target: pinned by $(pins "$target") ($(grep -c '==' "$(pins "$target")") pins)"
  else
    log "$target: no $(pins "$target"): versions are not pinned (pip resolves the newest)"
  fi
  archive="$OUT/$target-$hash.tar"
  if [ -s "$archive" ]; then
    log "$target: cached ($archive)"
  else
    # Disk first: a trainer archive is 6-7 GB and its build needs ~25 GB more. Older archives
    # beyond the $KEEP - 1 newest go now, and so does what an interrupted build left behind.
    { ls -1t "$OUT/$target-"*.tar 2>/dev/null || true; } | tail -n +"$KEEP" | xargs -r rm -f
    buildah rm --all >/dev/null 2>&1 || true
    log "$target: building $ref"
    t0=$(date +%s)
    buildah build --quiet --layers --pull=never --network=host --target "$target" \
      --build-arg "BASE_IMAGE=$base" --build-arg PIP_CACHE_DIR=/pip-cache \
      --volume "$PIP_CACHE:/pip-cache:rw" "${host_trust[@]}" -t "$ref" . >&2 \
      || { buildah rm --all >/dev/null 2>&1; die "buildah build --target $target failed ($(df -h "$OUT" | awk 'NR==2 {print $4}') free on the disk)"; }
    t1=$(date +%s)
    rm -f "$archive.part"
    buildah push --quiet "$ref" "docker-archive:$archive.part:$ref" >&2 || die "buildah push $ref failed"
    mv "$archive.part" "$archive"
    log "$target: built in $(( t1 - t0 )) s, archived in $(( $(date +%s) - t1 )) s ($(du -h "$archive" | cut -f1))"
    # Keep the newest $KEEP archives of this target; buildah keeps only this version's image (its
    # layers stay the cache of the next build) and drops what no image uses any more.
    { ls -1t "$OUT/$target-"*.tar 2>/dev/null || true; } | tail -n +$((KEEP + 1)) | xargs -r rm -f
    buildah images --format '{{.Name}}:{{.Tag}}' 2>/dev/null | grep "^localhost/rlhf-operator/$target:" \
      | grep -v ":$hash\$" | xargs -r buildah rmi >/dev/null 2>&1 || true
    buildah rmi --prune >/dev/null 2>&1 || true
  fi
  echo "$target $ref $archive"
done
