// Command etcd runs go.etcd.io/etcd/server/v3's etcdmain, as etcd's own main does: etcd's
// main package lives in a module that replaces its siblings by path, which a dependency
// cannot do, so tests/stack/build.sh builds this one-line main in a wrapper module.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
