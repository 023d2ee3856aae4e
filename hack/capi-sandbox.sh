#!/usr/bin/env bash
# A bench for Cluster API with pvbridge's infrastructure provider (issue 32's first step; not the
# lab, not a test): a throwaway etcd + kube-apiserver on 127.0.0.1, Cluster API's core manager and
# kubeadm bootstrap and control plane providers (hack/build-tools.sh cluster-api) as processes, and
# vm-operator --role=infrastructure-provider under the ServiceAccount of its clusterctl components.
# Installed as a real install has it: Cluster API's CRDs from the release's module (config/crd/bases,
# plus the contract labels its kustomizations add), its mutating, validating and conversion webhooks
# served by the managers on 127.0.0.1 with a CA made here (URLs instead of Services), and
# manifests/clusterctl/infrastructure-components.yaml. The managers use the admin's kubeconfig
# (Cluster API's own RBAC is not installed). No vm-operator controller and no host agent run: a
# VirtualMachine is created but never runs unless its status is patched by hand.
#
# Usage: hack/capi-sandbox.sh up   [dir]   start it all; prints the KUBECONFIG to use
#        hack/capi-sandbox.sh down [dir]   stop what `up` started (by the pids it wrote)
# dir defaults to /tmp/pvbridge-capi-sandbox; ports are CAPI_SANDBOX_PORT (19400) + 0..33.
# Needs the pinned binaries (hack/build-tools.sh etcd kubernetes cluster-api), go, jq, openssl.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
bin=${PVBRIDGE_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/pvbridge/bin}
capi_version=v1.14.2
cmd=${1:?usage: $0 up|down [dir]}
dir=${2:-/tmp/pvbridge-capi-sandbox}
port=${CAPI_SANDBOX_PORT:-19400}
kubectl() { "$bin/kubectl" --kubeconfig "$dir/kubeconfig" "$@"; }

if [ "$cmd" = down ]; then
	for p in infra controlplane bootstrap core apiserver etcd; do
		[ -f "$dir/$p.pid" ] && kill "$(cat "$dir/$p.pid")" 2>/dev/null || true
		rm -f "$dir/$p.pid"
		[ "$p" = apiserver ] && sleep 2
	done
	exit 0
fi
[ "$cmd" = up ] || { echo "usage: $0 up|down [dir]" >&2; exit 2; }

mkdir -p "$dir/etcd" "$dir/pki" "$dir/logs"
start() { # name command...
	local name=$1
	shift
	"$@" >"$dir/logs/$name.log" 2>&1 &
	echo $! >"$dir/$name.pid"
}

# The apiserver: a static token for a system:masters admin, a key pair for ServiceAccount tokens.
openssl genrsa -out "$dir/pki/sa.key" 2048 2>/dev/null
openssl rsa -in "$dir/pki/sa.key" -pubout -out "$dir/pki/sa.pub" 2>/dev/null
echo "admin-token,admin,admin,system:masters" >"$dir/pki/tokens.csv"
start etcd "$bin/etcd" --data-dir "$dir/etcd" --unsafe-no-fsync \
	--listen-client-urls "http://127.0.0.1:$port" --advertise-client-urls "http://127.0.0.1:$port" \
	--listen-peer-urls "http://127.0.0.1:$((port + 1))"
start apiserver "$bin/kube-apiserver" --etcd-servers "http://127.0.0.1:$port" \
	--bind-address 127.0.0.1 --secure-port $((port + 2)) --cert-dir "$dir/pki" \
	--token-auth-file "$dir/pki/tokens.csv" --authorization-mode RBAC \
	--service-account-issuer https://kubernetes.default.svc \
	--service-account-key-file "$dir/pki/sa.pub" --service-account-signing-key-file "$dir/pki/sa.key" \
	--service-cluster-ip-range 10.0.0.0/24
kubeconfig() { # token
	cat <<EOF
apiVersion: v1
kind: Config
clusters: [{name: sandbox, cluster: {server: "https://127.0.0.1:$((port + 2))", insecure-skip-tls-verify: true}}]
users: [{name: user, user: {token: "$1"}}]
contexts: [{name: sandbox, context: {cluster: sandbox, user: user}}]
current-context: sandbox
EOF
}
kubeconfig admin-token >"$dir/kubeconfig"
for _ in $(seq 120); do kubectl get --raw /readyz >/dev/null 2>&1 && break; sleep 1; done
kubectl get --raw /readyz >/dev/null

