# pvbridge: a paravirtual CSI bridge for Cluster API guest clusters.
# `make help` lists the targets. Third-party binaries are built once into $(CACHE) (outside the
# repository); pvbridge's own binaries go to ./bin.

SHELL := /usr/bin/env bash -o pipefail
.SHELLFLAGS := -ec
.DEFAULT_GOAL := help

export CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/pvbridge
export PVBRIDGE_CACHE := $(CACHE)
export PVBRIDGE_BIN := $(CACHE)/bin
export PVBRIDGE_ROOT := $(CURDIR)

MODULES := pkg guest-csi mgmt-csi vm-operator e2e
COMPONENTS := pkg guest-csi mgmt-csi vm-operator
# The pinned third-party components (hack/build-tools.sh) the lab runs, and the tests (which
# also run containerd nodes, Kubernetes' storage e2e.test, Cluster API's managers and, for its guests,
# the lab's registry and CoreDNS, Prometheus (the lab's, and promtool on the alert rules) and
# helm, which renders the charts).
LAB_TOOLS := etcd kubernetes csi-provisioner csi-attacher csi-resizer csi-snapshotter
TEST_TOOLS := $(LAB_TOOLS) containerd storage-e2e csi-sanity cluster-api registry coredns prometheus helm
CONTROLLER_GEN := $(PVBRIDGE_BIN)/controller-gen
GOLANGCI_LINT := $(PVBRIDGE_BIN)/golangci-lint
KUBECTL := $(PVBRIDGE_BIN)/kubectl
HELM := $(PVBRIDGE_BIN)/helm
# The end-to-end and integration tests start real clusters; give them room on a loaded 2-core machine.
# The lab suites run side by side (e2e/suite took 869-1341 s beside e2e/containers' lab).
TEST_TIMEOUT ?= 45m
# The end-to-end tests are built as the lab builds the binaries they start (static, -trimpath:
# e2e/images.GoBuild), so that the libraries both import compile once.
E2E_GO_TEST := env CGO_ENABLED=0 go test -trimpath
E2E_PARALLEL ?= 3
# Every go command of the Makefile, and the lab's builds it starts, builds with the flags of the
# pinned tools (hack/goflags: their build tags, no DWARF): the Go build cache keys a package's
# compile by them, and with the same flags client-go, controller-runtime, grpc and the rest
# compiled for the tools serve pvbridge's static builds (the lab's binaries, the end-to-end
# tests, lint) too.
export GOFLAGS := $(shell cat hack/goflags)

##@ Everyday

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*##"; printf "Usage: make <target>\n"} \
		/^[a-zA-Z_-]+:.*?##/ { printf "  \033[36m%-10s\033[0m %s\n", $$1, $$2 } \
		/^##@/ { printf "\n%s\n", substr($$0, 5) }' $(MAKEFILE_LIST)

# RUNTIME=containerd: every node runs containerd, pvbridge installed from the overlays and images;
# capi: the guest made by Cluster API; qemu: that guest with a worker that is a QEMU VM.
RUNTIME ?= process

.PHONY: run
run: deps lab-tools ## Start the lab (management + guest clusters on 127.0.0.1) until Ctrl-C; RUNTIME=containerd for real containers, RUNTIME=capi for a guest made by Cluster API, RUNTIME=qemu for that guest with a worker that is a QEMU VM.
	$(if $(filter containerd capi qemu,$(RUNTIME)),hack/phase.sh tools hack/build-tools.sh containerd prometheus $(if $(filter capi qemu,$(RUNTIME)),cluster-api registry coredns))
	go build -o bin/lab ./e2e/cmd/lab
	bin/lab --runtime=$(RUNTIME)

# What runs beside the end-to-end tests, in the CPU their labs leave idle while they wait on
# controllers: fuzz (make test), or lint and verify (.ci/run, which fuzzes beside the tools'
# build instead, so that lint loads the dependencies the tools and the end-to-end tests have
# compiled).
BESIDE_E2E ?= fuzz

.PHONY: test
test: deps test-tools test-unit test-e2e ## Run every test: unit and integration (-race), end-to-end (csi-sanity among them), fuzz.

# The unit and integration tests, whose test apiservers run the pinned kube-apiserver and etcd
# (UNIT_TOOLS): .ci/run starts them once those are built, beside the rest of the tools' build.
UNIT_TOOLS := etcd kubernetes

