//go:build tools

// Package tools pins Cluster API: clusterctl, the core manager and the kubeadm bootstrap and
// control plane providers, all of one release (one root module).
package tools

import (
	_ "sigs.k8s.io/cluster-api/bootstrap/kubeadm"
	_ "sigs.k8s.io/cluster-api/cmd/clusterctl"
	_ "sigs.k8s.io/cluster-api/controlplane/kubeadm"
	_ "sigs.k8s.io/cluster-api/core"
)
