#!/usr/bin/env bash
# images/microvm-kernel.sh SRC BASE_CONFIG OUT
#
# Builds a guest kernel for hearth's microVMs from Debian's kernel sources (linux-source-6.1) and Debian's cloud
# kernel config (BASE_CONFIG), trimmed to what a hearth guest uses:
#   - every module hearth's initramfs loads (images/build.sh GUEST_MODULES) is built in, every other module is
#     left out (a guest's root filesystem has no module tree, so it could never load one);
#   - no NUMA, at most 64 CPUs (Debian's MAXSMP sizes per-CPU data for 8,192), no Xen or Hyper-V guest code, no
#     function tracer, no debug info, no LSMs a guest does not run, no module signing.
# Writes OUT/vmlinux (ELF with the PVH note, for QEMU and Firecracker), OUT/vmlinuz (bzImage), OUT/config,
# OUT/release and OUT/lib/modules/<release>/modules.builtin (so that `modprobe --show-depends` reports the
# guest's modules as built in).
#
# Needs: gcc, make, bc, flex, bison, perl, libelf-dev, libssl-dev
# (`apt-get install build-essential bc flex bison libelf-dev libssl-dev`).
set -euo pipefail

[ $# -eq 3 ] || {
    echo "usage: $0 SRC BASE_CONFIG OUT" >&2
    exit 2
}
SRC=$1
BASE=$2
OUT=$3
for tool in gcc make bc flex bison perl; do
    command -v "$tool" >/dev/null || {
        echo "microvm-kernel: $tool is missing (apt-get install build-essential bc flex bison libelf-dev libssl-dev)" >&2
        exit 1
    }
done
for header in /usr/include/libelf.h /usr/include/openssl/ssl.h; do
    [ -f "$header" ] || {
        echo "microvm-kernel: $header is missing (apt-get install libelf-dev libssl-dev)" >&2
        exit 1
    }
done

# Config symbols of the guest's modules (built in instead).
BUILTIN="VIRTIO VIRTIO_MMIO VIRTIO_BLK VIRTIO_CONSOLE FAILOVER NET_FAILOVER VIRTIO_NET VSOCKETS \
VIRTIO_VSOCKETS VIRTIO_VSOCKETS_COMMON HW_RANDOM HW_RANDOM_VIRTIO VIRTIO_BALLOON OVERLAY_FS \
SUNRPC GRACE_PERIOD LOCKD NFS_FS NFS_V3 NFS_ACL_SUPPORT NFS_COMMON"
# Built-in parts of Debian's cloud kernel that a microVM guest does not use.
DISABLE="MAXSMP NUMA XEN HYPERV FTRACE FUNCTION_TRACER KPROBES DEBUG_INFO DEBUG_INFO_BTF \
SECURITY_SELINUX SECURITY_APPARMOR SECURITY_TOMOYO SECURITY_YAMA AUDIT MODULE_SIG IKHEADERS KALLSYMS_ALL \
SLUB_DEBUG SCHED_MC X86_MCE MICROCODE HIBERNATION SUSPEND PM_SLEEP ACPI_APEI INTEL_IOMMU AMD_IOMMU \
X86_X2APIC_UV X86_UV MEMORY_HOTPLUG XFS_FS BTRFS_FS"

cd "$SRC"
cp "$BASE" .config
# Every module out (the guest's are turned back on, built in, below).
sed -i 's/=m$/=n/' .config
sc() { scripts/config --file .config "$@"; }
for s in $BUILTIN; do sc --enable "$s"; done
for s in $DISABLE; do sc --disable "$s"; done
# Debug info is a choice: leave the toolchain default and take "none".
sc --disable DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT
sc --enable DEBUG_INFO_NONE
sc --set-val NR_CPUS 64
sc --set-str SYSTEM_TRUSTED_KEYS ""
sc --set-str SYSTEM_REVOCATION_KEYS ""
sc --set-str LOCALVERSION "-hearth"
sc --disable LOCALVERSION_AUTO
make -s olddefconfig
# olddefconfig may drop a symbol whose dependency went away: every built-in the guest needs must have stayed.
grep -q '^CONFIG_DEBUG_INFO_NONE=y' .config || {
    echo "microvm-kernel: debug info is still on after olddefconfig" >&2
    exit 1
}
for s in $BUILTIN; do
    grep -q "^CONFIG_$s=y" .config || {
        echo "microvm-kernel: CONFIG_$s is not built in after olddefconfig" >&2
        exit 1
    }
done
make -s -j"$(nproc)" vmlinux bzImage modules
rel=$(make -s kernelrelease)
mkdir -p "$OUT"
rm -rf "$OUT/lib"
make -s INSTALL_MOD_PATH="$OUT" modules_install
rm -f "$OUT/lib/modules/$rel/build" "$OUT/lib/modules/$rel/source"
cp vmlinux "$OUT/vmlinux"
cp arch/x86/boot/bzImage "$OUT/vmlinuz"
cp .config "$OUT/config"
printf '%s\n' "$rel" >"$OUT/release"
echo "microvm-kernel: $rel: vmlinux $(stat -c %s "$OUT/vmlinux") bytes, bzImage $(stat -c %s "$OUT/vmlinuz") bytes" >&2
