//go:build tools

// Package tools pins csi-attacher.
package tools

import (
	_ "github.com/kubernetes-csi/external-attacher/v4/cmd/csi-attacher"
)
