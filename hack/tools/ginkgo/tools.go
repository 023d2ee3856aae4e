//go:build tools

// Package tools pins the ginkgo CLI at the version Kubernetes' e2e.test is built with, which
// runs e2e.test's specs in parallel processes (make conformance PROCS=n).
package tools

import (
	_ "github.com/onsi/ginkgo/v2/ginkgo"
)
