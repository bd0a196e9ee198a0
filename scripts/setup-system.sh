#!/usr/bin/env bash
# Installs the Debian packages Ferry uses, when they are missing and we are root with apt-get.
#   --runtime   only what `ferry serve` uses (bubblewrap, the replica sandbox; e2fsprogs and acl, volumes;
#               xfsprogs and btrfs-progs, volumes in directories with XFS project quotas or btrfs qgroups;
#               iproute2 and nftables, the sandboxes' own networks; slirp4netns, their egress when Ferry
#               is not root; umoci, which turns an image build step's changes into a layer, rootless); run
#               by `npm install`
#   Also, as root: records the sandboxes' uid range in /etc/subuid and /etc/subgid (ferry-sandbox).
#   (default)   also what the tests use (Chromium for the dashboard's browser tests; for the image tests,
#               Debian's docker-registry served on loopback, skopeo to push to it, apache2-utils' htpasswd
#               for its password file, busybox-static for the base images they make, dpkg-dev's
#               dpkg-scanpackages for the apt repository the apt test serves; glusterfs-server and
#               glusterfs-client for the GlusterFS volume the shared-volumes test serves and mounts on
#               loopback; python3-pip and python3-venv for the Python client's offline build); run by .ci/run
# Safe to run again; does nothing when everything is there. Never fails the caller: Ferry still runs
# without these (`ferry doctor` says what is missing), and tests that need one say so.
set -uo pipefail

# Sandboxes of a Ferry that runs as root take host uids of their own (src/sandbox/identity.ts). The range
# is recorded as the subordinate ids of `ferry-sandbox`, so tools that hand out such ranges see it taken.
SANDBOX_UIDS="${FERRY_SANDBOX_UIDS:-1879048192:65536}"
if [ "$(id -u)" = 0 ]; then
  for file in /etc/subuid /etc/subgid; do
    if ! grep -qs '^ferry-sandbox:' "$file"; then
      echo "ferry-sandbox:${SANDBOX_UIDS}" >>"$file" && echo "system: sandbox ids ferry-sandbox:${SANDBOX_UIDS} added to $file"
    fi
  done
fi

need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
has() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }
has ip || need+=(iproute2)
has nft || need+=(nftables)
has slirp4netns || need+=(slirp4netns)
# Volumes (src/volumes/images.ts): ext4 images (e2fsprogs), their default ACL (acl), flock and mount (util-linux).
has mkfs.ext4 || need+=(e2fsprogs)
has setfacl || need+=(acl)
has flock || need+=(util-linux)
# Volumes in directories with the filesystem's own quota (FERRY_VOLUMES_BACKEND=quota-dir, src/volumes/quotas.ts):
# xfs_quota sets XFS project quotas (xfsprogs); btrfs makes subvolumes and limits their qgroups (btrfs-progs).
has xfs_quota || need+=(xfsprogs)
has btrfs || need+=(btrfs-progs)
has umoci || need+=(umoci)
if [ "${1:-}" != "--runtime" ]; then
  [ -x /usr/bin/chromium ] || need+=(chromium)
  has skopeo || need+=(skopeo)
  has docker-registry || need+=(docker-registry)
  has htpasswd || need+=(apache2-utils)
  dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' || need+=(busybox-static)
  has dpkg-scanpackages || need+=(dpkg-dev)
  # A GlusterFS volume served and mounted on this machine, for volumes shared by several machines
  # (test/volumes-gluster.test.ts): glusterd and the gluster CLI, and the FUSE client.
  has glusterd || need+=(glusterfs-server)
  has mount.glusterfs || need+=(glusterfs-client)
  # The Python client's test builds its wheel with pip, offline, and installs it into a fresh venv.
  /usr/bin/python3 -c 'import pip' 2>/dev/null || need+=(python3-pip)
  /usr/bin/python3 -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
fi
if [ ${#need[@]} -eq 0 ]; then
  echo "system packages: all present"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "system packages missing: ${need[*]}. Install them (Debian/Ubuntu: sudo apt-get install -y ${need[*]}); see \`npx ferry doctor\`." >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
echo "system packages: installing ${need[*]}"
if ! apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${need[@]}" >/dev/null 2>&1; then
  apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null 2>&1 || true
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${need[@]}" >/dev/null 2>&1 || echo "could not install ${need[*]}; see \`npx ferry doctor\`" >&2
fi
exit 0
