# Stage 2 of the systemd boot (VM_MODE=systemd), sourced by stage2.sh on the overlay of the
# host's root once /proc, the kernel's modules, the snapshot and the results port are set up (its
# `say` and `fatal` are stage2.sh's): it turns the guest into a node that boots with systemd as
# PID 1, and execs systemd.
#
# Why the host's root and not a debootstrapped one: the guest then runs the very systemd (252),
# nft, ip and libc the host tests use, costs no download or build, and writes only to its
# overlay. What the host has enabled is switched off in the overlay (its units' symlinks, its
# fstab), so the boot is systemd's own units plus these:
#   redirector.service      deploy/systemd/redirector.service as shipped (and the
#                           redirector-bpffs.service it requires), enabled by its [Install] section,
#                           with /usr/local/bin/redirector and /etc/redirector/config.toml
#                           where the unit expects them;
#   node-local-dns.service  the stand-in cache (dns-server on 10.53.0.10, which the node
#                           listener 169.254.10.10 steers to), ordered after redirector by the
#                           unit's own Before=;
#   vm-upstream.service     the stand-in upstream (dns-server on 10.53.0.1);
#   kubelet.service         the stand-in kubelet, ordered after redirector by the unit's own
#                           Before=: it makes a pod namespace and sends its first DNS query;
#   vm-test.service         after multi-user.target: the systemd_boot test binary, with its
#                           output on the results port, then poweroff.
# Nothing of the host's own boot: no file systems to wait for, no services it enabled.
: > /etc/fstab || fatal "emptying /etc/fstab"
find /etc/systemd/system -mindepth 2 -maxdepth 2 -path '*.wants/*' -delete \
    || fatal "disabling the host's units"
rm -f /etc/systemd/system/default.target
# The host's /tmp (tens of thousands of files) stays as it is: systemd-tmpfiles would walk all of
# it at boot to empty it, and virtiofsd holds a descriptor for every file the guest looks up (it
# has 20000 here: root there lacks CAP_SYS_RESOURCE to raise the limit), so exec(2) would then
# fail with EMFILE for the rest of the boot.
install -d /etc/systemd/system/systemd-tmpfiles-setup.service.d || fatal "creating a drop-in"
cat > /etc/systemd/system/systemd-tmpfiles-setup.service.d/vm-test.conf <<EOF \
    || fatal "writing the tmpfiles drop-in"
[Service]
ExecStart=
ExecStart=systemd-tmpfiles --create --remove --boot --exclude-prefix=/dev --exclude-prefix=/tmp --exclude-prefix=/var/tmp
EOF
echo vm-systemd > /etc/hostname

install -m 0755 "$VM_REDIRECTOR_BIN" /usr/local/bin/redirector || fatal "installing redirector"
install -m 0644 "$VM_WORKSPACE/deploy/systemd/redirector.service" \
    "$VM_WORKSPACE/deploy/systemd/redirector-bpffs.service" /etc/systemd/system/ \
    || fatal "installing the units"
install -d /etc/redirector || fatal "creating /etc/redirector"
cat > /etc/redirector/config.toml <<EOF || fatal "writing the configuration"
# The VM's node: the listener on the agent's dummy link, its cache and upstream on lo.
[[listener]]
name = "node"
address = "169.254.10.10"
cache = "10.53.0.10:53"
upstreams = ["10.53.0.1"]
EOF

dns_server="$VM_PROFILE_DIR/dns-server"
# What /sys/fs/bpf held before redirector-bpffs.service ran (systemd's own mounts are done by
# then): the test reports it, so that what the unit is for is seen, not assumed.
install -d /etc/systemd/system/redirector-bpffs.service.d || fatal "creating a drop-in"
cat > /etc/systemd/system/redirector-bpffs.service.d/vm-test.conf <<'EOF' \
    || fatal "writing the bpffs drop-in"
