package images

import (
	"os"
	"path/filepath"
	"testing"

	. "github.com/onsi/gomega"
)

func TestVersion(t *testing.T) {
	for _, tc := range []struct {
		name, images, want, wantErr string
	}{
		{
			name:   "the one tag of pvbridge's images; other images' tags are theirs",
			images: "  - {name: ghcr.io/pvbridge/mgmt-csi, newTag: v0.2.0-rc.1}\n  - {name: ghcr.io/pvbridge/guest-csi, newTag: v0.2.0-rc.1}\n  - {name: registry.k8s.io/sig-storage/csi-attacher, newTag: v4.13.0}\n",
			want:   "v0.2.0-rc.1",
		},
		{
			name:    "two tags",
			images:  "  - {name: ghcr.io/pvbridge/mgmt-csi, newTag: v0.2.0}\n  - {name: ghcr.io/pvbridge/guest-csi, newTag: v0.1.0}\n",
			wantErr: "two tags, v0.1.0 and v0.2.0",
		},
		{
			name:    "a tag that is no version",
			images:  "  - {name: ghcr.io/pvbridge/mgmt-csi, newTag: latest}\n",
			wantErr: `tagged "latest", not a version`,
		},
		{
			name:    "no image of pvbridge's",
			images:  "  - {name: registry.k8s.io/sig-storage/csi-attacher, newTag: v4.13.0}\n",
			wantErr: `tagged "", not a version`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			root := t.TempDir()
			file := filepath.Join(root, TagsFile)
			g.Expect(os.MkdirAll(filepath.Dir(file), 0o755)).To(Succeed())
			g.Expect(os.WriteFile(file, []byte("kind: Component\nimages:\n"+tc.images), 0o644)).To(Succeed())
			v, err := Version(root)
			if tc.wantErr != "" {
				g.Expect(err).To(MatchError(ContainSubstring(tc.wantErr)))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(v).To(Equal(tc.want))
		})
	}
}

// The repository's own manifests name one version of pvbridge's images.
func TestRepositoryVersion(t *testing.T) {
	g := NewWithT(t)
	v, err := Version(filepath.Join("..", ".."))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(v).To(MatchRegexp(`^v\d+\.\d+\.\d+`))
}

// A tree built as another release is built as a version, or not at all.
func TestBuildReleaseRefusesAVersionThatIsNone(t *testing.T) {
	g := NewWithT(t)
	_, err := BuildRelease(t.TempDir(), "previous", t.TempDir())
	g.Expect(err).To(MatchError(ContainSubstring(`version "previous" is not a version`)))
}
