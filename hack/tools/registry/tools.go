//go:build tools

// Package tools pins the distribution registry (CNCF Distribution, the registry Docker Hub's
// is built on): the lab's image registry, which its VMs pull from and its users push to.
package tools

import _ "github.com/distribution/distribution/v3/cmd/registry"
