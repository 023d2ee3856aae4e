//go:build tools

// Package tools pins CoreDNS, the guest clusters' DNS (kubeadm's addon), at the version the
// pinned kubeadm deploys.
package tools

import _ "github.com/coredns/coredns"
