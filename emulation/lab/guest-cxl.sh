#!/bin/bash
# In a lab guest: turn the CXL Type-3 volatile device into a region, then into
# /dev/dax0.0 (lab-cxl devdax) or a CPU-less NUMA node (lab-cxl numa).
# The sysfs steps replace `cxl create-region`, which bookworm's ndctl cannot do
# for RAM regions.
set -euo pipefail
mode=${1:-devdax}
for m in cxl_acpi cxl_pci cxl_port cxl_mem device_dax dax_cxl kmem; do modprobe $m 2>/dev/null || true; done
for _ in $(seq 50); do [ -e /sys/bus/cxl/devices/decoder0.0 ] && [ -e /sys/bus/cxl/devices/mem0 ] && break; sleep 0.1; done
[ "$mode" = devdax ] && echo offline > /sys/devices/system/memory/auto_online_blocks
root=/sys/bus/cxl/devices/decoder0.0
region=$(cat $root/create_ram_region)
echo "$region" > $root/create_ram_region
r=/sys/bus/cxl/devices/$region
ep=$(ls -d /sys/bus/cxl/devices/decoder*.0 | grep -v decoder0.0 | tail -n1)
size=$(cat /sys/bus/cxl/devices/mem0/ram/size)
echo 256 > $r/interleave_granularity
echo 1 > $r/interleave_ways
echo "$size" > $r/size
echo ram > "$ep/mode"
echo "$size" > "$ep/dpa_size"
echo "$(basename "$ep")" > $r/target0
echo 1 > $r/commit
echo "$region" > /sys/bus/cxl/drivers/cxl_region/bind
for _ in $(seq 50); do [ -e /sys/bus/dax/devices/dax0.0 ] && break; sleep 0.1; done
if [ "$mode" = devdax ]; then
    daxctl reconfigure-device --mode=devdax --force dax0.0 >/dev/null
    for _ in $(seq 50); do [ -e /dev/dax0.0 ] && break; sleep 0.1; done
    ls -l /dev/dax0.0
else
    daxctl reconfigure-device --mode=system-ram --force dax0.0 >/dev/null 2>&1 || true
    numactl -H | grep -E "^node [0-9]+ (cpus|size)"
fi
