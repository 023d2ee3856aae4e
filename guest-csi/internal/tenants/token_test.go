package tenants

import (
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestRenewal: when and why a guest's credential is replaced.
func TestRenewal(t *testing.T) {
	issued := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	want := target{server: "https://mgmt:6443", ca: []byte("ca"), namespace: "tenant-a"}
	secret := func(mutate func(s *corev1.Secret, t *target)) *corev1.Secret {
		kc := want
		s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{
			TokenIssuedAnnotation:       issued.Format(time.RFC3339),
			TokenExpiresAnnotation:      issued.Add(24 * time.Hour).Format(time.RFC3339),
			ServiceAccountUIDAnnotation: "sa-1",
		}}}
		if mutate != nil {
			mutate(s, &kc)
		}
		data, err := kubeconfig(kc, "a-pvbridge", "token")
		if err != nil {
			t.Fatal(err)
		}
		if s.Data == nil {
			s.Data = map[string][]byte{GuestSecretKey: data}
		}
		return s
	}
	for _, tc := range []struct {
		name   string
		secret *corev1.Secret
		now    time.Time
		reason string
	}{
		{"no Secret", nil, issued, reasonNoCredential},
		{"no kubeconfig key", secret(func(s *corev1.Secret, _ *target) { s.Data = map[string][]byte{"other": nil} }), issued, reasonNoCredential},
		{"no issue time", secret(func(s *corev1.Secret, _ *target) { delete(s.Annotations, TokenIssuedAnnotation) }), issued, reasonUnreadable},
		{"expiry before issue", secret(func(s *corev1.Secret, _ *target) {
			s.Annotations[TokenExpiresAnnotation] = issued.Add(-time.Hour).Format(time.RFC3339)
		}), issued, reasonUnreadable},
		{"ServiceAccount recreated", secret(func(s *corev1.Secret, _ *target) { s.Annotations[ServiceAccountUIDAnnotation] = "sa-0" }), issued, reasonAccountReplaced},
		{"other server", secret(func(_ *corev1.Secret, t *target) { t.server = "https://old:6443" }), issued, reasonTargetChanged},
		{"other CA", secret(func(_ *corev1.Secret, t *target) { t.ca = []byte("old") }), issued, reasonTargetChanged},
		{"other namespace", secret(func(_ *corev1.Secret, t *target) { t.namespace = "tenant-b" }), issued, reasonTargetChanged},
		{"fresh", secret(nil), issued.Add(time.Hour), ""},
		{"just before two thirds", secret(nil), issued.Add(16*time.Hour - time.Second), ""},
		{"at two thirds", secret(nil), issued.Add(16 * time.Hour), reasonDue},
		{"expired", secret(nil), issued.Add(25 * time.Hour), reasonDue},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			reason, due := renewal(tc.secret, want, "sa-1", tc.now)
			g.Expect(reason).To(Equal(tc.reason))
			if reason == "" || reason == reasonDue {
				g.Expect(due).To(Equal(issued.Add(16 * time.Hour)))
			}
		})
	}
}
