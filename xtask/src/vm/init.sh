#!/bin/busybox sh
# Stage 1 of the vm-test guest: the initramfs's /init, run by the static busybox beside it.
# It loads the modules the root file system needs (listed in /modules.order, dependencies
# first), mounts the host's root file system (virtiofs, read-only on the host side too) as the
# lower layer of an overlay whose upper layer is a tmpfs, so the guest can write anywhere and
# the host sees none of it, and hands over to stage 2 (/stage2.sh, run by the host's bash).
export PATH=/bin

# Anything wrong here is reported on the results port, where the host looks, then the guest
# powers off at once instead of waiting for the host's timeout.
fail() {
    echo "stage 1: $*"
    echo "@@vm-test fatal stage 1: $*" > /dev/ttyS1
    poweroff -f
}

mkdir -p /dev /proc /sys /lower /rw /newroot
mount -t devtmpfs devtmpfs /dev || fail "mounting devtmpfs"
mount -t proc proc /proc || fail "mounting /proc"
while read -r module; do
    insmod "/modules/$module" || fail "insmod $module"
done < /modules.order
mount -t virtiofs -o ro hostroot /lower || fail "mounting the host's root (virtiofs tag hostroot)"
mount -t tmpfs -o mode=0755 tmpfs /rw || fail "mounting the overlay's tmpfs"
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot \
    || fail "mounting the overlay root"
mkdir -p /newroot/.vm-test || fail "writing to the overlay root"
cp /stage2.sh /systemd-boot.sh /plan.sh /newroot/.vm-test/ || fail "copying stage 2"
[ -x /newroot/bin/bash ] || fail "the host has no /bin/bash"
mount --move /dev /newroot/dev || fail "moving /dev"
umount /proc
exec switch_root /newroot /bin/bash /.vm-test/stage2.sh
fail "switch_root failed"
