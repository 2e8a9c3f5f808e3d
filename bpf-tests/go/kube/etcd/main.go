// etcd for the tests' API server: the etcd binary's own entry point, from etcd's server module.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
