#!/usr/bin/env bash
# Build the virtual CXL lab once per machine: QEMU >= 8 with CXL Type-3 (Debian
# bookworm-backports), a 6.12 guest kernel with CXL/DAX/NUMA/RXE drivers, a
# debootstrap root shared read-only over 9p, and a busybox initramfs.
# Idempotent: finished steps are skipped. Everything lands in $CXLRT_LAB
# (default: ~/.cache/cxlrt-lab); /etc/apt is not touched (private APT_CONFIG).
set -euo pipefail
LAB=${CXLRT_LAB:-$HOME/.cache/cxlrt-lab}
KVER=${CXLRT_LAB_KERNEL:-6.12.95+deb12-amd64}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$LAB"
log() { printf '[lab setup %5ss] %s\n' "$SECONDS" "$*" >&2; }

# 1. A private apt configuration that adds bookworm-backports.
APT="$LAB/apt"
if [ ! -f "$APT/apt.conf" ]; then
    mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/sources.list.d"
    # The machine's own Debian mirror (deb822 "URIs:" first, then one-line "deb"),
    # never a security or snapshot archive.
    mirror=$( { grep -rhE '^URIs:' /etc/apt/sources.list.d/ 2>/dev/null | awk '{print $2}';
                grep -rhoE '^deb +https?://[^ ]+' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null | awk '{print $2}'; } \
              | grep -E '/debian/?$' | grep -vE 'security|snapshot' | head -n1 || true)
    if [ -z "$mirror" ]; then
        echo "lab setup: no Debian mirror in this machine's apt configuration" \
             "(/etc/apt/sources.list, /etc/apt/sources.list.d/): add one, then run this again" >&2
        exit 1
    fi
    cat > "$APT/sources.list" <<SRC
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $mirror bookworm-backports main
SRC
    cat > "$APT/apt.conf" <<CONF
Dir::Etc::sourcelist "$APT/sources.list";
Dir::Etc::sourceparts "$APT/sources.list.d";
Dir::State::Lists "$APT/lists";
Dir::Cache "$APT/cache";
APT::Sandbox::User "root";
CONF
fi
export APT_CONFIG="$APT/apt.conf"

if ! command -v qemu-system-x86_64 >/dev/null || \
   ! qemu-system-x86_64 -device help 2>/dev/null | grep -q cxl-type3 || \
   ! qemu-system-x86_64 -device cxl-type3,help 2>/dev/null | grep -q volatile-memdev; then
    log "installing QEMU from bookworm-backports"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        -t bookworm-backports qemu-system-x86 >/dev/null
fi
for tool in debootstrap busybox cpio depmod; do
    if ! command -v $tool >/dev/null; then
        log "installing debootstrap, busybox-static, cpio, kmod"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            debootstrap busybox-static cpio kmod >/dev/null
        break
    fi
done

# 2. The guest kernel and its modules (unpacked, never installed on the host).
if [ ! -f "$LAB/kernel/lib/modules/$KVER/modules.dep" ]; then
    log "downloading linux-image-$KVER"
    apt-get update -qq
    (cd "$LAB" && apt-get download -qq "linux-image-$KVER-unsigned/bookworm-backports")
    rm -rf "$LAB/kernel" && mkdir -p "$LAB/kernel"
    dpkg -x "$LAB"/linux-image-"$KVER"-unsigned_*.deb "$LAB/kernel"
    rm -f "$LAB"/linux-image-*.deb
    depmod -b "$LAB/kernel" "$KVER"
fi

# 3. The guest root: a minimal Debian shared read-only over 9p.
ROOT="$LAB/rootfs"
if [ ! -f "$ROOT/.complete" ] || [ ! -f "$ROOT/lib/modules/$KVER/modules.dep" ]; then
    log "debootstrap (about a minute)"
    rm -rf "$ROOT"
    debootstrap --variant=minbase \
        --include=python3,python3-numpy,ndctl,daxctl,numactl,kmod,procps,iproute2,rdma-core,ibverbs-utils,ibverbs-providers,python3-pyverbs,perftest \
        bookworm "$ROOT" >/dev/null
    mkdir -p "$ROOT/lib/modules"
    cp -a "$LAB/kernel/lib/modules/$KVER" "$ROOT/lib/modules/"
    touch "$ROOT/.complete"
fi
# perftest (ib_read_bw, ib_write_bw, ib_read_lat: the baselines of perf/rdma_lab.py)
# and what it needs beyond rdma-core, unpacked into a root made before it was listed.
if [ ! -f "$ROOT/usr/share/doc/libpci3/copyright" ] || [ ! -x "$ROOT/usr/bin/ib_read_bw" ]; then
    log "adding perftest to the guest root"
    apt-get update -qq
    (cd "$LAB" && apt-get download -qq perftest/bookworm libpci3/bookworm pci.ids/bookworm \
        libibumad3/bookworm librdmacm1/bookworm &&
     for d in perftest_*.deb libpci3_*.deb pci.ids_*.deb libibumad3_*.deb librdmacm1_*.deb; do
         dpkg -x "$d" "$ROOT"
     done && rm -f ./*.deb)
fi
# libibverbs' headers on this host: cxlrt's rdma: backend builds against them (setup.py),
# and its tests run in the guests.
if [ ! -f /usr/include/infiniband/verbs.h ]; then
    log "installing libibverbs-dev"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        libibverbs-dev >/dev/null
fi
install -m 0755 "$HERE/guest-init.sh" "$ROOT/sbin/lab-init"
install -m 0755 "$HERE/guest-cxl.sh" "$ROOT/sbin/lab-cxl"

# 4. The initramfs: busybox and the 9p modules, enough to mount the root.
if [ ! -f "$LAB/initramfs.cpio.gz" ] || [ "$HERE/initramfs-init.sh" -nt "$LAB/initramfs.cpio.gz" ]; then
    log "building the initramfs"
    IR="$LAB/initramfs"
    rm -rf "$IR" && mkdir -p "$IR"/{bin,dev,proc,sys,newroot,lib/modules}
    cp "$(command -v busybox)" "$IR/bin/busybox"
    for m in netfs 9pnet 9pnet_virtio 9p; do
        f=$(find "$LAB/kernel/lib/modules/$KVER" -name "$m.ko*" | head -n1)
        [ -n "$f" ] && cp "$f" "$IR/lib/modules/"
    done
    install -m 0755 "$HERE/initramfs-init.sh" "$IR/init"
    (cd "$IR" && find . | cpio -o -H newc 2>/dev/null | gzip -1 > "$LAB/initramfs.cpio.gz")
fi
ln -sf "$LAB/kernel/boot/vmlinuz-$KVER" "$LAB/vmlinuz"
log "ready: $LAB ($(qemu-system-x86_64 --version | head -n1))"