.PHONY: test-unit
test-unit: deps
	hack/phase.sh unittool hack/build-tools.sh $(UNIT_TOOLS)
	@# -count=1: the end-to-end tests start binaries built at run time, which the test cache
	@# cannot see change. The end-to-end packages run pvbridge's binaries as processes built
	@# without -race (the unit and integration tests cover that code under -race).
	@# -vet=off: make lint runs go vet's analyzers (golangci-lint's govet) on every package.
	hack/phase.sh unit go test -race -vet=off -count=1 -timeout $(TEST_TIMEOUT) $(COMPONENTS:%=./%/...)

.PHONY: test-e2e
test-e2e: deps test-tools
	@# go test starts test binaries in the order of its arguments on its -p workers
	@# (E2E_PARALLEL, 3: the labs mostly wait, and two at a time left a third of the machine
	@# idle): the longest first (warm, three at a time, seconds: capi 1732 with its QEMU worker,
	@# suite 1303, containers 916, vmoperator 248, cluster 131, sanity 121; the rest under 75),
	@# so that the shorter ones fill whichever worker frees first. $(BESIDE_E2E) runs beside
	@# them (its output follows).
	hack/beside.sh '$(MAKE) --no-print-directory $(BESIDE_E2E)' \
		hack/phase.sh e2e $(E2E_GO_TEST) -p $(E2E_PARALLEL) -vet=off -count=1 -timeout $(TEST_TIMEOUT) \
		./e2e/capi ./e2e/suite ./e2e/containers ./e2e/vmoperator ./e2e/cluster ./e2e/sanity ./e2e/...

.PHONY: capi-e2e
capi-e2e: deps test-tools ## Run every one of Cluster API's own provider specs (e2e/capispecs) on e2e/capi's lab, once its provider is upgraded to this tree's; make test runs those labelled ci (QuickStart). Their log, JUnit report and dumps: _output/capi-e2e.
	cd e2e && PVBRIDGE_CAPI_SPECS=all PVBRIDGE_CAPI_SPECS_DIR=$(CURDIR)/_output/capi-e2e $(E2E_GO_TEST) -v -count=1 -timeout 120m \
		-run '^TestClusterAPIGuest$$/^OnTheGuest$$/^Steps$$/^(StatefulSetKeepsItsData|ClusterctlUpgradesTheProvider|ClusterAPISpecs)$$' ./capi

# Fuzz targets of every parser of tenant-controlled input: <module>:<package>:<target>,<target>...
FUZZ_TARGETS := \
	pkg:./tenancy:FuzzSharedWith \
	guest-csi:./internal/request:FuzzMgmtName,FuzzParseParameters,FuzzValidHandle,FuzzSerialFrom \
	mgmt-csi:./internal/ids:FuzzFor \
	vm-operator:./internal/hypervisor/local:FuzzParseMountInfo,FuzzValidateSerial,FuzzValidateVM
export FUZZ_TIME ?= 10000x

.PHONY: fuzz
fuzz: ## Run each fuzz target for FUZZ_TIME (10000 inputs).
	hack/phase.sh fuzz env $(COMPILE_ENV) hack/fuzz.sh $(FUZZ_TARGETS)

# The environment of builds that only compile (and of the fuzz targets' few seconds of running):
# the garbage collector at 5 times the live heap, as hack/build-tools.sh builds the tools.
COMPILE_ENV := GOGC=400 GOMEMLIMIT=3GiB

# What the unit and end-to-end phases compile, compiled into the build cache without linking or
# running anything: the -race build of every package (as `make test`'s unit phase builds it) and
# the lab's (static, -trimpath, as e2e/images.GoBuild builds it, which is also what lint loads).
# .ci/run does it beside the tools' long lane, so that those phases mostly link and run.
.PHONY: prebuild
prebuild:
	hack/phase.sh prebuild env $(COMPILE_ENV) bash -c 'go build -race $(COMPONENTS:%=./%/...) && CGO_ENABLED=0 go build -trimpath $(MODULES:%=./%/...) && \
		cd e2e/capispecs && GOWORK=off CGO_ENABLED=0 go test -c -trimpath -o /dev/null .'

# The baseline the bench's figures are compared with (e2e/benchcmp): each of its figures is
# printed with its change, and a ratio figure more than 10 % worse as a regression.
BENCH_BASELINE ?= e2e/benchcmp/baseline.txt

