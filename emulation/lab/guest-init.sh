#!/bin/bash
# PID 1 in a lab guest: mount the shares named on the kernel command line
# (lab.mounts=tag:/dir,...), run lab.cmd with its exit code reported on the
# console, then power off.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
mount -t tmpfs tmpfs /dev/shm 2>/dev/null || { mkdir -p /dev/shm && mount -t tmpfs tmpfs /dev/shm; }
mkdir -p /dev/pts && mount -t devpts devpts /dev/pts
cmd=""; mounts=""
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        lab.cmd=*) cmd="${arg#lab.cmd=}" ;;
        lab.mounts=*) mounts="${arg#lab.mounts=}" ;;
    esac
done
for spec in ${mounts//,/ }; do
    tag=${spec%%:*}; dir=${spec#*:}
    mkdir -p "$dir"
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 "$tag" "$dir" || echo "LAB: mount $tag failed"
done
echo "LAB: up"
rc=0
if [ -n "$cmd" ]; then
    bash -c "$cmd"; rc=$?
else
    bash -i </dev/ttyS0 >/dev/ttyS0 2>&1
fi
echo "LAB: exit $rc"
sync
echo o > /proc/sysrq-trigger
sleep 5
