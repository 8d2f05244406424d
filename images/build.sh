#!/usr/bin/env bash
# images/build.sh [--check] [--force]
#
# Builds every guest artifact hearth boots, from Debian packages, into ${HEARTH_IMAGES:-/var/lib/hearth/images}:
#
#   vmlinux                 the guests' kernel (ELF, PVH), for Firecracker and QEMU: built by images/microvm-kernel.sh
#                           from the sources of Debian's linux-image-cloud-amd64 (bookworm, 6.1) with Debian's
#                           config trimmed for microVMs; HEARTH_GUEST_KERNEL=debian takes Debian's own kernel
#                           (extracted by images/extract-vmlinux.sh) instead
#   vmlinuz                 the same kernel as a bzImage
#   initramfs.cpio.gz       base archive (busybox, modules, /init) + a second archive holding only /hearth-agent
#   rootfs/minimal.ext4     busybox-static root filesystem (tests)
#   rootfs/debian.ext4      mmdebstrap minbase of trixie with python3, bash, coreutils, ca-certificates, procps
#   rootfs/base.ext4        the default template: trixie with Python 3, Node.js, Bun, Go, Rust (cargo), git,
#                           curl, build tools, and the Pi coding agent (npm, installed by the host's npm)
#   manifest.json           every artifact with its size and sha256, and the kernel release
#
# With --kvm-host, also the KVM test host's root filesystem (crates/hearth-testkit/src/kvm_host/):
#
#   kvm-host/rootfs.ext4    bookworm minbase with QEMU 10 (bookworm-backports), nftables, iproute2, kmod, CA certificates and the
#                           modules of Debian's kernel (kvm, kvm-amd, tun, nftables...): booted under QEMU TCG with
#                           the two files below, it is a machine with a working /dev/kvm (nested SVM) where tests
#                           run hearthd, Firecracker and QEMU+KVM on the guest images above. Versioned like the
#                           root filesystems (kvm-host/versions/rootfs-<key>.ext4); a running test host keeps its own.
#   kvm-host/vmlinux        Debian's kernel (ELF), whatever the guests boot
#   kvm-host/initramfs.cpio.gz  the initramfs above made for Debian's kernel (its virtio modules)
#
# Caching: each artifact has a recipe key (sha256 of the shell functions that build it, the versions of the
# packages it comes from, and the keys of its inputs) stored under .stamps/. An artifact is rebuilt only when its
# key changes or the file is missing. Rebuilding the agent rebuilds only the small agent archive.
#
# Root filesystems are written to rootfs/versions/<name>-<key>.ext4 and rootfs/<name>.ext4 is a symlink to the
# current one: QEMU disks are qcow2 overlays whose backing file must never change under them, so a rebuilt
# template gets a new file and overlays made from the old one keep working. Old versions are kept; delete them
# when no sandbox uses them.
#
# --check     exit 0 iff every artifact is built and current (builds nothing; used by `hearth doctor` and CI)
# --force     rebuild everything
# --kvm-host  also build (or, with --check, check) the KVM test host's root filesystem, kernel and initramfs
#
# Environment:
#   HEARTH_IMAGES     output directory (default /var/lib/hearth/images)
#   HEARTH_KERNEL_SERIES  the guest kernel's series (default 6.1; 6.12 is bookworm-backports')
#   HEARTH_GUEST_KERNEL   microvm (default): the guests' kernel is built from Debian's sources of that series
#                     for microVMs (images/microvm-kernel.sh; a 10-minute compile on 2 cores, once: cached);
#                     debian: Debian's packaged kernel as it is (no build; boots slower and holds more memory,
#                     docs/benchmarks.md "A kernel built for microVMs")
#   HEARTH_AGENT_BIN  use this static agent binary instead of asking images/build-agent.sh
#   HEARTH_MIRROR     Debian mirror for the root filesystems (default: the one the host's apt sources name, see
#                     scripts/debian-mirror.sh)
#
# Needs (scripts/install-deps.sh): apt-get, dpkg-deb, kmod (depmod, modprobe), busybox-static, cpio, gzip,
# e2fsprogs (mkfs.ext4 -d), mmdebstrap, sha256sum. Runs as root (device nodes, mmdebstrap, file ownership).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${HEARTH_IMAGES:-/var/lib/hearth/images}
STAMPS=$OUT/.stamps
WORK=$OUT/.build
# shellcheck source=../scripts/debian-mirror.sh
. "$HERE/../scripts/debian-mirror.sh"
MIRROR=$(debian_mirror) || exit 1

