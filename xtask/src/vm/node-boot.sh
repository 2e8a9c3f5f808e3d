# Stage 2 of the node boot (VM_MODE=node), sourced by stage2.sh like systemd-boot.sh: the guest
# becomes a Kubernetes node, registered to the control plane the host runs (bpf-tests' node-host,
# bpf_tests::node), and execs systemd. Its units:
#   vm-node.service          the network (qemu's user network: 10.0.2.15, the API server at
#                            10.0.2.100, which qemu forwards to the host's loopback and lets
#                            the guest reach nothing else), the stand-in upstream's address,
#                            the node's disk (below), node-local-dns's address on a dummy link
#                            `nodelocaldns` (what node-cache sets up before CoreDNS serves; the
#                            image runs CoreDNS itself), and the stand-in for kube-proxy: one
#                            nftables rule that sends the `kubernetes` Service's address to the
#                            API server;
#   vm-upstream.service      the stand-in upstream DNS server (dns-server on 10.53.0.1), which
#                            node-local-dns forwards to and the kube-dns EndpointSlice names;
#   containerd.service       containerd 2 (built by `cargo xtask setup`) with runc and the CNI
#                            plugins (Debian's), the systemd cgroup driver;
#   vm-node-images.service   the node's images, imported from the host's archive before the
#                            kubelet starts, once: a reboot finds them on the disk;
#   kubelet.service          the kubelet (built from the pinned k8s.io/kubernetes), cgroup v2
#                            with the systemd cgroup driver, clusterDNS 169.254.20.10;
#   vm-test.service          the node test binary, then poweroff, or a reboot when the test
#                            asks for one (guest-systemd.sh).
# The node's disk (a virtio disk the host made, ext4) holds what a node keeps across a reboot:
# containerd's and the kubelet's state, the CNI's leases and the pods' logs; the rest of the
# guest, /run and the bpf file system with it, starts afresh at every boot, as on a node. The
# host boots the node again with the same disk when its test asks for a reboot (qemu runs with
# -no-reboot: the guest's `systemctl reboot` ends qemu).
# Nothing is installed for redirector or node-local-dns: the test installs them as users do.
. /.vm-test/guest-systemd.sh
guest_without_host_boot "$VM_NODE_NAME"

go_bin=$VM_WORKSPACE/target/go/bin
[ -n "${VM_GO_BIN:-}" ] && go_bin=$VM_GO_BIN
for program in containerd containerd-shim-runc-v2 ctr kubelet kubectl; do
    [ -x "$go_bin/$program" ] || fatal "$go_bin/$program is missing: run cargo xtask setup"
done
install -d /usr/local/bin || fatal "creating /usr/local/bin"
ln -sf "$go_bin/containerd" "$go_bin/containerd-shim-runc-v2" "$go_bin/ctr" "$go_bin/kubelet" \
    "$go_bin/kubectl" /usr/local/bin/ || fatal "linking the node's programs"
# redirector's CLI where an operator has it on the node (`redirector status`, `top`); the agent
# itself is the DaemonSet's.
install -m 0755 "$VM_REDIRECTOR_BIN" /usr/local/bin/redirector || fatal "installing redirector"
dns_server="$VM_PROFILE_DIR/dns-server"

