package listpatch

import (
	"encoding/json"
	"testing"

	jsonpatch "gopkg.in/evanphx/json-patch.v4" // the apiserver's
	. "github.com/onsi/gomega"
)

type entry struct {
	Name  string `json:"name"`
	Error string `json:"error,omitempty"`
}

func TestEdit(t *testing.T) {
	a, b, c := entry{Name: "a"}, entry{Name: "b"}, entry{Name: "c"}
	tests := []struct {
		name    string
		doc     string
		edit    Edit
		missing bool
		want    string // the document after the patch; empty: the patch fails
	}{
		{
			name: "a new entry is appended",
			doc:  `{"v":[{"name":"a"}]}`,
			edit: Edit{Read: []string{"a"}, Set: map[string]any{"b": b}},
			want: `{"v":[{"name":"a"},{"name":"b"}]}`,
		},
		{
			name:    "the first entry creates the list",
			doc:     `{}`,
			edit:    Edit{Set: map[string]any{"a": a}},
			missing: true,
			want:    `{"v":[{"name":"a"}]}`,
		},
		{
			name:    "creating the list fails when another writer created it",
			doc:     `{"v":[{"name":"b"}]}`,
			edit:    Edit{Set: map[string]any{"a": a}},
			missing: true,
		},
		{
			name: "appending fails while the list is not stored",
			doc:  `{}`,
			edit: Edit{Set: map[string]any{"a": a}},
		},
		{
			name: "appending to a list stored empty",
			doc:  `{"v":[]}`,
			edit: Edit{Set: map[string]any{"a": a}},
			want: `{"v":[{"name":"a"}]}`,
		},
		{
			name: "an entry is replaced where it was read",
			doc:  `{"v":[{"name":"a"},{"name":"b"}]}`,
			edit: Edit{Read: []string{"a", "b"}, Set: map[string]any{"b": entry{Name: "b", Error: "x"}}},
			want: `{"v":[{"name":"a"},{"name":"b","error":"x"}]}`,
		},
		{
			name: "a replacement fails when the entry moved",
			doc:  `{"v":[{"name":"b"}]}`,
			edit: Edit{Read: []string{"a", "b"}, Set: map[string]any{"b": entry{Name: "b", Error: "x"}}},
		},
		{
			name: "removals from several indices",
			doc:  `{"v":[{"name":"a"},{"name":"b"},{"name":"c"}]}`,
			edit: Edit{Read: []string{"a", "b", "c"}, Remove: []string{"a", "c", "x"}},
			want: `{"v":[{"name":"b"}]}`,
		},
		{
			name: "replace, remove and append in one patch",
			doc:  `{"v":[{"name":"a"},{"name":"b"}]}`,
			edit: Edit{Read: []string{"a", "b"}, Remove: []string{"a"}, Set: map[string]any{"b": entry{Name: "b", Error: "x"}, "c": c}},
			want: `{"v":[{"name":"b","error":"x"},{"name":"c"}]}`,
		},
		{
			name: "a compare and swap applies to the entry as read",
			doc:  `{"v":[{"name":"a","error":"old"}]}`,
			edit: Edit{Read: []string{"a"}, Remove: []string{"a"}, Expect: map[string]any{"a": entry{Name: "a", Error: "old"}}},
			want: `{"v":[]}`,
		},
		{
			name: "a compare and swap fails when the entry changed",
			doc:  `{"v":[{"name":"a","error":"new"}]}`,
			edit: Edit{Read: []string{"a"}, Remove: []string{"a"}, Expect: map[string]any{"a": entry{Name: "a", Error: "old"}}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			tt.edit.Path, tt.edit.Key = "/v", "name"
			data, err := json.Marshal(tt.edit.Ops(tt.missing))
			g.Expect(err).NotTo(HaveOccurred())
			patch, err := jsonpatch.DecodePatch(data)
			g.Expect(err).NotTo(HaveOccurred())
			got, err := patch.Apply([]byte(tt.doc))
			if tt.want == "" {
				g.Expect(err).To(HaveOccurred(), string(got))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got).To(MatchJSON(tt.want))
		})
	}
}

func TestMissing(t *testing.T) {
	g := NewWithT(t)
	g.Expect([]bool{Missing(0, 0), Missing(0, 1), Missing(0, 2), Missing(1, 0)}).To(Equal([]bool{true, false, true, false}))
}
