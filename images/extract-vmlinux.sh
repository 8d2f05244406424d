#!/bin/sh
# extract-vmlinux.sh VMLINUZ OUT
#
# Turns an x86 bzImage (what Debian ships as /boot/vmlinuz-*) into the uncompressed ELF `vmlinux` that
# Firecracker's x86_64 loader needs.
#
# How: the boot protocol's setup header says where the compressed kernel sits.
#   - byte 0x1f1        setup_sects (0 means 4): the real-mode setup is (setup_sects + 1) * 512 bytes,
#                       the protected-mode kernel starts right after it;
#   - u32 LE at 0x248   payload_offset, relative to the protected-mode kernel;
#   - u32 LE at 0x24c   payload_length.
# The payload's format is found from its magic bytes. The kernel build appends the uncompressed size as a
# u32 LE to every payload (gzip's own trailer carries the same number), so the result's size is checked
# against it, and the output must start with "\177ELF".
#
# Needs: od, dd, and the decompressor for the payload's format (gzip, xz, lz4, zstd, bzip2 or lzma).
set -eu

usage() {
    echo "usage: $0 VMLINUZ OUT" >&2
    exit 2
}

die() {
    echo "extract-vmlinux: $*" >&2
    exit 1
}

[ $# -eq 2 ] || usage
in=$1
out=$2
[ -f "$in" ] || die "$in: not a file"

# Prints the unsigned little-endian integer of $2 bytes at byte offset $1 of the input.
read_le() {
    od -An -v -t u1 -j "$1" -N "$2" "$in" | awk '
        { for (i = 1; i <= NF; i++) b[n++] = $i }
        END { v = 0; for (i = n - 1; i >= 0; i--) v = v * 256 + b[i]; if (n == 0) exit 1; printf "%d\n", v }'
}

# Prints the first $2 bytes at offset $1 of file $3 as lowercase hex without separators.
hex_at() {
    od -An -v -t x1 -j "$1" -N "$2" "$3" | tr -d ' \n'
}

size=$(wc -c <"$in")
[ "$size" -gt 1024 ] || die "$in: too small to be a bzImage"
[ "$(hex_at 514 4 "$in")" = "48647253" ] || die "$in: no 'HdrS' boot header signature (not a bzImage)"

setup_sects=$(read_le $((0x1f1)) 1)
[ "$setup_sects" -eq 0 ] && setup_sects=4
pm_start=$(((setup_sects + 1) * 512))
payload_offset=$(read_le $((0x248)) 4)
payload_length=$(read_le $((0x24c)) 4)
start=$((pm_start + payload_offset))
[ "$payload_length" -gt 4 ] || die "$in: empty payload (payload_length=$payload_length)"
[ $((start + payload_length)) -le "$size" ] ||
    die "$in: payload ($start + $payload_length) runs past the end of the file ($size)"

magic=$(hex_at "$start" 4 "$in")
# Uncompressed size appended by the kernel build (gzip: the ISIZE trailer field), little-endian.
expected=$(read_le $((start + payload_length - 4)) 4)

case "$magic" in
1f8b*) fmt=gzip; decomp="gzip -dc"; strip=0 ;;
fd377a58) fmt=xz; decomp="xz -dc"; strip=4 ;;
02214c18) fmt=lz4; decomp="lz4 -dc"; strip=4 ;;
28b52ffd) fmt=zstd; decomp="zstd -dcq"; strip=4 ;;
425a68*) fmt=bzip2; decomp="bzip2 -dc"; strip=4 ;;
5d0000*) fmt=lzma; decomp="xz -dc --format=lzma"; strip=4 ;;
*) die "$in: unknown payload compression (magic $magic at offset $start)" ;;
esac
tool=${decomp%% *}
command -v "$tool" >/dev/null 2>&1 || die "payload is $fmt but '$tool' is not installed"

tmp=$(mktemp "${out}.tmp.XXXXXX")
trap 'rm -f "$tmp"' EXIT INT TERM

# tail -c +N is 1-based; head -c drops the appended size field where the format does not carry it itself.
tail -c +$((start + 1)) "$in" | head -c $((payload_length - strip)) | $decomp >"$tmp" ||
    die "$fmt decompression failed"

got=$(wc -c <"$tmp")
[ "$(hex_at 0 4 "$tmp")" = "7f454c46" ] || die "decompressed $fmt payload is not an ELF file"
[ "$got" -eq "$expected" ] || die "decompressed size $got differs from the recorded size $expected"

chmod 0644 "$tmp"
mv -f "$tmp" "$out"
trap - EXIT INT TERM
echo "extract-vmlinux: $in ($fmt, $payload_length bytes) -> $out ($got bytes)" >&2
