#!/usr/bin/env bash
# Two lab guests, two "hosts", one CXL device: both guests' cxl-type3 devices are
# backed by the same host file. Runs CMD_A in guest A and CMD_B in guest B at the
# same time, each with the same mounts; exits non-zero unless both exit 0.
#   pair.sh [--cxl devdax|numa] [--mount H:G]... -- CMD_A -- CMD_B
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
common=(); cxl=devdax
while [ $# -gt 0 ] && [ "$1" != -- ]; do
    case "$1" in
        --cxl) cxl=$2; shift 2 ;;
        --mount) common+=(--mount "$2"); shift 2 ;;
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
bash "$HERE/run.sh" --cxl "$cxl" --shm "$shm" "${common[@]}" -- "${a[*]}" > "$shm.a.log" 2>&1 &
pa=$!
bash "$HERE/run.sh" --cxl "$cxl" --shm "$shm" "${common[@]}" -- "${b[*]}" > "$shm.b.log" 2>&1 &
pb=$!
set +e
wait $pa; ra=$?
wait $pb; rb=$?
set -e
echo "== guest A (exit $ra)"; grep -vE 'SeaBIOS|Booting|perfctr|sysrq|reboot' "$shm.a.log" | tail -n 20
echo "== guest B (exit $rb)"; grep -vE 'SeaBIOS|Booting|perfctr|sysrq|reboot' "$shm.b.log" | tail -n 20
rm -f "$shm.a.log" "$shm.b.log"
[ $ra -eq 0 ] && [ $rb -eq 0 ]