.PHONY: bench
bench: deps lab-tools ## Run the benchmarks; each figure prints as `BENCH <name> <value> <unit>`, then its change against BENCH_BASELINE. LABELS picks the suite's benchmarks alone (e.g. LABELS=scale); the apiservers run with their watch cache, as in production (WATCH_CACHE=0: without, as the tests run them).
	@go build -o bin/benchcmp ./e2e/cmd/benchcmp
	@{ $(if $(LABELS),true,for m in $(MODULES); do \
		(cd $$m && go test -run '^$$' -bench . -benchtime 1x -timeout $(TEST_TIMEOUT) ./... | { grep -E '^(BENCH|FAIL|panic|---)' || true; }) || exit 1; \
	done) && \
	cd e2e && $(E2E_GO_TEST) -v -count=1 -timeout 60m ./suite -args -ginkgo.label-filter='bench && ($(or $(LABELS),bench))' $(if $(filter 0,$(WATCH_CACHE)),,-watch-cache) | { grep -E '^(BENCH|FAIL|panic|---|\[FAIL)' || true; }; } | \
		bin/benchcmp -baseline $(BENCH_BASELINE)

.PHONY: soak
soak: deps lab-tools ## The long runs: the kill -9 churn over 200 volume lifecycles; a controller-manager restart watched for 10 minutes.
	cd e2e && $(E2E_GO_TEST) -count=1 -timeout $(TEST_TIMEOUT) ./suite -args -ginkgo.v -ginkgo.label-filter=churn -churn-lifecycles=200 -churn-rounds=20
	cd e2e && $(E2E_GO_TEST) -count=1 -timeout 30m -run TestControllerManagerRestartDetachesNothing ./vmoperator/ -args -soak=10m

.PHONY: pmem-vm
pmem-vm: deps ## The lvm and ndctl PMEM modes and DAX filesystems on emulated NVDIMMs in a QEMU guest.
	cd mgmt-csi && go test -count=1 -v -run TestModesOnEmulatedNVDIMMs ./internal/pmem

.PHONY: e2e
e2e: deps lab-tools ## Run the end-to-end suite; LABELS picks a subset (e.g. LABELS='isolation || reclaim').
	cd e2e && $(E2E_GO_TEST) -count=1 -timeout $(TEST_TIMEOUT) ./suite -args -ginkgo.v $(if $(LABELS),-ginkgo.label-filter='$(LABELS)')

.PHONY: conformance
conformance: deps test-tools ## Run Kubernetes' External Storage tests (e2e.test) against both drivers, all of them, in PROCS parallel processes (default 3), keeping the JUnit reports in REPORTS (default docs/conformance); make test runs a subset.
	hack/build-tools.sh ginkgo
	cd e2e && $(E2E_GO_TEST) -count=1 -v -timeout 4h -run TestExternalStorage ./containers -args -conformance.full -conformance.procs=$(or $(PROCS),3) $(if $(FOCUS),-conformance.focus='$(FOCUS)') -conformance.reports=$(CURDIR)/$(or $(REPORTS),docs/conformance)

.PHONY: sanity
sanity: deps test-tools ## Run the csi-sanity binary against both drivers as the lab runs them and print each summary.
	cd e2e && $(E2E_GO_TEST) -count=1 -v -timeout $(TEST_TIMEOUT) ./sanity

##@ Development

.PHONY: generate
generate: $(CONTROLLER_GEN) $(KUBECTL) ## Generate deepcopy code, CRDs and the tenants RBAC, copy the snapshot CRDs, render the guest install, the clusterctl provider files, the Grafana dashboard, the API reference (docs/api-reference.md) and the Helm charts.
	cd pkg && $(CONTROLLER_GEN) object:headerFile=../hack/boilerplate.go.txt paths=./apis/...
	cd pkg && $(CONTROLLER_GEN) crd paths=./apis/vm/... paths=./apis/pmem/... output:crd:artifacts:config=../manifests/crd/bases
	cd pkg && $(CONTROLLER_GEN) crd paths=./apis/infrastructure/... output:crd:artifacts:config=../manifests/crd/infrastructure
	cd guest-csi && $(CONTROLLER_GEN) rbac:roleName=pvbridge-tenants paths=./internal/tenants/... output:rbac:artifacts:config=../manifests/base/tenants/rbac
	cd vm-operator && $(CONTROLLER_GEN) rbac:roleName=pvbridge-infrastructure-provider paths=./internal/capi/... output:rbac:artifacts:config=../manifests/base/capi-provider/rbac
	hack/update-snapshot-crds.sh
	hack/render-guest-install.sh
	hack/render-capi-provider.sh
	go run ./e2e/cmd/dashboard > manifests/components/monitoring/dashboard.json
	go run ./e2e/cmd/apiref
	go run ./e2e/cmd/charts -kubectl $(KUBECTL)

