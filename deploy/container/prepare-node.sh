#!/bin/sh
# prepare-node: the DaemonSet's init container (deploy/kubernetes/base/daemonset.yaml), installed
# in the image as /usr/local/bin/prepare-node. It readies the node for the agent's container and
# exits; docs/operations.md ("Privileges") weighs what it is granted.
#
#  1. A bpf filesystem at the host's /sys/fs/bpf, where the pins must live to outlive the pod.
#     Where systemd mounted one at boot this only says so. When there is none, it
#     mounts one in the HOST's mount namespace, entered through the host's /proc (the volume is
#     HostToContainer, so the agent's container then sees it).
#  2. The agent's seccomp profile, where the kubelet looks for `Localhost` profiles (the host's
#     /var/lib/kubelet/seccomp, mounted at /host/seccomp). The kubelet reads it when it creates
#     the agent's container, which is after this container has exited.
set -eu

# The host's /proc (the DaemonSet mounts it there). Another path only for the tests, which give
# the container a PID namespace of their own whose PID 1 stands for the node's.
host_proc=${HOST_PROC:-/host/proc}

if [ "$(stat -f -c %T /sys/fs/bpf)" = bpf_fs ]; then
    echo "a bpf filesystem is mounted at /sys/fs/bpf"
else
    echo "no bpf filesystem at /sys/fs/bpf: mounting one in the node's mount namespace"
    # mode=0700, as systemd mounts it: only root may pin or open pins.
    nsenter --mount="$host_proc/1/ns/mnt" -- mount -t bpf -o mode=0700 bpffs /sys/fs/bpf
    echo "mounted a bpf filesystem at the node's /sys/fs/bpf"
fi

# Written beside, then renamed: the kubelet never reads half a profile.
profile=/host/seccomp/redirector.json
cp /usr/share/redirector/seccomp.json "$profile.new"
chmod 0644 "$profile.new"
mv -f "$profile.new" "$profile"
echo "installed the agent's seccomp profile as $profile"