cat > /etc/systemd/system/vm-node.service <<EOF || fatal "writing vm-node.service"
[Unit]
Description=vm-test: the node's network, addresses and state
DefaultDependencies=no
After=systemd-modules-load.service
Before=network-online.target containerd.service kubelet.service
Wants=network-online.target
[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/sbin/modprobe -a virtio_net virtio_blk ext4 overlay bridge veth dummy
ExecStart=/sbin/ip link set lo up
ExecStart=/sbin/ip address add 10.53.0.1/32 dev lo
ExecStart=/sbin/ip link add nodelocaldns type dummy
ExecStart=/sbin/ip address add 169.254.20.10/32 dev nodelocaldns
ExecStart=/bin/bash /etc/vm-node/network.sh
ExecStart=/bin/bash /etc/vm-node/disk.sh
ExecStart=/usr/sbin/nft -f /etc/vm-node/kube-proxy.nft
ExecStart=/bin/mkdir -p /run/systemd/resolve
ExecStart=/bin/sh -c 'echo nameserver 10.53.0.1 > /run/systemd/resolve/resolv.conf'
[Install]
WantedBy=multi-user.target
EOF
install -d /etc/vm-node /var/lib/containerd /etc/containerd /etc/cni/net.d /etc/kubernetes \
    /etc/systemd/system.conf.d || fatal "creating the node's folders"
# A reboot stops every unit (the pods' scopes too) before the kernel goes: none may hold it for
# systemd's default 90 s.
printf '[Manager]\nDefaultTimeoutStopSec=20s\n' > /etc/systemd/system.conf.d/vm-node.conf \
    || fatal "writing the node's systemd settings"
# The node's disk (/dev/vda, the only one), and what lives on it at the paths a node has it.
cat > /etc/vm-node/disk.sh <<'EOF' || fatal "writing the disk script"
set -eu
for try in $(seq 100); do
    [ -b /dev/vda ] && break
    sleep 0.1
done
[ -b /dev/vda ] || { echo "the node's disk /dev/vda did not appear" >&2; exit 1; }
install -d /var/lib/vm-node
# noinit_itable: the kernel would zero the inode tables the host left uninitialized through
# TCG's slow disk, in the background, at every boot.
mount -o noinit_itable /dev/vda /var/lib/vm-node
for dir in /var/lib/containerd /var/lib/kubelet /var/lib/cni /var/log/pods /var/log/containers; do
    kept=/var/lib/vm-node/$(echo "${dir#/var/}" | tr / -)
    install -d "$kept" "$dir"
    mount --bind "$kept" "$dir"
done
EOF
# The guest's one network device, whatever udev named it.
cat > /etc/vm-node/network.sh <<'EOF' || fatal "writing the network script"
set -eu
for try in $(seq 100); do
    for device in /sys/class/net/*/device; do
        [ -e "$device" ] || continue
        link=$(basename "$(dirname "$device")")
        ip link set "$link" up
        ip address add 10.0.2.15/24 dev "$link"
        ip route add default via 10.0.2.2
        exit 0
    done
    sleep 0.1
done
echo "no network device appeared" >&2
exit 1
EOF
# The `kubernetes` Service (its first address) to the API server's endpoint, as kube-proxy
# would: the agent's pod reaches the API server by KUBERNETES_SERVICE_HOST.
cat > /etc/vm-node/kube-proxy.nft <<EOF || fatal "writing the kube-proxy stand-in"
table ip vm-kube-proxy {
    chain output {
        type nat hook output priority -100; policy accept;
        ip daddr 10.96.0.1 tcp dport 443 dnat to 10.0.2.100:$VM_NODE_API_PORT
    }
    chain prerouting {
        type nat hook prerouting priority -100; policy accept;
        ip daddr 10.96.0.1 tcp dport 443 dnat to 10.0.2.100:$VM_NODE_API_PORT
    }
}
EOF
cat > /etc/systemd/system/vm-upstream.service <<EOF || fatal "writing vm-upstream.service"
[Unit]
Description=vm-test: the stand-in upstream DNS server
Requires=vm-node.service
After=vm-node.service
[Service]
ExecStart=$dns_server --listen 10.53.0.1:53 --a 192.0.2.1 --aaaa 2001:db8::1
[Install]
WantedBy=multi-user.target
EOF

cat > /etc/containerd/config.toml <<EOF || fatal "writing containerd's configuration"
version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "localhost/pause:node"
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = "/usr/sbin/runc"
  SystemdCgroup = true
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ["/usr/lib/cni"]
  conf_dir = "/etc/cni/net.d"
EOF
cat > /etc/cni/net.d/10-node.conflist <<EOF || fatal "writing the CNI configuration"
{
  "cniVersion": "1.0.0",
  "name": "node",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "10.244.0.0/24"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    }
  ]
}
EOF
cat > /etc/systemd/system/containerd.service <<EOF || fatal "writing containerd.service"
[Unit]
Description=vm-test: containerd
Requires=vm-node.service
After=vm-node.service
[Service]
Environment=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ExecStart=/usr/local/bin/containerd --config /etc/containerd/config.toml
Type=simple
Delegate=yes
KillMode=process
Restart=always
LimitNOFILE=infinity
TasksMax=infinity
OOMScoreAdjust=-999
[Install]
WantedBy=multi-user.target
EOF
cat > /etc/systemd/system/vm-node-images.service <<EOF || fatal "writing vm-node-images.service"
[Unit]
Description=vm-test: the node's images, imported before the kubelet starts (never pulled)
Requires=containerd.service
After=containerd.service
[Service]
Type=oneshot
RemainAfterExit=yes
# Unpacking a few hundred MB under TCG takes minutes.
TimeoutStartSec=infinity
Environment=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ExecStart=/bin/sh -c '[ -e /var/lib/containerd/vm-node-imported ] && exit 0; for i in \$(seq 600); do ctr version >/dev/null 2>&1 && break; sleep 0.2; done; ctr --namespace k8s.io images import $VM_NODE_DIR/images.tar && touch /var/lib/containerd/vm-node-imported'
[Install]
WantedBy=multi-user.target
EOF
cat > /etc/kubernetes/kubelet.yaml <<EOF || fatal "writing the kubelet's configuration"
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: systemd
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
clusterDNS: ["169.254.20.10"]
clusterDomain: cluster.local
resolvConf: /run/systemd/resolve/resolv.conf
failSwapOn: false
serializeImagePulls: false
# The node's file systems are the guest's memory: no eviction, no image garbage collection.
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "0%"
  imagefs.available: "0%"
imageGCHighThresholdPercent: 100
EOF
cat > /etc/systemd/system/kubelet.service <<EOF || fatal "writing kubelet.service"
[Unit]
Description=vm-test: the kubelet
Wants=containerd.service vm-node-images.service
After=containerd.service vm-node-images.service
[Service]
Environment=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ExecStart=/usr/local/bin/kubelet --config=/etc/kubernetes/kubelet.yaml --kubeconfig=$VM_NODE_DIR/guest.kubeconfig --hostname-override=$VM_NODE_NAME --node-ip=10.0.2.15
Restart=always
RestartSec=2
[Install]
WantedBy=multi-user.target
EOF

guest_test_unit "REDIRECTOR_NODE_DIR=$VM_NODE_DIR" vm-node.service containerd.service \
    vm-node-images.service kubelet.service
guest_exec_systemd vm-node.service vm-upstream.service containerd.service vm-node-images.service \
    kubelet.service
