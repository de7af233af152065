#!/bin/sh
# In a lab guest: SoftRoCE on a netdev, then `cxlrt serve` in the background on the
# region SPEC, as NAME on ADDR:PORT.
#   [RDMA_NETDEV=lo] [RDMA_ADDR=127.0.0.1] rdma-serve.sh PYTHON SPEC NAME PORT [SIZE]
# Prints the client spec (rdma:ADDR:PORT/NAME) once the server listens; its log goes
# to /tmp/cxlrt-serve-NAME.log and its pid to /tmp/cxlrt-serve-NAME.pid.
set -e
py=$1; spec=$2; name=$3; port=$4; size=${5:-64M}
netdev=${RDMA_NETDEV:-lo}; addr=${RDMA_ADDR:-127.0.0.1}
sh "$(dirname "$0")/rxe-up.sh" "$netdev"
# A file region (file:, numa:) is made here when missing; a device (dax:) is served as
# it is, and its clients format it.
case "$spec" in
    dax:*) ;;
    *) "$py" -m cxlrt info "$spec" >/dev/null 2>&1 ||
        "$py" -m cxlrt format "$spec" --size "$size" --nodes 8 >/dev/null ;;
esac
"$py" -m cxlrt serve "$name=$spec" --listen "$addr:$port" >"/tmp/cxlrt-serve-$name.log" 2>&1 &
echo $! > "/tmp/cxlrt-serve-$name.pid"
i=0
until grep -q "listening" "/tmp/cxlrt-serve-$name.log" 2>/dev/null; do
    i=$((i + 1))
    # 120 s: a TCG guest on a slow host took over 30 s to start a server on the CPU-less
    # node (a dead server ends the wait at once).
    if [ $i -gt 1200 ] || ! kill -0 "$(cat /tmp/cxlrt-serve-$name.pid)" 2>/dev/null; then
        echo "rdma-serve.sh: the server did not start:" >&2
        cat "/tmp/cxlrt-serve-$name.log" >&2
        exit 1
    fi
    sleep 0.1
done
echo "rdma:$addr:$port/$name"
