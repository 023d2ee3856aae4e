package listpatch

import (
	"encoding/json"
	"testing"

	. "github.com/onsi/gomega"
	jsonpatch "gopkg.in/evanphx/json-patch.v4" // the apiserver's
)

type entry struct {
	Name  string `json:"name"`
	Error string `json:"error,omitempty"`
}

func TestEdit(t *testing.T) {
	b, c := entry{Name: "b"}, entry{Name: "c"}
	tests := []struct {
		name string
		doc  string
		edit Edit
		want string // the document after the patch; empty: the patch fails
	}{
		{
			name: "a new entry is appended",
			doc:  `{"v":[{"name":"a"}]}`,
			edit: Edit{Read: []string{"a"}, Set: map[string]any{"b": b}},
			want: `{"v":[{"name":"a"},{"name":"b"}]}`,
		},
		{
			name: "appending fails when the list read was not stored any more",
			doc:  `{}`,
			edit: Edit{Read: []string{"a"}, Set: map[string]any{"b": b}},
		},
		{
			name: "a second entry of a key is appended (the apiserver's validation refuses the result)",
			doc:  `{"v":[{"name":"a"},{"name":"b"}]}`,
			edit: Edit{Read: []string{"a"}, Set: map[string]any{"b": b}},
			want: `{"v":[{"name":"a"},{"name":"b"},{"name":"b"}]}`,
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
			ops, ok := tt.edit.Ops()
			g.Expect(ok).To(BeTrue())
			data, err := json.Marshal(ops)
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

func TestAppendToAListReadEmpty(t *testing.T) {
	g := NewWithT(t)
	_, ok := Edit{Path: "/v", Key: "name", Set: map[string]any{"a": entry{Name: "a"}}}.Ops()
	g.Expect(ok).To(BeFalse(), "the list may not exist: it is written whole")
	ops, ok := Edit{Path: "/v", Key: "name", Remove: []string{"a"}}.Ops()
	g.Expect(ok).To(BeTrue())
	g.Expect(ops).To(BeEmpty())
}

func TestDiff(t *testing.T) {
	key := func(e entry) string { return e.Name }
	tests := []struct {
		name       string
		base, want []entry
		cas        bool
		wantEdit   Edit
	}{
		{
			name: "nothing changed",
			base: []entry{{Name: "a"}}, want: []entry{{Name: "a"}},
			wantEdit: Edit{Read: []string{"a"}, Set: map[string]any{}, Expect: map[string]any{}},
		},
		{
			name: "changed, added and removed entries",
			base: []entry{{Name: "a"}, {Name: "b"}}, want: []entry{{Name: "b", Error: "x"}, {Name: "c"}},
			wantEdit: Edit{
				Read: []string{"a", "b"}, Remove: []string{"a"},
				Set:    map[string]any{"b": entry{Name: "b", Error: "x"}, "c": entry{Name: "c"}},
				Expect: map[string]any{},
			},
		},
		{
			name: "compare and swap expects what was read",
			base: []entry{{Name: "a", Error: "x"}, {Name: "b"}}, want: []entry{{Name: "a"}}, cas: true,
			wantEdit: Edit{
				Read: []string{"a", "b"}, Remove: []string{"b"},
				Set:    map[string]any{"a": entry{Name: "a"}},
				Expect: map[string]any{"a": entry{Name: "a", Error: "x"}, "b": entry{Name: "b"}},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			tt.wantEdit.Path, tt.wantEdit.Key = "/v", "name"
			g.Expect(Diff("/v", "name", tt.base, tt.want, key, tt.cas)).To(Equal(tt.wantEdit))
		})
	}
}
