#!/bin/bash
# The systemd boot's stand-in kubelet (kubelet.service, systemd-boot.sh): what a kubelet does
# first that matters here. It makes a pod's network namespace behind a veth, as a CNI plugin
# would, and sends the pod's first DNS query to the node listener at once, recording where the
# answer came from in /run/kubelet-first-query.json (dns-query's outcome). redirector.service
# is ordered before this unit (Before=kubelet.service): the query must be steered from the
# start.
set -eu
dns_query=$1
ip netns add pod
ip link add vm-pod0 type veth peer name eth0 netns pod
ip address add 10.200.0.1/24 dev vm-pod0
ip link set vm-pod0 up
ip -n pod link set lo up
ip -n pod address add 10.200.0.2/24 dev eth0
ip -n pod link set eth0 up
ip -n pod route add default via 10.200.0.1
ip netns exec pod "$dns_query" --server 169.254.10.10:53 --transport udp --timeout-ms 3000 \
    > /run/kubelet-first-query.json
