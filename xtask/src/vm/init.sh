#!/bin/busybox sh
# Stage 1 of the vm-test guest: the initramfs's /init, run by the static busybox beside it.
# It loads the modules the root file system needs (listed in /modules.order, dependencies
# first), mounts the host's root file system (virtiofs, read-only on the host side too) as the
# lower layer of an overlay whose upper layer is a tmpfs, so the guest can write anywhere and
# the host sees none of it, and hands over to stage 2 (/stage2.sh, run by the host's bash).
# A guest of another architecture than the host's switches into its own root file system
# instead, a directory of the host's (GUEST_ROOT), with the host directories the run needs
# (GUEST_BINDS: the workspace, the target directory) bound into it at their own paths.
export PATH=/bin
# RESULTS (the results port), GUEST_ROOT, GUEST_BINDS.
. /stage1.env

# Anything wrong here is reported on the results port, where the host looks, then the guest
# powers off at once instead of waiting for the host's timeout.
fail() {
    echo "stage 1: $*"
    [ -e "$RESULTS" ] && echo "@@vm-test fatal stage 1: $*" > "$RESULTS"
    poweroff -f
}

mkdir -p /dev /proc /sys /lower /rw /newroot
mount -t devtmpfs devtmpfs /dev || fail "mounting devtmpfs"
mount -t proc proc /proc || fail "mounting /proc"
while read -r module; do
    insmod "/modules/$module" || fail "insmod $module"
done < /modules.order
# A virtio console's device node appears once its driver has probed it.
tries=0
while [ ! -e "$RESULTS" ] && [ "$tries" -lt 100 ]; do
    sleep 0.1
    tries=$((tries + 1))
done
[ -e "$RESULTS" ] || fail "no results port $RESULTS"
mount -t virtiofs -o ro hostroot /lower || fail "mounting the host's root (virtiofs tag hostroot)"
mount -t tmpfs -o mode=0755 tmpfs /rw || fail "mounting the overlay's tmpfs"
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot \
    || fail "mounting the overlay root"
root=/newroot
if [ -n "$GUEST_ROOT" ]; then
    mkdir -p /guestroot
    mount --bind "/newroot$GUEST_ROOT" /guestroot || fail "binding the guest's root $GUEST_ROOT"
    for dir in $GUEST_BINDS; do
        mkdir -p "/guestroot$dir" || fail "creating $dir in the guest's root"
        mount --bind "/newroot$dir" "/guestroot$dir" || fail "binding $dir into the guest's root"
    done
    root=/guestroot
fi
mkdir -p $root/.vm-test || fail "writing to the overlay root"
cp /stage2.sh /systemd-boot.sh /node-boot.sh /guest-systemd.sh /plan.sh $root/.vm-test/ || fail "copying stage 2"
[ -x $root/bin/bash ] || fail "the root file system has no /bin/bash"
mount --move /dev $root/dev || fail "moving /dev"
umount /proc
exec switch_root $root /bin/bash /.vm-test/stage2.sh
fail "switch_root failed"
