// Command registry is the distribution registry with the storage drivers the lab uses
// (filesystem, in memory) only: the upstream binary links the cloud storage drivers too
// (S3, Azure, GCS), most of its build.
package main

import (
	"os"

	"github.com/distribution/distribution/v3/registry"
	_ "github.com/distribution/distribution/v3/registry/storage/driver/filesystem"
	_ "github.com/distribution/distribution/v3/registry/storage/driver/inmemory"
)

func main() {
	if err := registry.RootCmd.Execute(); err != nil {
		os.Exit(1)
	}
}