# Kernel modules the guest needs, in load order (dependencies are added automatically, built-ins skipped).
# nfsv3 (with sunrpc, lockd, grace, netfs, fscache, nfs, nfs_acl) is the client of bucket mounts
# (docs/storage.md): the agent mounts the host's export with mount(2), no userspace helper.
GUEST_MODULES="virtio_ring virtio virtio_mmio virtio_blk virtio_console failover net_failover virtio_net \
vsock vmw_vsock_virtio_transport_common vmw_vsock_virtio_transport virtio-rng virtio_balloon overlay nfsv3"
# Debian's cloud kernel series the guests boot (linux-image-cloud-amd64: 6.1 from bookworm, 6.12 from
# bookworm-backports).
KERNEL_SERIES=${HEARTH_KERNEL_SERIES:-6.1}
# The guests' kernel: `microvm` (built from the sources of the package above's version by
# images/microvm-kernel.sh: Debian's config with the guest's modules built in and the rest trimmed) or `debian`
# (the package itself).
GUEST_KERNEL=${HEARTH_GUEST_KERNEL:-microvm}
DEBIAN_SUITE=trixie
DEBIAN_PACKAGES="python3,bash,coreutils,ca-certificates,procps"
DEBIAN_SIZE=2G
BASE_PACKAGES="python3,python3-pip,python3-venv,nodejs,npm,golang-go,rustc,cargo,git,curl,ca-certificates,\
build-essential,pkg-config,bash,coreutils,procps,less,xz-utils,unzip,zip,iproute2,openssh-client,jq"
BASE_NPM="bun@1.4.5 @mariozechner/pi-coding-agent@0.73.1"
BASE_SIZE=8G
MINIMAL_SIZE=256M
# The KVM test host: QEMU 10 and qemu-img from backports (the QEMU driver needs them; apt takes only the named
# packages from backports, so QEMU's own versioned dependencies are named too), what hearthd and its tests call
# (nft, ip, modprobe, mount, ps, GNU cp), nothing else.
KVMHOST_SUITE=bookworm
KVMHOST_PACKAGES="qemu-system-x86/bookworm-backports,qemu-system-common/bookworm-backports,\
qemu-system-data/bookworm-backports,seabios/bookworm-backports,qemu-utils/bookworm-backports,\
nftables,iproute2,kmod,procps,util-linux,mount,coreutils,e2fsprogs,ca-certificates"
KVMHOST_SIZE=3G

MODE=build
FORCE=0
KVM_HOST=0
for arg in "$@"; do
    case "$arg" in
    --check) MODE=check ;;
    --force) FORCE=1 ;;
    --kvm-host) KVM_HOST=1 ;;
    -h | --help)
        sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
        exit 0
        ;;
    *)
        echo "build.sh: unknown argument $arg (try --help)" >&2
        exit 2
        ;;
    esac
done

log() { printf 'images: %s\n' "$*" >&2; }
die() {
    printf 'images: error: %s\n' "$*" >&2
    exit 1
}

sha() { sha256sum | cut -c1-64; }
file_sha() { sha256sum "$1" | cut -c1-64; }
pkg_version() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || echo missing; }

stamp_get() { cat "$STAMPS/$1.key" 2>/dev/null || true; }
stamp_set() { printf '%s\n' "$2" >"$STAMPS/$1.key"; }

# --- kernel -------------------------------------------------------------------------------------------------

