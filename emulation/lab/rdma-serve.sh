#!/bin/sh
# In a lab guest: SoftRoCE on lo, then `cxlrt serve` in the background on the region
# SPEC (formatted first when it is a file that does not exist), as NAME on 127.0.0.1:PORT.
#   rdma-serve.sh PYTHON SPEC NAME PORT [SIZE]
# Prints the client spec (rdma:127.0.0.1:PORT/NAME) once the server listens; its log
# goes to /tmp/cxlrt-serve-NAME.log and its pid to /tmp/cxlrt-serve-NAME.pid.
set -e
py=$1; spec=$2; name=$3; port=$4; size=${5:-64M}
if [ ! -e /sys/class/infiniband/rxelo ]; then
    ip link set lo up
    modprobe rdma_rxe
    modprobe ib_uverbs
    rdma link add rxelo type rxe netdev lo
fi
case "$spec" in
    file:*) [ -e "${spec#file:}" ] || "$py" -m cxlrt format "$spec" --size "$size" --nodes 8 >/dev/null ;;
esac
"$py" -m cxlrt serve "$name=$spec" --listen "127.0.0.1:$port" >"/tmp/cxlrt-serve-$name.log" 2>&1 &
echo $! > "/tmp/cxlrt-serve-$name.pid"
i=0
until grep -q "listening" "/tmp/cxlrt-serve-$name.log" 2>/dev/null; do
    i=$((i + 1))
    if [ $i -gt 300 ] || ! kill -0 "$(cat /tmp/cxlrt-serve-$name.pid)" 2>/dev/null; then
        echo "rdma-serve.sh: the server did not start:" >&2
        cat "/tmp/cxlrt-serve-$name.log" >&2
        exit 1
    fi
    sleep 0.1
done
echo "rdma:127.0.0.1:$port/$name"
