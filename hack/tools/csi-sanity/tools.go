//go:build tools

// Package tools pins csi-sanity.
package tools

import (
	_ "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity"
)
