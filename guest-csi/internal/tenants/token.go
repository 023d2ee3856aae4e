package tenants

import (
	"bytes"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// The guest Secret records the token it holds in annotations, so that the controller knows when
// to renew it without decoding the token, and an operator sees it with kubectl.
const (
	// TokenIssuedAnnotation is when the token was issued (RFC 3339, the controller's clock).
	TokenIssuedAnnotation = "pvbridge.io/token-issued" //nolint:gosec // an annotation key, not a credential
	// TokenExpiresAnnotation is when the apiserver says the token expires (RFC 3339).
	TokenExpiresAnnotation = "pvbridge.io/token-expires" //nolint:gosec // an annotation key, not a credential
	// ServiceAccountUIDAnnotation is the UID of the ServiceAccount the token belongs to: a
	// token dies with its ServiceAccount, so a recreated account needs a new one.
	ServiceAccountUIDAnnotation = "pvbridge.io/serviceaccount-uid"
)

// Reasons for issuing a token, in Events and logs.
const (
	reasonNoCredential    = "NoCredential" //nolint:gosec // a reason, not a credential
	reasonUnreadable      = "CredentialUnreadable"
	reasonDue             = "TokenDue"
	reasonAccountReplaced = "ServiceAccountReplaced"
	reasonTargetChanged   = "ServerChanged"
)

// renewAt is when a token issued at issued and expiring at expires is renewed: after two thirds
// of its life, which leaves a third for guest-csi to pick the new one up (it rereads its file
// every 10 s) and for retries while the guest is unreachable.
func renewAt(issued, expires time.Time) time.Time {
	return issued.Add(expires.Sub(issued) * 2 / 3)
}

// target is what a guest's kubeconfig must say besides its token.
type target struct {
	server    string
	ca        []byte
	namespace string
}

// renewal tells why the guest Secret (nil when there is none) needs a new token, "" if it does
// not, and when the current one is due.
func renewal(secret *corev1.Secret, want target, accountUID string, now time.Time) (reason string, due time.Time) {
	if secret == nil || len(secret.Data[GuestSecretKey]) == 0 {
		return reasonNoCredential, time.Time{}
	}
	issued, err1 := time.Parse(time.RFC3339, secret.Annotations[TokenIssuedAnnotation])
	expires, err2 := time.Parse(time.RFC3339, secret.Annotations[TokenExpiresAnnotation])
	if err1 != nil || err2 != nil || !expires.After(issued) {
		return reasonUnreadable, time.Time{}
	}
	if secret.Annotations[ServiceAccountUIDAnnotation] != accountUID {
		return reasonAccountReplaced, time.Time{}
	}
	if !kubeconfigTargets(secret.Data[GuestSecretKey], want) {
		return reasonTargetChanged, time.Time{}
	}
	due = renewAt(issued, expires)
	if !now.Before(due) {
		return reasonDue, due
	}
	return "", due
}

// kubeconfig is a guest's management kubeconfig: the server, its CA, the token and the guest's
// namespace as the context's.
func kubeconfig(t target, user, token string) ([]byte, error) {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["management"] = &clientcmdapi.Cluster{Server: t.server, CertificateAuthorityData: t.ca}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["pvbridge"] = &clientcmdapi.Context{Cluster: "management", AuthInfo: user, Namespace: t.namespace}
	cfg.CurrentContext = "pvbridge"
	return clientcmd.Write(*cfg)
}

// kubeconfigTargets reports whether a kubeconfig's current context names want's server, CA and
// namespace.
func kubeconfigTargets(data []byte, want target) bool {
	cfg, err := clientcmd.Load(data)
	if err != nil {
		return false
	}
	ctx := cfg.Contexts[cfg.CurrentContext]
	if ctx == nil || cfg.Clusters[ctx.Cluster] == nil {
		return false
	}
	c := cfg.Clusters[ctx.Cluster]
	return c.Server == want.server && bytes.Equal(c.CertificateAuthorityData, want.ca) && ctx.Namespace == want.namespace
}

// tokenOf is the token of a kubeconfig's current context, "" if it has none.
func tokenOf(data []byte) string {
	cfg, err := clientcmd.Load(data)
	if err != nil {
		return ""
	}
	if ctx := cfg.Contexts[cfg.CurrentContext]; ctx != nil && cfg.AuthInfos[ctx.AuthInfo] != nil {
		return cfg.AuthInfos[ctx.AuthInfo].Token
	}
	return ""
}
