#!/bin/sh
# In a lab guest: a SoftRoCE device rxe-NETDEV on NETDEV (default lo), once.
# For eth0 (two guests, pair.sh --net): RDMA_IP=10.9.0.N/24 gives it an IPv4 address,
# which makes an IPv4-mapped GID (RoCE v2), the one rdma: picks by default.
set -e
netdev=${1:-lo}
dev=rxe-$netdev
[ -e "/sys/class/infiniband/$dev" ] && exit 0
modprobe rdma_rxe
modprobe ib_uverbs
[ "$netdev" = lo ] || modprobe virtio_net 2>/dev/null || true
ip link set "$netdev" up
if [ -n "${RDMA_IP:-}" ]; then
    ip addr add "$RDMA_IP" dev "$netdev" 2>/dev/null || true
fi
rdma link add "$dev" type rxe netdev "$netdev"
for _ in $(seq 100); do
    [ -e "/sys/class/infiniband/$dev" ] && exit 0
    sleep 0.05
done
echo "rxe-up.sh: $dev did not appear" >&2
exit 1