[Service]
ExecStartPre=/bin/sh -c 'findmnt -n -o FSTYPE /sys/fs/bpf > /run/vm-test-bpffs-before; true'
EOF
cat > /etc/systemd/system/vm-addresses.service <<EOF || fatal "writing vm-addresses.service"
[Unit]
Description=vm-test: the stand-in servers' addresses on lo
DefaultDependencies=no
Before=network-online.target redirector.service
Wants=network-online.target
[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/sbin/ip link set lo up
ExecStart=/sbin/ip address add 10.53.0.1/32 dev lo
ExecStart=/sbin/ip address add 10.53.0.10/32 dev lo
[Install]
WantedBy=multi-user.target
EOF
cat > /etc/systemd/system/node-local-dns.service <<EOF || fatal "writing node-local-dns.service"
[Unit]
Description=vm-test: the stand-in node-local DNS cache
Requires=vm-addresses.service
After=vm-addresses.service
[Service]
ExecStart=$dns_server --listen 10.53.0.10:53 --a 192.0.2.53 --aaaa 2001:db8::53
[Install]
WantedBy=multi-user.target
EOF
cat > /etc/systemd/system/vm-upstream.service <<EOF || fatal "writing vm-upstream.service"
[Unit]
Description=vm-test: the stand-in upstream DNS server
Requires=vm-addresses.service
After=vm-addresses.service
Before=redirector.service
[Service]
ExecStart=$dns_server --listen 10.53.0.1:53 --a 192.0.2.1 --aaaa 2001:db8::1
[Install]
WantedBy=multi-user.target
EOF
cat > /etc/systemd/system/kubelet.service <<EOF || fatal "writing kubelet.service"
[Unit]
Description=vm-test: the stand-in kubelet (a pod namespace and its first DNS query)
[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/bash $VM_WORKSPACE/xtask/src/vm/kubelet-standin.sh $VM_PROFILE_DIR/dns-query
[Install]
WantedBy=multi-user.target
EOF
cat > /etc/systemd/system/vm-test.service <<EOF || fatal "writing vm-test.service"
[Unit]
Description=vm-test: the systemd boot's tests, then poweroff
DefaultDependencies=no
After=multi-user.target
[Service]
Type=oneshot
ExecStart=/bin/bash /.vm-test/systemd-tests.sh
[Install]
WantedBy=multi-user.target
EOF
cat > /.vm-test/systemd-tests.sh <<'EOF' || fatal "writing the test runner"
#!/bin/bash
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
. /.vm-test/plan.sh
results=/dev/ttyS1
say() { echo "@@vm-test $*" > "$results"; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }
say "ready kernel=$(uname -r)"
# What the boot did, for the log when a test fails: the units this boot is about.
systemctl status --no-pager redirector.service node-local-dns.service kubelet.service \
    > /dev/ttyS0 2>&1
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
        REDIRECTOR_TEST_SLOWDOWN="$VM_SLOWDOWN" \
        "${VM_TEST_BINS[$index]}" "${VM_TEST_ARGS[@]}" < /dev/null > "$results" 2>&1
    code=$?
    [ "$code" -eq 0 ] || failed=$((failed + 1))
    say "end $name exit=$code ms=$(($(now_ms) - begin))"
done
# What the tests measured (the boot's timings), one line each, for the report.
if [ -r /run/vm-test-notes ]; then
    while read -r note; do say "note $note"; done < /run/vm-test-notes
fi
say "done binaries=${#VM_TEST_NAMES[@]} failed=$failed ms=$(($(now_ms) - started))"
sync
/bin/busybox poweroff -f
EOF

systemctl --root=/ enable redirector.service vm-addresses.service node-local-dns.service \
    vm-upstream.service kubelet.service vm-test.service > /dev/null 2>&1 \
    || fatal "enabling the units"
systemctl --root=/ set-default multi-user.target > /dev/null 2>&1 \
    || fatal "setting the default target"
cd / || fatal "entering /"
umount /proc || fatal "unmounting /proc"
exec /lib/systemd/systemd
fatal "exec of systemd failed"
