{{/*
Names are fixed, not derived from the release's name: they are the overlay's, and one agent runs
per node (it takes the node's lock), so a second release in a cluster has nothing to add.
*/}}

{{/*
The labels of every object: the overlay's, and Helm's own two (the test of the chart ignores
those two, and only those).
*/}}
{{- define "redirector.labels" -}}
app.kubernetes.io/name: redirector
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The agent pods' labels, also the DaemonSet's selector (which cannot change). */}}
{{- define "redirector.selectorLabels" -}}
app.kubernetes.io/name: redirector
app.kubernetes.io/component: agent
{{- end }}

{{- define "redirector.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The kube-dns Service as config.toml names it: NAMESPACE/NAME. */}}
{{- define "redirector.kubeDns" -}}
{{ .Values.kubeDns.namespace }}/{{ .Values.kubeDns.name }}
{{- end }}

{{/* An address and port 53, IPv6 in brackets. */}}
{{- define "redirector.port53" -}}
{{- if contains ":" . }}[{{ . }}]:53{{ else }}{{ . }}:53{{ end }}
{{- end }}

{{- define "redirector.checkLayout" -}}
{{- if not (has .Values.layout (list "aks" "nodeLocalDNSCache")) }}
{{- fail (printf "layout %q: choose aks or nodeLocalDNSCache" .Values.layout) }}
{{- end }}
{{- end }}

{{/*
The agent's config.toml: `config` when given, else the layout's. The aks layout's text is
deploy/kubernetes/base/config.toml, byte for byte with the default values (the ConfigMap's name
is a hash of it).
*/}}
{{- define "redirector.config" -}}
{{- include "redirector.checkLayout" . }}
{{- if .Values.config }}
{{- .Values.config }}
{{- else if eq .Values.layout "aks" }}
{{- include "redirector.config.aks" . }}
{{- else }}
{{- include "redirector.config.nodeLocalDNSCache" . }}
{{- end }}
{{- end }}

{{- define "redirector.config.aks" -}}
# The agent's configuration in the pod (docs/configuration.md), for the AKS LocalDNS layout:
# listeners {{ .Values.aks.nodeListener }} (node) and {{ .Values.aks.clusterListener }} (cluster). deploy/examples/ has this layout
# for a node install and the NodeLocal DNSCache layout.
#
# kustomization.yaml generates the ConfigMap from this file, named redirector-config-<hash of
# its content>, and names that in the DaemonSet: a changed configuration is a changed pod
# template, rolled out one node at a time like an image (see daemonset.yaml's update strategy),
# never picked up at once by every pod that happens to restart. Replace it in an overlay with a
# configMapGenerator of the same name and `behavior: replace`. Validate a change before applying
# it: `redirector check-config --config config.toml`.

# In the pod: cgroup, pin_dir and lock_file keep their defaults, which are the host paths
# mounted by daemonset.yaml (/sys/fs/cgroup, /sys/fs/bpf, /run/redirector). cache_netns stays
# unset: the pod uses the host network namespace, where the cache binds.

[metrics]
# All addresses, not the default loopback: kubelet's probes and Prometheus reach a
# hostNetwork pod at the node's address. The endpoint is read-only (counters, routes, pool
# addresses); restrict port {{ .Values.metrics.port }} at the node firewall if that matters in your network.
# Must match the `metrics` containerPort of daemonset.yaml.
address = "0.0.0.0:{{ .Values.metrics.port }}"

# [kubernetes]: in-cluster credentials (the ServiceAccount token); no kubeconfig.

[[listener]]
name = "node"
address = "{{ .Values.aks.nodeListener }}"
# The node's upstream resolvers, from systemd-resolved's file (mounted read-only).
resolv_conf = "/run/systemd/resolve/resolv.conf"
empty_pool = "fail"

[[listener]]
name = "cluster"
address = "{{ .Values.aks.clusterListener }}"
# The ready kube-dns pods, from the Service's EndpointSlices (role.yaml allows the watch).
kube_dns = "{{ include "redirector.kubeDns" . }}"
empty_pool = "fail"
{{ end }}

{{- define "redirector.config.nodeLocalDNSCache" -}}
{{- $listener := .Values.nodeLocalDNSCache.listener }}
{{- $clusterIP := required "layout nodeLocalDNSCache needs nodeLocalDNSCache.clusterIP, the kube-dns Service's ClusterIP: kubectl -n kube-system get service kube-dns -o jsonpath='{.spec.clusterIP}'" .Values.nodeLocalDNSCache.clusterIP -}}
# The agent's configuration in the pod (docs/configuration.md), for the NodeLocal DNSCache
# layout: listeners {{ $listener }} (local) and {{ $clusterIP }}, the kube-dns ClusterIP
# (cluster-ip), both served by node-local-dns's cache on {{ include "redirector.port53" $listener }}.
# deploy/examples/nodelocal-dnscache.toml has this layout for a node install.
#
# The Helm chart (deploy/helm/redirector, layout nodeLocalDNSCache) renders this text into a
# ConfigMap named redirector-config-<hash of its content>, and names that in the DaemonSet: a
# changed configuration is a changed pod template, rolled out one node at a time like an image.
# Validate a change before applying it: `redirector check-config --config config.toml`.

# In the pod: cgroup, pin_dir and lock_file keep their defaults, which are the host paths
# mounted by the DaemonSet (/sys/fs/cgroup, /sys/fs/bpf, /run/redirector). cache_netns stays
# unset: the pod uses the host network namespace, where node-local-dns (host network) binds.

[metrics]
# All addresses, not the default loopback: kubelet's probes and Prometheus reach a
# hostNetwork pod at the node's address. Must match the `metrics` containerPort.
address = "0.0.0.0:{{ .Values.metrics.port }}"

# [kubernetes]: in-cluster credentials (the ServiceAccount token); no kubeconfig.

[interface]
# node-local-dns owns the addresses on its own interface (nodelocaldns): the agent must not add
# them to a link of its own (two links with one local address), nor remove them on uninstall.
manage = false

[[listener]]
name = "local"
address = "{{ $listener }}"
# cache: the default, the listener address itself, port 53.
# The ready kube-dns pods, from the Service's EndpointSlices.
kube_dns = "{{ include "redirector.kubeDns" . }}"
empty_pool = "fail"

[[listener]]
name = "cluster-ip"
# The kube-dns ClusterIP, intercepted: the programs rewrite it before kube-proxy (or any
# packet-level service translation) sees a packet, so the cache, not kube-proxy, gets the query.
address = "{{ $clusterIP }}"
cache = "{{ include "redirector.port53" $listener }}"
kube_dns = "{{ include "redirector.kubeDns" . }}"
# Cache down and no ready kube-dns endpoint: fail at once. "pass" would send the query to the
# ClusterIP untouched and untracked, which kube-proxy does not translate: the client would time
# out.
empty_pool = "fail"
# Loop avoidance: the stock NodeLocal DNSCache manifest forwards the cache's cluster.local
# queries to the ClusterIP of a second Service, kube-dns-upstream, which is no listener, so
# redirector never touches them. Keep it that way (deploy/examples/nodelocal-dnscache.toml).
{{ end }}

{{/*
The ConfigMap's name: redirector-config-<hash>, the hash kustomize's configMapGenerator gives the
base's ConfigMap (sigs.k8s.io/kustomize/api/hasher): SHA-256 of the JSON of kind, name and data,
its first 10 hex digits with 0, 1, 3, a and e spelled g, h, k, m and t. kustomize's encoder looks
the name up under the path "metadata/name" as one key, finds none and hashes an empty name: so
does this. A changed configuration is a new name, so a changed pod template rolled out node by
node, as with the overlay.
*/}}
{{- define "redirector.configMapName" -}}
{{- $encoded := dict "kind" "ConfigMap" "name" "" "data" (dict "config.toml" (include "redirector.config" .)) | toJson }}
{{- $hash := sha256sum $encoded | trunc 10 | replace "0" "g" | replace "1" "h" | replace "3" "k" | replace "a" "m" | replace "e" "t" }}
{{- printf "redirector-config-%s" $hash }}
{{- end }}
