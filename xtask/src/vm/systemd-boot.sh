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
. /.vm-test/guest-systemd.sh
guest_without_host_boot vm-systemd

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
guest_test_unit "" redirector.service node-local-dns.service kubelet.service
guest_exec_systemd redirector.service vm-addresses.service node-local-dns.service \
    vm-upstream.service kubelet.service