# Prints "<package> <version>" of the concrete linux-image package of series $KERNEL_SERIES that
# linux-image-cloud-amd64 depends on (the newest version of that series any apt source has).
resolve_kernel_package() {
    local meta=linux-image-cloud-amd64 ver dep series=${KERNEL_SERIES//./\\.}
    ver=$(apt-cache madison "$meta" | awk '{print $3}' | grep "^$series\\." | sort -V | tail -1)
    [ -n "$ver" ] || die "no $KERNEL_SERIES version of $meta in the apt lists (run scripts/install-deps.sh)"
    dep=$(apt-cache show "$meta=$ver" | awk -F': ' '/^Depends:/ {print $2; exit}' | tr ',' '\n' |
        grep -o 'linux-image-[^ ]*' | head -1)
    [ -n "$dep" ] || die "cannot find the linux-image package that $meta $ver depends on"
    printf '%s %s\n' "$dep" "$ver"
}

# Downloads the .deb of package $2 version $3 into a new scratch directory "$WORK/$1.XXXXXX" (readable by apt's
# sandbox user) and prints the directory.
apt_download() {
    local what=$1 pkg=$2 ver=$3 tmp
    tmp=$(mktemp -d "$WORK/$what.XXXXXX")
    chmod 0755 "$tmp"
    if id _apt >/dev/null 2>&1; then chown _apt "$tmp"; fi
    (cd "$tmp" && apt-get download -q=2 "$pkg=$ver" >&2)
    printf '%s\n' "$tmp"
}

# Downloads and unpacks the kernel package: $WORK/kernel/{vmlinuz,config,release,lib/modules/<release>}.
build_kernel() {
    local pkg=$1 ver=$2 tmp rel
    log "kernel: downloading $pkg ($ver)"
    tmp=$(apt_download kernel-dl "$pkg" "$ver")
    dpkg-deb -x "$tmp"/"$pkg"_*.deb "$tmp/root"
    rel=$(basename "$(ls -d "$tmp"/root/lib/modules/*/ | head -1)")
    [ -f "$tmp/root/boot/vmlinuz-$rel" ] || die "kernel: no /boot/vmlinuz-$rel in $pkg"
    rm -rf "$WORK/kernel"
    mkdir -p "$WORK/kernel/lib/modules"
    mv "$tmp/root/boot/vmlinuz-$rel" "$WORK/kernel/vmlinuz"
    mv "$tmp/root/boot/config-$rel" "$WORK/kernel/config"
    mv "$tmp/root/lib/modules/$rel" "$WORK/kernel/lib/modules/"
    depmod -b "$WORK/kernel" "$rel"
    printf '%s\n' "$rel" >"$WORK/kernel/release"
    rm -rf "$tmp"
    log "kernel: $rel"
}

# Builds the microVM kernel from the sources of Debian's kernel version $1 (linux-source-<series>) with
# Debian's config ($WORK/kernel/config) into $WORK/microvm/{vmlinuz,vmlinux,config,release,lib/modules/<release>}.
build_microvm_kernel() {
    local ver=$1 pkg="linux-source-$KERNEL_SERIES" tmp
    log "microvm kernel: downloading $pkg ($ver)"
    tmp=$(apt_download microvm "$pkg" "$ver")
    dpkg-deb --fsys-tarfile "$tmp/$pkg"_*.deb | tar -xO "./usr/src/$pkg.tar.xz" | tar -xJ -C "$tmp"
    rm -f "$tmp/$pkg"_*.deb
    log "microvm kernel: building (images/microvm-kernel.sh); this takes a while"
    bash "$HERE/microvm-kernel.sh" "$tmp/$pkg" "$WORK/kernel/config" "$tmp/out" >&2
    rm -rf "$WORK/microvm"
    mv "$tmp/out" "$WORK/microvm"
    rm -rf "$tmp"
    log "microvm kernel: $(cat "$WORK/microvm/release")"
}

# Installs the guest kernel of $1 ($WORK/kernel or $WORK/microvm) as $OUT/vmlinuz.
install_guest_kernel() {
    install -m 0644 "$1/vmlinuz" "$OUT/vmlinuz.tmp"
    mv -f "$OUT/vmlinuz.tmp" "$OUT/vmlinuz"
}

# build_vmlinux KDIR DEST: the ELF kernel of KDIR for Firecracker (and QEMU's PVH boot), built or extracted
# from its bzImage.
build_vmlinux() {
    local kdir=$1 dest=$2
    mkdir -p "$(dirname "$dest")"
    if [ -f "$kdir/vmlinux" ]; then
        install -m 0644 "$kdir/vmlinux" "$dest.tmp"
    else
        log "vmlinux: extracting the ELF kernel of $(cat "$kdir/release")"
        sh "$HERE/extract-vmlinux.sh" "$kdir/vmlinuz" "$dest.tmp" >&2
    fi
    mv -f "$dest.tmp" "$dest"
}

# --- initramfs ----------------------------------------------------------------------------------------------

# The guest's /init (busybox sh). Printed to stdout so that its text is part of the base archive's key.
init_script() {
    cat <<'INIT'
#!/bin/sh
# hearth initramfs: load the virtio modules, mount the sandbox disk, hand over to the agent as PID 1.
# Any failure prints a reason on the console and powers the VM off, so the host sees the VMM exit.
export PATH=/bin
say() { echo "hearth-init: $*"; }
fail() {
    echo "hearth-init: FATAL: $*"
    echo "hearth-init: powering off"
    sync
    poweroff -f
    sleep 2
    reboot -f
}
mount -t proc -o nosuid,nodev,noexec proc /proc || fail "cannot mount /proc"
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys || fail "cannot mount /sys"
mount -t devtmpfs -o nosuid devtmpfs /dev || fail "cannot mount /dev"
say "started ($(uname -r))"

while read -r mod; do
    insmod "/lib/modules/$mod" || fail "cannot load module $mod"
done </etc/hearth-modules

root=/dev/vda
for arg in $(cat /proc/cmdline); do
    case "$arg" in hearth.root=/dev/*) root=${arg#hearth.root=} ;; esac
done
i=0
while [ ! -b "$root" ]; do
    i=$((i + 1))
    [ "$i" -le 400 ] || fail "root disk $root did not appear within 20 s"
    usleep 50000
done

mkdir -p /newroot
mount -t ext4 -o rw,noatime "$root" /newroot || fail "cannot mount $root (ext4) on /newroot"
[ -d /newroot/run ] || mkdir /newroot/run || fail "no /run on the root disk"
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /newroot/run || fail "cannot mount tmpfs on /newroot/run"
[ -f /hearth-agent ] || fail "the initramfs has no /hearth-agent"
cp /hearth-agent /newroot/run/hearth-agent && chmod 0755 /newroot/run/hearth-agent ||
    fail "cannot copy the agent to /newroot/run"

# The agent mounts /proc, /sys and /dev itself.
umount /dev 2>/dev/null || umount -l /dev
umount /sys 2>/dev/null || umount -l /sys
umount /proc 2>/dev/null || umount -l /proc
say "starting the agent"
exec switch_root /newroot /run/hearth-agent
INIT
}

# module_files KDIR: prints the module files of kernel KDIR for GUEST_MODULES in load order, deduplicated
# (none for a kernel that has them built in).
module_files() {
    local kdir=$1 rel m line
    rel=$(cat "$kdir/release")
    for m in $GUEST_MODULES; do
        modprobe -d "$kdir" -S "$rel" --show-depends "$m" || die "module $m: not in kernel $rel"
    done | while read -r line; do
        case "$line" in
        insmod\ *) line=${line#insmod } && echo "${line%% *}" ;;
        builtin\ *) ;;
        *) die "unexpected modprobe output: $line" ;;
        esac
    done | awk '!seen[$0]++'
}

# build_base_initramfs KDIR DEST: the base archive for kernel KDIR: busybox with its applets, the kernel's
# modules (decompressed, flat in /lib/modules), /init, /dev/console.
build_base_initramfs() {
    local kdir=$1 dest=$2 stage f name mods
    mods=$(module_files "$kdir")
    stage=$(mktemp -d "$WORK/base.XXXXXX")
    mkdir -p "$stage"/{bin,dev,proc,sys,newroot,etc,lib/modules}
    cp /bin/busybox "$stage/bin/busybox"
    for f in $(busybox --list); do
        [ "$f" = busybox ] || ln -s busybox "$stage/bin/$f"
    done
    mknod -m 0600 "$stage/dev/console" c 5 1
    mknod -m 0666 "$stage/dev/null" c 1 3
    : >"$stage/etc/hearth-modules"
    for f in $mods; do
        name=$(basename "$f")
        case "$name" in
        *.ko) cp "$f" "$stage/lib/modules/$name" ;;
        *.ko.xz) name=${name%.xz} && xz -dc "$f" >"$stage/lib/modules/$name" ;;
        *.ko.zst) name=${name%.zst} && zstd -qdc "$f" >"$stage/lib/modules/$name" ;;
        *.ko.gz) name=${name%.gz} && gzip -dc "$f" >"$stage/lib/modules/$name" ;;
        *) die "unknown module format: $f" ;;
        esac
        echo "$name" >>"$stage/etc/hearth-modules"
    done
    init_script >"$stage/init"
    chmod 0755 "$stage/init"
    log "initramfs: base archive with modules: $(tr '\n' ' ' <"$stage/etc/hearth-modules")"
    (cd "$stage" && find . -mindepth 1 | LC_ALL=C sort |
        cpio -o -H newc -R 0:0 --reproducible --quiet) | gzip -9n >"$dest.tmp"
    mv -f "$dest.tmp" "$dest"
    rm -rf "$stage"
}

# Prints the path of the static agent binary.
agent_binary() {
    if [ -n "${HEARTH_AGENT_BIN:-}" ]; then
        printf '%s\n' "$HEARTH_AGENT_BIN"
    elif [ -x "$HERE/build-agent.sh" ] || [ -f "$HERE/build-agent.sh" ]; then
        bash "$HERE/build-agent.sh" | tail -1
    else
        die "images/build-agent.sh is not there yet and HEARTH_AGENT_BIN is not set: cannot build the agent archive"
    fi
}

build_agent_initramfs() {
    local bin=$1 stage
    stage=$(mktemp -d "$WORK/agent.XXXXXX")
    install -m 0755 "$bin" "$stage/hearth-agent"
    (cd "$stage" && echo hearth-agent | cpio -o -H newc -R 0:0 --reproducible --quiet) | gzip -9n >"$WORK/agent.cpio.gz"
    rm -rf "$stage"
}

# assemble_initramfs BASE DEST: the base archive BASE, then the agent's.
assemble_initramfs() {
    local base=$1 dest=$2
    mkdir -p "$(dirname "$dest")"
    cat "$base" "$WORK/agent.cpio.gz" >"$dest.tmp"
    # Zero padding to a whole number of pages (the kernel skips zeros between archives). QEMU's microvm puts
    # the initrd at the very top of RAM, page-aligned at its start, and SeaBIOS keeps the ACPI tables (whose
    # DSDT lists the virtio-mmio devices) in the last bytes of RAM: an initrd whose size leaves less than the
    # tables' size free in its last page overwrites them, and the guest hangs after "ACPI: Core revision" or
    # boots without its devices (measured: the same kernel and devices boot or hang by the initramfs size
    # alone). A whole-page initrd ends one page below the top and leaves that page to the tables.
    truncate -s %4096 "$dest.tmp"
    mv -f "$dest.tmp" "$dest"
}

# --- root filesystems ---------------------------------------------------------------------------------------

# Directories and files every hearth root filesystem has.
rootfs_common() {
    local dir=$1
    mkdir -p "$dir"/{run,tmp,root,proc,sys,dev,etc}
    chmod 1777 "$dir/tmp"
    chmod 0700 "$dir/root"
    printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' >"$dir/etc/hosts"
    # Each sandbox gets its own identity at boot; the template carries none.
    : >"$dir/etc/machine-id"
}

# Turns a directory into a sparse ext4 image of the given virtual size at $OUT/rootfs/versions/<name>-<key>.ext4
# and points rootfs/<name>.ext4 at it.
make_ext4() {
    local name=$1 dir=$2 size=$3 key=$4 file
    mkdir -p "$OUT/rootfs/versions"
    file="$OUT/rootfs/versions/$name-${key:0:12}.ext4"
    rm -f "$file.tmp"
    truncate -s "$size" "$file.tmp"
    mkfs.ext4 -q -F -L "hearth-$name" -E root_owner=0:0 -d "$dir" "$file.tmp" >&2
    chmod 0444 "$file.tmp"
    mv -f "$file.tmp" "$file"
    ln -sfn "versions/$(basename "$file")" "$OUT/rootfs/$name.ext4.tmp"
    mv -fT "$OUT/rootfs/$name.ext4.tmp" "$OUT/rootfs/$name.ext4"
    local old
    old=$(find "$OUT/rootfs/versions" -maxdepth 1 -name "$name-*.ext4" ! -name "$(basename "$file")" -printf '%f ')
    if [ -n "$old" ]; then
        log "rootfs $name: older versions kept for the sandboxes whose disks they back: $old(delete when unused)"
    fi
}

build_rootfs_minimal() {
    local key=$1 dir f
    dir=$(mktemp -d "$WORK/minimal.XXXXXX")
    mkdir -p "$dir"/{bin,sbin,usr/bin,usr/sbin}
    cp /bin/busybox "$dir/bin/busybox"
    for f in $(busybox --list-full); do
        [ -e "$dir/$f" ] || ln -s /bin/busybox "$dir/$f"
    done
    rootfs_common "$dir"
    printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$dir/etc/passwd"
    printf 'root:x:0:\nnogroup:x:65534:\n' >"$dir/etc/group"
    make_ext4 minimal "$dir" "$MINIMAL_SIZE" "$key"
    rm -rf "$dir"
}

build_rootfs_debian() {
    local key=$1 dir
    dir=$(mktemp -d "$WORK/debian.XXXXXX")
    log "rootfs debian: mmdebstrap $DEBIAN_SUITE (minbase + $DEBIAN_PACKAGES); this takes a few minutes"
    mmdebstrap --quiet --mode=root --variant=minbase --include="$DEBIAN_PACKAGES" \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --customize-hook='chroot "$1" dpkg-query -W -f="\${Package} \${Version}\n" > "$1/etc/hearth-packages"' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/log/*.log' \
        "$DEBIAN_SUITE" "$dir" "$MIRROR" >&2
    rootfs_common "$dir"
    echo hearth >"$dir/etc/hostname"
    make_ext4 debian "$dir" "$DEBIAN_SIZE" "$key"
    rm -rf "$dir"
}

# The default template. npm packages are installed by the host's npm into the image's /usr/local (the host's
# npm configuration and CA bundle reach the registry; the image's node runs them).
build_rootfs_base() {
    local key=$1 dir
    dir=$(mktemp -d "$WORK/base.XXXXXX")
    log "rootfs base: mmdebstrap $DEBIAN_SUITE + toolchains + npm ($BASE_NPM); this takes several minutes"
    mmdebstrap --quiet --mode=root --variant=minbase --include="$BASE_PACKAGES" \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --customize-hook="npm install -g --prefix \"\$1/usr/local\" --no-audit --no-fund --loglevel=error $BASE_NPM" \
        --customize-hook='chroot "$1" dpkg-query -W -f="\${Package} \${Version}\n" > "$1/etc/hearth-packages"' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/log/*.log' \
        "$DEBIAN_SUITE" "$dir" "$MIRROR" >&2
    rootfs_common "$dir"
    echo hearth >"$dir/etc/hostname"
    make_ext4 base "$dir" "$BASE_SIZE" "$key"
    rm -rf "$dir"
}

# --- the KVM test host --------------------------------------------------------------------------------------

# bookworm with QEMU from backports, plus the guest kernel's whole module tree (L1 runs that same kernel and
# loads kvm-amd, tun, nftables, bridge... on demand through modprobe). Booted by the test kit with the guest
# initramfs, whose agent becomes L1's PID 1.
build_kvm_host() {
    local key=$1 dir rel file old
    rel=$(cat "$WORK/kernel/release")
    dir=$(mktemp -d "$WORK/kvm-host.XXXXXX")
    log "kvm-host: mmdebstrap $KVMHOST_SUITE (minbase + $KVMHOST_PACKAGES); this takes a few minutes"
    mmdebstrap --quiet --mode=root --variant=minbase --include="$KVMHOST_PACKAGES" \
        --aptopt='APT::Install-Recommends "false"' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --customize-hook='chroot "$1" dpkg-query -W -f="\${Package} \${Version}\n" > "$1/etc/hearth-packages"' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/log/*.log' \
        "$KVMHOST_SUITE" "$dir" "deb $MIRROR $KVMHOST_SUITE main" "deb $MIRROR $KVMHOST_SUITE-backports main" >&2
    mkdir -p "$dir/usr/lib/modules"
    cp -a "$WORK/kernel/lib/modules/$rel" "$dir/usr/lib/modules/"
    depmod -b "$dir" "$rel"
    mkdir -p "$dir"/{run,tmp,root,proc,sys,dev,etc,hearth}
    chmod 1777 "$dir/tmp"
    echo hearth-kvm-host >"$dir/etc/hostname"
    printf '127.0.0.1\tlocalhost\n' >"$dir/etc/hosts"
    : >"$dir/etc/machine-id"
    mkdir -p "$OUT/kvm-host/versions"
    file="$OUT/kvm-host/versions/rootfs-${key:0:12}.ext4"
    rm -f "$file.tmp"
    truncate -s "$KVMHOST_SIZE" "$file.tmp"
    mkfs.ext4 -q -F -L hearth-kvm-host -E root_owner=0:0 -d "$dir" "$file.tmp" >&2
    chmod 0444 "$file.tmp"
    mv -f "$file.tmp" "$file"
    ln -sfn "versions/$(basename "$file")" "$OUT/kvm-host/rootfs.ext4.tmp"
    mv -fT "$OUT/kvm-host/rootfs.ext4.tmp" "$OUT/kvm-host/rootfs.ext4"
    rm -rf "$dir"
    old=$(find "$OUT/kvm-host/versions" -maxdepth 1 -name 'rootfs-*.ext4' ! -name "$(basename "$file")" -printf '%f ')
    if [ -n "$old" ]; then
        log "kvm-host: older versions kept for test hosts still running on them: $old(delete when unused)"
    fi
}

# --- manifest -----------------------------------------------------------------------------------------------

write_manifest() {
    local rel first=1 a path size digest
    rel=$(cat "$GK/release")
    {
        printf '{\n  "kernel_release": "%s",\n  "kernel_package": "%s",\n  "artifacts": [' "$rel" "$(stamp_get guest-kernel-package)"
        for a in vmlinuz vmlinux initramfs.cpio.gz rootfs/minimal.ext4 rootfs/debian.ext4 rootfs/base.ext4 \
            kvm-host/rootfs.ext4 kvm-host/vmlinux kvm-host/initramfs.cpio.gz; do
            path=$OUT/$a
            [ -e "$path" ] || continue
            size=$(stat -L -c %s "$path")
            digest=$(cat "$STAMPS/$(echo "$a" | tr / _).sha256" 2>/dev/null || file_sha "$path")
            [ "$first" = 1 ] || printf ','
            first=0
            printf '\n    {"name": "%s", "path": "%s", "resolved": "%s", "size": %s, "sha256": "%s"}' \
                "$a" "$path" "$(readlink -f "$path")" "$size" "$digest"
        done
        printf '\n  ]\n}\n'
    } >"$OUT/manifest.json.tmp"
    mv -f "$OUT/manifest.json.tmp" "$OUT/manifest.json"
}

record_sha() { file_sha "$OUT/$1" >"$STAMPS/$(echo "$1" | tr / _).sha256"; }

# --- driver -------------------------------------------------------------------------------------------------

fn_key() { declare -f "$@" | sha; }

# Scratch directories are "$WORK/<what>.XXXXXX". --one-file-system: never descend into a mount left behind.
remove_scratch() {
    find "$WORK" -mindepth 1 -maxdepth 1 -type d -name '*.??????' -exec rm -rf --one-file-system {} + 2>/dev/null || true
}

STALE=()
# needs NAME KEY FILE...: true when NAME must be (re)built.
needs() {
    local name=$1 key=$2 f
    shift 2
    [ "$FORCE" = 0 ] || return 0
    [ "$(stamp_get "$name")" = "$key" ] || return 0
    for f in "$@"; do [ -e "$f" ] || return 0; done
    return 1
}
# step NAME KEY FILES...: in check mode records a stale artifact, in build mode tells the caller to build it.
step() {
    if needs "$@"; then
        if [ "$MODE" = check ]; then
            STALE+=("$1")
            return 1
        fi
        return 0
    fi
    return 1
}

# The boot artifacts of one kernel (the kernel tree KDIR, its step key KEY), with the agent archive of key
# AKEY: the uncompressed vmlinux, the initramfs's base archive (modules and init) and the assembled initramfs.
# PREFIX "" makes the guests' (vmlinux, initramfs.cpio.gz in $OUT); "kvm-host-" the KVM test host's (in
# $OUT/kvm-host/). Each file is a step of its own; sets main's `changed` when one was rebuilt.
kernel_artifacts() {
    local prefix=$1 kdir=$2 key=$3 akey=$4
    local rel="" vkey bkey ikey base="$WORK/${prefix}base.cpio.gz"
    [ -n "$prefix" ] && rel="${prefix%-}/"
    vkey=$(printf '%s %s %s' "$key" "$(file_sha "$HERE/extract-vmlinux.sh")" "$(fn_key build_vmlinux)" | sha)
    if step "${prefix}vmlinux" "$vkey" "$OUT/${rel}vmlinux"; then
        build_vmlinux "$kdir" "$OUT/${rel}vmlinux"
        record_sha "${rel}vmlinux"
        stamp_set "${prefix}vmlinux" "$vkey"
        changed=1
    fi
    bkey=$(printf '%s %s %s %s' "$key" "$GUEST_MODULES" "$(pkg_version busybox-static)" \
        "$(fn_key init_script module_files build_base_initramfs)" | sha)
    if step "${prefix}initramfs-base" "$bkey" "$base"; then
        build_base_initramfs "$kdir" "$base"
        stamp_set "${prefix}initramfs-base" "$bkey"
    fi
    ikey=$(printf '%s %s %s' "$bkey" "$akey" "$(fn_key assemble_initramfs)" | sha)
    if step "${prefix}initramfs" "$ikey" "$OUT/${rel}initramfs.cpio.gz"; then
        assemble_initramfs "$base" "$OUT/${rel}initramfs.cpio.gz"
        record_sha "${rel}initramfs.cpio.gz"
        stamp_set "${prefix}initramfs" "$ikey"
        log "initramfs ($kdir): $(stat -c %s "$OUT/${rel}initramfs.cpio.gz") bytes"
        changed=1
    fi
}

main() {
    if [ "$MODE" = build ]; then
        [ "$(id -u)" -eq 0 ] || die "run as root (device nodes in the initramfs, mmdebstrap, file ownership)"
        mkdir -p "$OUT/rootfs" "$STAMPS" "$WORK"
        # One build at a time; a concurrent run waits.
        exec 9>"$OUT/.lock"
        if ! flock -n 9; then
            log "another images/build.sh is running; waiting for it"
            flock 9
        fi
        # Scratch directories of this run (and of an interrupted earlier one) go away.
        remove_scratch
        trap remove_scratch EXIT
    fi
    local kpkg kver kkey abin akey mkey dkey changed=0 t0
    t0=$(date +%s)

    local kernel_line
    kernel_line=$(resolve_kernel_package)
    read -r kpkg kver <<<"$kernel_line"
    kkey=$(printf '%s %s %s' "$kpkg" "$kver" "$(fn_key build_kernel apt_download)" | sha)
    if step kernel "$kkey" "$WORK/kernel/release"; then
        build_kernel "$kpkg" "$kver"
        stamp_set kernel-package "$kpkg $kver"
        stamp_set kernel "$kkey"
        changed=1
    fi

    # The guests' kernel ($GK, key $gkey): Debian's, or the microVM kernel built from its sources.
    local gkey gpkg
    GK=$WORK/kernel
    gkey=$kkey
    gpkg="$kpkg $kver"
    case "$GUEST_KERNEL" in
    debian) ;;
    microvm)
        gkey=$(printf '%s %s %s' "$kkey" "$(file_sha "$HERE/microvm-kernel.sh")" \
            "$(fn_key build_microvm_kernel apt_download)" | sha)
        if step microvm-kernel "$gkey" "$WORK/microvm/release" "$WORK/microvm/vmlinux"; then
            build_microvm_kernel "$kver"
            stamp_set microvm-kernel "$gkey"
            changed=1
        fi
        GK=$WORK/microvm
        gpkg="linux-source-$KERNEL_SERIES $kver (images/microvm-kernel.sh)"
        ;;
    *) die "HEARTH_GUEST_KERNEL=$GUEST_KERNEL: expected debian or microvm" ;;
    esac
    if step guest-kernel "$gkey" "$OUT/vmlinuz"; then
        install_guest_kernel "$GK"
        record_sha vmlinuz
        stamp_set guest-kernel-package "$gpkg"
        stamp_set guest-kernel "$gkey"
        changed=1
    fi

    abin=$(agent_binary)
    [ -f "$abin" ] || die "agent binary $abin does not exist"
    akey=$(printf '%s %s' "$(file_sha "$abin")" "$(fn_key build_agent_initramfs)" | sha)
    if step initramfs-agent "$akey" "$WORK/agent.cpio.gz"; then
        log "initramfs: agent archive from $abin"
        build_agent_initramfs "$abin"
        stamp_set initramfs-agent "$akey"
    fi

    kernel_artifacts "" "$GK" "$gkey" "$akey"

    mkey=$(printf '%s %s %s' "$(pkg_version busybox-static)" "$MINIMAL_SIZE" \
        "$(fn_key rootfs_common make_ext4 build_rootfs_minimal)" | sha)
    if step rootfs-minimal "$mkey" "$OUT/rootfs/minimal.ext4"; then
        log "rootfs minimal: busybox"
        build_rootfs_minimal "$mkey"
        record_sha rootfs/minimal.ext4
        stamp_set rootfs-minimal "$mkey"
        changed=1
    fi

    dkey=$(printf '%s %s %s %s %s' "$DEBIAN_SUITE" "$DEBIAN_PACKAGES" "$DEBIAN_SIZE" "$MIRROR" \
        "$(fn_key rootfs_common make_ext4 build_rootfs_debian)" | sha)
    if step rootfs-debian "$dkey" "$OUT/rootfs/debian.ext4"; then
        build_rootfs_debian "$dkey"
        record_sha rootfs/debian.ext4
        stamp_set rootfs-debian "$dkey"
        changed=1
    fi

    local basekey
    basekey=$(printf '%s %s %s %s %s %s' "$DEBIAN_SUITE" "$BASE_PACKAGES" "$BASE_NPM" "$BASE_SIZE" "$MIRROR" \
        "$(fn_key rootfs_common make_ext4 build_rootfs_base)" | sha)
    if step rootfs-base "$basekey" "$OUT/rootfs/base.ext4"; then
        build_rootfs_base "$basekey"
        record_sha rootfs/base.ext4
        stamp_set rootfs-base "$basekey"
        changed=1
    fi

    if [ "$KVM_HOST" = 1 ]; then
        # Not part of the mirror's key: the same packages come from any mirror.
        local hkey
        hkey=$(printf '%s %s %s %s %s' "$kkey" "$KVMHOST_SUITE" "$KVMHOST_PACKAGES" "$KVMHOST_SIZE" \
            "$(fn_key build_kvm_host)" | sha)
        if step kvm-host "$hkey" "$OUT/kvm-host/rootfs.ext4" "$WORK/kernel/release"; then
            build_kvm_host "$hkey"
            record_sha kvm-host/rootfs.ext4
            stamp_set kvm-host "$hkey"
            changed=1
        fi
        # L1's own kernel and initramfs: Debian's kernel whatever the guests boot (L1 loads kvm-amd, tun,
        # nftables... from the module tree above), with the guests' agent.
        kernel_artifacts kvm-host- "$WORK/kernel" "$kkey" "$akey"
    fi

    if [ "$MODE" = check ]; then
        [ -f "$OUT/manifest.json" ] || STALE+=(manifest.json)
        if [ "${#STALE[@]}" -gt 0 ]; then
            log "not current: ${STALE[*]} (run images/build.sh)"
            exit 1
        fi
        log "all artifacts in $OUT are built and current"
        exit 0
    fi

    if [ "$changed" = 1 ] || [ ! -f "$OUT/manifest.json" ]; then write_manifest; fi
    log "done in $(($(date +%s) - t0)) s: $OUT (guest kernel $(cat "$GK/release"))"
}

main
