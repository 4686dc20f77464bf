// etcd for gpuflow's test cluster: upstream's own server entry point, built from the
// Go module proxy (go install refuses etcd's server module: its go.mod has replaces).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
