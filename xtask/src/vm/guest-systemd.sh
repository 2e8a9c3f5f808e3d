# What the two boots with systemd as PID 1 share (sourced by systemd-boot.sh and node-boot.sh,
# which stage2.sh sources; `say` and `fatal` are stage2.sh's).
#
# guest_without_host_boot NAME: the guest boots systemd's own units and the boot's, nothing of
# the host's: no file systems to wait for, no services it enabled; its hostname NAME.
guest_without_host_boot() {
    # The host may be a container (this machine kind has /.dockerenv): its marker files would
    # have the guest's systemd believe it runs in one, and skip what it does on a machine (make
    # the mount tree shared, as containerd requires of the host paths a pod mounts with
    # HostToContainer propagation).
    rm -f /.dockerenv /run/.containerenv || fatal "removing the host's container markers"
    : > /etc/fstab || fatal "emptying /etc/fstab"
    find /etc/systemd/system -mindepth 2 -maxdepth 2 -path '*.wants/*' -delete \
        || fatal "disabling the host's units"
    rm -f /etc/systemd/system/default.target
    # No login on the serial console: its getty waits for dev-ttyS0.device, which this guest's
    # udev never announces, and held multi-user.target (so the tests) for the job's 90 s timeout
    # at every boot.
    ln -sf /dev/null /etc/systemd/system/serial-getty@ttyS0.service \
        || fatal "masking the serial console's getty"
    # The host's /tmp (tens of thousands of files) stays as it is: systemd-tmpfiles would walk
    # all of it at boot to empty it, and virtiofsd holds a descriptor for every file the guest
    # looks up (it has 20000 here: root there lacks CAP_SYS_RESOURCE to raise the limit), so
    # exec(2) would then fail with EMFILE for the rest of the boot.
    install -d /etc/systemd/system/systemd-tmpfiles-setup.service.d || fatal "creating a drop-in"
    cat > /etc/systemd/system/systemd-tmpfiles-setup.service.d/vm-test.conf <<EOF \
        || fatal "writing the tmpfiles drop-in"
[Service]
ExecStart=
ExecStart=systemd-tmpfiles --create --remove --boot --exclude-prefix=/dev --exclude-prefix=/tmp --exclude-prefix=/var/tmp
EOF
    echo "$1" > /etc/hostname
}

# guest_test_unit ENV UNIT...: vm-test.service, after multi-user.target: the boot's test
# binaries one after the other (each takes the node from where the last left it), with their
# output on the results port, then poweroff; or, when a test asked for it by leaving
# /run/vm-test-reboot (bpf_tests::vm_notes::ask_reboot), a reboot as an operator's: `systemctl
# reboot`, which stops every unit, and `@@vm-test reboot` first, so that the host boots the node
# again (qemu ends at the reset). ENV: more of the tests' environment (NAME=VALUE
# words); the UNITs' status and the agent's journal go to the console first, for the log when a
# test fails.
guest_test_unit() {
    local environment=$1
    shift
    cat > /etc/systemd/system/vm-test.service <<EOF || fatal "writing vm-test.service"
[Unit]
Description=vm-test: the boot's tests, then poweroff
DefaultDependencies=no
After=multi-user.target
[Service]
Type=oneshot
ExecStart=/bin/bash /.vm-test/systemd-tests.sh
[Install]
WantedBy=multi-user.target
EOF
    cat > /.vm-test/systemd-tests.sh <<EOF || fatal "writing the test runner"
#!/bin/bash
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
. /.vm-test/plan.sh
units="$*"
environment="$environment"
EOF
    cat >> /.vm-test/systemd-tests.sh <<'EOF' || fatal "writing the test runner"
results=/dev/ttyS1
say() { echo "@@vm-test $*" > "$results"; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }
say "ready kernel=$(uname -r)"
systemctl status --no-pager $units > /dev/ttyS0 2>&1
journalctl --boot --no-pager --unit redirector.service > /dev/ttyS0 2>&1
started=$(now_ms)
failed=0
for index in "${!VM_TEST_NAMES[@]}"; do
    name=${VM_TEST_NAMES[$index]}
    say "begin $name"
    begin=$(now_ms)
    timeout --kill-after=10 "$VM_BINARY_TIMEOUT" \
        env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
        LANG=C.UTF-8 REDIRECTOR_BIN=/usr/local/bin/redirector \
        REDIRECTOR_TEST_SLOWDOWN="$VM_SLOWDOWN" $environment \
        "${VM_TEST_BINS[$index]}" "${VM_TEST_ARGS[@]}" < /dev/null > "$results" 2>&1
    code=$?
    [ "$code" -eq 0 ] || failed=$((failed + 1))
    say "end $name exit=$code ms=$(($(now_ms) - begin))"
done
# What the tests measured, one line each, for the report.
if [ -r /run/vm-test-notes ]; then
    while read -r note; do say "note $note"; done < /run/vm-test-notes
fi
say "done binaries=${#VM_TEST_NAMES[@]} failed=$failed ms=$(($(now_ms) - started))"
sync
if [ "$failed" -eq 0 ] && [ -e /run/vm-test-reboot ]; then
    say "reboot"
    exec systemctl reboot --no-block
fi
/bin/busybox poweroff -f
EOF
}

# guest_exec_systemd UNIT...: enables the UNITs and vm-test.service, and hands PID 1 to systemd.
guest_exec_systemd() {
    systemctl --root=/ enable "$@" vm-test.service > /dev/null 2>&1 \
        || fatal "enabling the units"
    systemctl --root=/ set-default multi-user.target > /dev/null 2>&1 \
        || fatal "setting the default target"
    cd / || fatal "entering /"
    umount /proc || fatal "unmounting /proc"
    exec /lib/systemd/systemd
    fatal "exec of systemd failed"
}
