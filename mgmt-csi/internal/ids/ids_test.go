package ids

import (
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/util/validation"
)

func TestFor(t *testing.T) {
	tests := []struct {
		name, in, want string
	}{
		{"provisioner names are kept", "pvc-0b3f7c1e-2f7a-4d0c-9b1e-4c2e8f0a1d2c", "pvc-0b3f7c1e-2f7a-4d0c-9b1e-4c2e8f0a1d2c"},
		{"upper case is hashed", "Sanity-Volume", "v-" + "sha"},
		{"too long is hashed", strings.Repeat("a", 64), "v-" + "sha"},
		{"dots are hashed", "a.b", "v-" + "sha"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			got := For("v", tt.in)
			g.Expect(validation.IsDNS1123Label(got)).To(BeEmpty())
			if tt.want == "v-sha" {
				g.Expect(got).To(HavePrefix("v-"))
				g.Expect(got).To(HaveLen(42))
				g.Expect(For("v", tt.in)).To(Equal(got), "deterministic")
			} else {
				g.Expect(got).To(Equal(tt.want))
			}
		})
	}
	NewWithT(t).Expect(For("v", "A")).NotTo(Equal(For("v", "a-")), "distinct names, distinct IDs")
}

func FuzzFor(f *testing.F) {
	for _, s := range []string{"pvc-1", "Sanity", "", strings.Repeat("x", 200), "a.b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		id := For("v", name)
		if msgs := validation.IsDNS1123Label(id); len(msgs) > 0 {
			t.Fatalf("For(%q) = %q: %v", name, id, msgs)
		}
		if id != For("v", name) {
			t.Fatalf("For(%q) is not deterministic", name)
		}
	})
}