.PHONY: verify
verify: $(CONTROLLER_GEN) $(KUBECTL) $(HELM) ## Fail if generated files, formatting or go.mod files drift, or a Helm chart does not make its overlay's objects.
	hack/phase.sh verify hack/verify.sh

.PHONY: lint
lint: $(GOLANGCI_LINT) ## Run golangci-lint on every module.
	@# One run over the workspace (go.work): the dependencies every module shares are loaded and
	@# analysed once, not once per module. Its packages are compiled (go list -export) as the
	@# tools, the lab's binaries and the end-to-end tests are (static, -trimpath), so that it
	@# reuses their builds from the Go build cache instead of compiling every library again.
	hack/phase.sh lint env CGO_ENABLED=0 GOFLAGS='-trimpath $(GOFLAGS)' $(GOLANGCI_LINT) run --config .golangci.yml $(MODULES:%=./%/...)
	@# e2e/capispecs, outside the workspace (its own go.mod: Cluster API's test framework).
	cd e2e/capispecs && GOWORK=off CGO_ENABLED=0 GOFLAGS='-trimpath $(GOFLAGS)' $(GOLANGCI_LINT) run --config ../../.golangci.yml ./...

.PHONY: build
build: ## Build pvbridge's binaries into ./bin.
	go build -o bin/ ./pkg/cmd/... ./guest-csi/cmd/... ./mgmt-csi/cmd/... ./vm-operator/cmd/... ./e2e/cmd/...

.PHONY: release
release: deps lab-tools $(HELM) ## Make release VERSION (the tree's: the tag of pvbridge's images in manifests/components/images) into _output/release/VERSION: images, charts, a clusterctl repository, the kubectl plugin and its krew manifest (hack/release.sh).
	hack/release.sh $(or $(VERSION),$(error VERSION is required, e.g. make release VERSION=$$(go run ./e2e/cmd/images -version)))

.PHONY: images
images: deps lab-tools ## Build the images the manifests name, without a container engine: OCI archives in $(CACHE)/images.
	go run ./e2e/cmd/images

.PHONY: node-image
node-image: deps ## Build the node image of QEMU VMs (Debian, systemd, cloud-init, the pinned containerd, kubelet, kubeadm) into the image store $(CACHE)/node-images, as node-<Kubernetes version>.
	hack/build-tools.sh kubernetes containerd
	hack/build-node-image.sh $(CACHE)/node-images

.PHONY: node-vm
node-vm: node-image ## Boot the node image as a QEMU VM with the qemu driver, and hot-plug a disk into it (minutes under TCG).
	cd vm-operator && go test -count=1 -v -tags $(patsubst -tags=%,%,$(filter -tags=%,$(GOFLAGS))),nodevm -timeout 20m -run TestNodeImageBootsAsAVMAndSeesAHotPluggedDisk ./internal/hypervisor/qemu

.PHONY: tools lab-tools test-tools
tools: ## Build the pinned Kubernetes, etcd, CSI sidecar and tool binaries into $(CACHE) (once).
	hack/phase.sh tools hack/build-tools.sh

lab-tools:
	hack/phase.sh tools hack/build-tools.sh $(LAB_TOOLS)

test-tools:
	hack/phase.sh tools hack/build-tools.sh $(TEST_TOOLS)

$(CONTROLLER_GEN):
	hack/build-tools.sh controller-gen

$(GOLANGCI_LINT):
	hack/build-tools.sh golangci-lint

$(KUBECTL):
	hack/build-tools.sh kubernetes

$(HELM):
	hack/build-tools.sh helm

.PHONY: deps
deps: ## Install the system packages the lab needs (Debian).
	hack/install-deps.sh

.PHONY: clean
clean: ## Remove ./bin (the tool cache in $(CACHE) stays).
	rm -rf bin
