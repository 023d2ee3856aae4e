package tenants

import (
	"testing"
	"time"

	. "github.com/onsi/gomega"
)

// TestOptionsValidate: every refusal names the option and why.
func TestOptionsValidate(t *testing.T) {
	valid := func() Options {
		return Options{
			MgmtServer: "https://mgmt.example:6443", CapacityNamespace: "pvbridge-system", GuestNamespace: "kube-system",
			TokenTTL: 24 * time.Hour, MetricsAddress: "0", HealthAddress: ":8081",
		}
	}
	for _, tc := range []struct {
		name   string
		mutate func(*Options)
		err    string
	}{
		{"valid", func(*Options) {}, ""},
		{"no server", func(o *Options) { o.MgmtServer = "" }, "management server URL (as guests reach it) is required"},
		{"plain http server", func(o *Options) { o.MgmtServer = "http://mgmt:6443" }, `management server "http://mgmt:6443" is not an https:// URL`},
		{"bad capacity namespace", func(o *Options) { o.CapacityNamespace = "Pvbridge" }, `capacity namespace "Pvbridge" is not a namespace name`},
		{"bad guest namespace", func(o *Options) { o.GuestNamespace = "" }, `guest namespace "" is not a namespace name`},
		{"token below the apiserver's minimum", func(o *Options) { o.TokenTTL = 5 * time.Minute }, "token TTL 5m0s is below the apiserver's minimum of 10m0s"},
		{"bad health address", func(o *Options) { o.HealthAddress = "8081" }, "health address:"},
		{"a mirror with a port and a path", func(o *Options) { o.ImageRegistry = "mirror.example.com:5000/k8s" }, ""},
		{"a mirror with a scheme", func(o *Options) { o.ImageRegistry = "https://mirror.example.com" }, `guest image registry "https://mirror.example.com" is not host[:port][/path]`},
		{"a mirror with a tag", func(o *Options) { o.ImageRegistry = "mirror.example.com/k8s:v1" }, "is not host[:port][/path]"},
		{"a mirror with a trailing slash", func(o *Options) { o.ImageRegistry = "mirror.example.com/" }, "is not host[:port][/path]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			o := valid()
			tc.mutate(&o)
			err := o.Validate()
			if tc.err == "" {
				g.Expect(err).NotTo(HaveOccurred())
			} else {
				g.Expect(err).To(MatchError(ContainSubstring(tc.err)))
			}
		})
	}
}
