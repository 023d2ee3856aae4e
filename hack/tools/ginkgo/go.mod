// Tool module: builds the ginkgo CLI at the version k8s.io/kubernetes pins (hack/tools/kubernetes-e2e).
module pvbridge.io/hack/tools/ginkgo

go 1.26.0

require github.com/onsi/ginkgo/v2 v2.32.0

require (
	github.com/Masterminds/semver/v3 v3.4.0 // indirect
	github.com/go-task/slim-sprig/v3 v3.0.0 // indirect
	github.com/google/pprof v0.0.0-20260402051712-545e8a4df936 // indirect
	golang.org/x/mod v0.35.0 // indirect
	golang.org/x/sync v0.20.0 // indirect
	golang.org/x/tools v0.44.0 // indirect
)
