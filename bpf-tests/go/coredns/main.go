// CoreDNS as the node caches run it: the plugins NodeLocal DNSCache's node-cache registers
// (k8s.io/dns cmd/node-cache: bind, cache, debug, errors, forward, health, hosts, loadbalance,
// log, loop, metrics, pprof, reload, rewrite, template, whoami; not its trace, whose tracing
// clients are most of a full build's time and which no Corefile here uses) and those AKS
// LocalDNS's Corefile and the tests add (ready, nsid, multisocket). The directive order is
// CoreDNS's own (core/dnsserver), as in node-cache, which does not change it either.
package main

import (
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/debug"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/hosts"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/multisocket"
	_ "github.com/coredns/coredns/plugin/nsid"
	_ "github.com/coredns/coredns/plugin/pprof"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
	_ "github.com/coredns/coredns/plugin/rewrite"
	_ "github.com/coredns/coredns/plugin/template"
	_ "github.com/coredns/coredns/plugin/whoami"
)

func main() {
	coremain.Run()
}
