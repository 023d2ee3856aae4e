//go:build tools

// Package tools pins csi-resizer.
package tools

import (
	_ "github.com/kubernetes-csi/external-resizer/v2/cmd/csi-resizer"
)
