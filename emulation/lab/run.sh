#!/usr/bin/env bash
# Run a command in a lab guest with a CXL Type-3 volatile device and the given
# host folders mounted; exit with the command's exit code.
#   run.sh [--cxl devdax|numa|none] [--shm FILE] [--mount HOSTDIR:GUESTDIR]... -- CMD
# Settings: CXLRT_LAB (lab folder), LAB_MEM (1G), LAB_SMP (1), LAB_CXL_SIZE (256M),
# LAB_TIMEOUT (seconds, 300), LAB_ACCEL (tcg; kvm where the host really has it).
set -euo pipefail
LAB=${CXLRT_LAB:-$HOME/.cache/cxlrt-lab}
[ -f "$LAB/initramfs.cpio.gz" ] || { echo "lab not set up: run emulation/lab/setup.sh" >&2; exit 3; }
cxl=devdax; shm=""; mounts=(); qemu_extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --cxl) cxl=$2; shift 2 ;;
        --shm) shm=$2; shift 2 ;;
        --mount) mounts+=("$2"); shift 2 ;;
        --qemu) qemu_extra+=($2); shift 2 ;;
        --) shift; break ;;
        *) echo "run.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || { echo "run.sh: no command given (after --)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '%s\n' "set -e" "$*" > "$work/cmd.sh"
args=(-accel "${LAB_ACCEL:-tcg}" -cpu max,-hypervisor -smp "${LAB_SMP:-1}" -nographic -no-reboot
      -nic none -m "${LAB_MEM:-1G}",maxmem=8G,slots=8
      -kernel "$LAB/vmlinuz" -initrd "$LAB/initramfs.cpio.gz"
      -fsdev "local,id=fsroot,path=$LAB/rootfs,security_model=none,readonly=on"
      -device virtio-9p-pci,fsdev=fsroot,mount_tag=rootfs
      -fsdev "local,id=fscmd,path=$work,security_model=none"
      -device virtio-9p-pci,fsdev=fscmd,mount_tag=labcmd)
tags="labcmd:/mnt/labcmd"
i=0
for m in "${mounts[@]}"; do
    host=${m%%:*}; guest=${m#*:}
    # The guest root is read-only: make the mount point in the shared root folder.
    case "$guest" in
        /tmp/*|/run/*|/root/*|/srv/*|/mnt/*) ;;
        *) mkdir -p "$LAB/rootfs$guest" ;;
    esac
    args+=(-fsdev "local,id=fs$i,path=$host,security_model=none"
           -device "virtio-9p-pci,fsdev=fs$i,mount_tag=m$i")
    tags="$tags,m$i:$guest"; i=$((i + 1))
done
machine="q35"
if [ "$cxl" != none ]; then
    size=${LAB_CXL_SIZE:-256M}
    if [ -z "$shm" ]; then shm="$work/cxl.mem"; truncate -s "$size" "$shm"; fi
    machine="q35,cxl=on"
    args+=(-object "memory-backend-file,id=cxl-mem0,share=on,mem-path=$shm,size=$size"
           -device pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.1
           -device cxl-rp,port=0,bus=cxl.1,id=root_port13,chassis=0,slot=2
           -device cxl-type3,bus=root_port13,volatile-memdev=cxl-mem0,id=cxl-vmem0
           -M cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=4G)
    printf '%s\n' "set -e" "/sbin/lab-cxl $cxl" "$*" > "$work/cmd.sh"
fi
chmod 0755 "$work/cmd.sh"
append="console=ttyS0 quiet panic=-1 lab.mounts=$tags lab.cmd=/mnt/labcmd/cmd.sh"
out="$work/console.log"
set +e
timeout "${LAB_TIMEOUT:-300}" qemu-system-x86_64 -machine "$machine" "${args[@]}" \
    "${qemu_extra[@]}" -append "$append" </dev/null | tee "$out" | grep -v '^LAB: ' 
qrc=${PIPESTATUS[0]}
set -e
rc=$(sed -n 's/^LAB: exit \([0-9]*\).*/\1/p' "$out" | tail -n1)
if [ -z "$rc" ]; then
    echo "run.sh: the guest did not report an exit code (qemu exit $qrc)" >&2
    exit 4
fi
exit "$rc"
