#!/bin/bash
# Stage 2 of the vm-test guest, PID 1 on the overlay of the host's root: the guest's own proc,
# sys, cgroup2, bpffs and /run (its /tmp is the host's under the overlay: a workspace cloned
# below /tmp is visible, and what the tests write there stays in the guest); the kernel's
# modules where modprobe looks (the kernel loads veth, nf_tables, conntrack... on demand, as on
# a real node); the run's frozen binaries over the profile directory; then every test binary,
# with its output on the results port ($VM_RESULTS: /dev/ttyS1 on x86_64, the virtio console
# /dev/hvc0 on arm64) between markers the host parses:
#   @@vm-test ready kernel=RELEASE
#   @@vm-test begin NAME
#   (the test binary's own output: one "test NAME ... ok|FAILED|ignored" line per test)
#   @@vm-test end NAME exit=CODE ms=MILLISECONDS
#   @@vm-test done binaries=N failed=M ms=MILLISECONDS
# The kernel's console (ttyS0, ttyAMA0) keeps only the kernel's messages and this script's errors.
# On arm64 the root is Debian's own arm64 tree (the host's tools cannot run there), with the
# workspace and the target directory bound in at their paths; a binary may run only some of its
# tests (VM_TEST_FILTERS: libtest filters, "--exact" first when exact).
set -u
# Stage 1's PATH is the initramfs's /bin; a root whose /bin is not /usr/bin (the arm64 tree is
# not usr-merged) needs the rest.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
. /.vm-test/plan.sh

results=$VM_RESULTS
# Held open for the whole run: a virtio console resets its terminal settings whenever its last
# user closes it.
exec 3>"$results"
say() { echo "@@vm-test $*" >&3; }
# Power off now: the host reads the reason on the results port instead of waiting for its
# timeout. If even that fails, PID 1 exits, the kernel panics and panic=-1 with -no-reboot ends
# qemu.
fatal() {
    echo "stage 2: $*"
    say "fatal stage 2: $*"
    exec /bin/busybox poweroff -f
}
now_ms() { echo $(($(date +%s%N) / 1000000)); }

mount -t proc proc /proc || fatal "mounting /proc"
mkdir -p "/lib/modules/$(uname -r)" || fatal "creating /lib/modules/$(uname -r)"
mount --bind "$VM_KERNEL_MODULES" "/lib/modules/$(uname -r)" \
    || fatal "binding the kernel's modules from $VM_KERNEL_MODULES"
mount --bind "$VM_SNAPSHOT" "$VM_PROFILE_DIR" \
    || fatal "binding the snapshot $VM_SNAPSHOT over $VM_PROFILE_DIR"
# The results port carries the tests' output as is: no \r added, nothing echoed back.
stty -F "$results" raw -echo || fatal "setting up $results"
# The systemd and node boots prepare a node and hand PID 1 to systemd instead (systemd-boot.sh
# and node-boot.sh mount nothing more: systemd mounts its API file systems itself).
case "${VM_MODE:-tests}" in
    systemd)
        . /.vm-test/systemd-boot.sh
        fatal "systemd-boot.sh returned"
        ;;
    node)
        . /.vm-test/node-boot.sh
        fatal "node-boot.sh returned"
        ;;
esac
mount -t sysfs sysfs /sys || fatal "mounting /sys"
# A pure cgroup v2 hierarchy, as on a current node (the tests find it in mountinfo).
mount -t cgroup2 cgroup2 /sys/fs/cgroup || fatal "mounting cgroup2"
mount -t bpf bpf /sys/fs/bpf || fatal "mounting bpffs"
mount -t tmpfs -o mode=0755 tmpfs /run || fatal "mounting /run"
# Pseudo-terminals, for the tests of what a terminal shows (`redirector top`).
mkdir -p /dev/pts && mount -t devpts -o ptmxmode=0666 devpts /dev/pts || fatal "mounting devpts"
echo /sbin/modprobe > /proc/sys/kernel/modprobe || fatal "setting the modprobe path"
echo vm-test > /proc/sys/kernel/hostname
ip link set lo up || fatal "bringing lo up"
cd "$VM_WORKDIR" || fatal "entering $VM_WORKDIR"

say "ready kernel=$(uname -r)"
started=$(now_ms)
failed=0
for index in "${!VM_TEST_NAMES[@]}"; do
    name=${VM_TEST_NAMES[$index]}
    binary=${VM_TEST_BINS[$index]}
    say "begin $name"
    begin=$(now_ms)
    # A clean environment like a CI job's, with the tests' waits stretched to TCG's pace; the
    # test binary's limit lets the other binaries run when one hangs (the host's hard timeout
    # still bounds the whole boot).
    # timeout puts the binary in a process group of its own. Were timeout a child of PID 1, that
    # group would be orphaned (init is no connection to a session), and the kernel sends SIGHUP,
    # then SIGCONT, to an orphaned group holding a stopped process whenever a member whose parent
    # is outside it exits (kernel/exit.c, kill_orphaned_pgrp): a test that stops its cache with
    # SIGSTOP while a helper's orphan (reparented to PID 1) exits took the SIGHUP (exit code 129).
    # The subshell, which waits for timeout instead of becoming it, is the group's connection.
    (
        timeout --kill-after=10 "$VM_BINARY_TIMEOUT" \
            env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
            LANG=C.UTF-8 REDIRECTOR_BIN="$VM_REDIRECTOR_BIN" \
            REDIRECTOR_TEST_SLOWDOWN="$VM_SLOWDOWN" \
            "$binary" "${VM_TEST_ARGS[@]}" ${VM_TEST_FILTERS[$index]} < /dev/null >&3 2>&1
        exit $?
    )
    code=$?
    [ "$code" -eq 0 ] || failed=$((failed + 1))
    say "end $name exit=$code ms=$(($(now_ms) - begin))"
done
say "done binaries=${#VM_TEST_NAMES[@]} failed=$failed ms=$(($(now_ms) - started))"
sync
exec /bin/busybox poweroff -f
