#!/usr/bin/env bash
# Two lab guests, two "hosts", one CXL device: both guests' cxl-type3 devices are
# backed by the same host file. Runs CMD_A in guest A and CMD_B in guest B at the
# same time, each with the same mounts; exits non-zero unless both exit 0.
#   pair.sh [--cxl devdax|numa|none] [--net] [--mount H:G]... -- CMD_A -- CMD_B
# --net links the guests' eth0 (virtio-net over a QEMU dgram netdev: UDP on the host's
# 127.0.0.1, nothing else reachable), e.g. for SoftRoCE between them (rxe-up.sh).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
common=(); cxl=devdax; net=0
while [ $# -gt 0 ] && [ "$1" != -- ]; do
    case "$1" in
        --cxl) cxl=$2; shift 2 ;;
        --mount) common+=(--mount "$2"); shift 2 ;;
        --net) net=1; shift ;;
        *) echo "pair.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
shift
a=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do a+=("$1"); shift; done
[ $# -gt 0 ] && shift
b=("$@")
[ ${#a[@]} -gt 0 ] && [ ${#b[@]} -gt 0 ] || { echo "pair.sh: need -- CMD_A -- CMD_B" >&2; exit 2; }
shm=$(mktemp -p /dev/shm cxlrt-lab-pair.XXXXXX)
trap 'rm -f "$shm"' EXIT
truncate -s "${LAB_CXL_SIZE:-256M}" "$shm"
export LAB_SMP=1  # one vCPU a guest: two SMP guests can crash TCG (qemu-cxl-lab.md)
neta=(); netb=()
if [ "$net" = 1 ]; then
    p=$((40000 + RANDOM % 20000))
    nic() {  # local port, remote port, MAC suffix
        echo "-netdev dgram,id=n0,local.type=inet,local.host=127.0.0.1,local.port=$1,remote.type=inet,remote.host=127.0.0.1,remote.port=$2 -device virtio-net-pci,netdev=n0,mac=52:54:00:00:00:$3"
    }
    neta=(--qemu "$(nic $p $((p + 1)) 0a)"); netb=(--qemu "$(nic $((p + 1)) $p 0b)")
fi
bash "$HERE/run.sh" --cxl "$cxl" --shm "$shm" "${neta[@]}" "${common[@]}" -- "${a[*]}" > "$shm.a.log" 2>&1 &
pa=$!
bash "$HERE/run.sh" --cxl "$cxl" --shm "$shm" "${netb[@]}" "${common[@]}" -- "${b[*]}" > "$shm.b.log" 2>&1 &
pb=$!
set +e
wait $pa; ra=$?
wait $pb; rb=$?
set -e
echo "== guest A (exit $ra)"; grep -vE 'SeaBIOS|Booting|perfctr|sysrq|reboot' "$shm.a.log" | tail -n 20
echo "== guest B (exit $rb)"; grep -vE 'SeaBIOS|Booting|perfctr|sysrq|reboot' "$shm.b.log" | tail -n 20
rm -f "$shm.a.log" "$shm.b.log"
[ $ra -eq 0 ] && [ $rb -eq 0 ]