# The webhooks' CA and serving certificate (one for the three managers, all on 127.0.0.1).
(
	cd "$dir/pki"
	openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 30 \
		-subj /CN=capi-sandbox-webhook-ca 2>/dev/null
	openssl req -newkey rsa:2048 -nodes -keyout tls.key -out tls.csr -subj /CN=127.0.0.1 2>/dev/null
	printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >ext
	openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out tls.crt -days 30 \
		-extfile ext 2>/dev/null
)
ca=$(base64 -w0 <"$dir/pki/ca.crt")

mod=$(cd "$root/hack/tools/cluster-api" && GOWORK=off go list -m -f '{{.Dir}}' sigs.k8s.io/cluster-api)
# manager | binary | directory of the release | webhook port offset | contract labels of its CRDs
managers="core|capi-manager|core|10|{}
bootstrap|capi-kubeadm-bootstrap-manager|bootstrap/kubeadm|11|{\"cluster.x-k8s.io/v1beta1\":\"v1beta1\",\"cluster.x-k8s.io/v1beta2\":\"v1beta2\"}
controlplane|capi-kubeadm-control-plane-manager|controlplane/kubeadm|12|{\"cluster.x-k8s.io/v1beta1\":\"v1beta1\",\"cluster.x-k8s.io/v1beta2\":\"v1beta2\"}"
while IFS='|' read -r name binary path offset labels; do
	url="https://127.0.0.1:$((port + offset))"
	for crd in "$mod/$path"/config/crd/bases/*.yaml; do
		kubectl create --dry-run=client --validate=false -o json -f "$crd" |
			jq --argjson l "$labels" --arg url "$url/convert" --arg ca "$ca" '
				.metadata.labels = ((.metadata.labels // {}) + $l) |
				.spec.conversion = {strategy: "Webhook", webhook: {conversionReviewVersions: ["v1"],
					clientConfig: {url: $url, caBundle: $ca}}}' |
			kubectl apply --server-side -f - >/dev/null
	done
	kubectl create --dry-run=client --validate=false -o json -f "$mod/$path/config/webhook/manifests.yaml" |
		jq --arg name "$name" --arg url "$url" --arg ca "$ca" '
			if .kind == "List" then .items[] else . end | .metadata.name = "capi-\($name)-\(.metadata.name)" |
			.webhooks |= map(.clientConfig = {url: ($url + .clientConfig.service.path), caBundle: $ca})' |
		kubectl apply --server-side -f - >/dev/null
	start "$name" "$bin/$binary" \
		--kubeconfig "$dir/kubeconfig" --webhook-port $((port + offset)) --webhook-cert-dir "$dir/pki" \
		--health-addr "127.0.0.1:$((port + offset + 10))" \
		--diagnostics-address "127.0.0.1:$((port + offset + 20))" --insecure-diagnostics
done <<<"$managers"

# pvbridge: the VirtualMachine CRD and the provider's clusterctl components; the provider runs
# with its ServiceAccount's token, so its shipped RBAC is what it has.
kubectl apply --server-side -f "$root/manifests/crd/bases/vm.pvbridge.io_virtualmachines.yaml" >/dev/null
kubectl apply --server-side -f "$root/manifests/clusterctl/infrastructure-components.yaml" >/dev/null
(cd "$root" && go build -o "$dir/vm-operator" ./vm-operator/cmd/vm-operator)
kubeconfig "$(kubectl -n pvbridge-capi-system create token pvbridge-infrastructure-provider --duration 24h)" \
	>"$dir/infra.kubeconfig"
start infra "$dir/vm-operator" --role=infrastructure-provider --kubeconfig "$dir/infra.kubeconfig" \
	--metrics-bind-address 0 --health-probe-bind-address "127.0.0.1:$((port + 33))" --v=2

for p in 20 21 22; do
	for _ in $(seq 120); do curl -sf "http://127.0.0.1:$((port + p))/readyz" >/dev/null && break; sleep 1; done
done
echo "Cluster API $capi_version and pvbridge's provider are up; logs in $dir/logs"
echo "export KUBECONFIG=$dir/kubeconfig"
