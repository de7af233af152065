#!/bin/busybox sh
# Mount the read-only 9p root, give it writable tmpfs where Debian needs them,
# and hand over to /sbin/lab-init.
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs dev /dev
for m in netfs 9pnet 9pnet_virtio 9p; do
    f=$(ls /lib/modules/$m.ko* 2>/dev/null | head -n1)
    [ -n "$f" ] && case "$f" in
        *.xz) xz -dc "$f" > /tmp.ko && insmod /tmp.ko && rm -f /tmp.ko ;;
        *.zst) zstd -dc "$f" > /tmp.ko 2>/dev/null && insmod /tmp.ko && rm -f /tmp.ko ;;
        *) insmod "$f" ;;
    esac
done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose rootfs /newroot || {
    echo "LAB: cannot mount the 9p root"; poweroff -f; }
for d in tmp run var/tmp var/log var/lib/dhcp root srv mnt; do
    mount -t tmpfs tmpfs /newroot/$d 2>/dev/null || true
done
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount --move /dev /newroot/dev
exec switch_root /newroot /sbin/lab-init
