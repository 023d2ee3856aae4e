// Package listpatch writes single entries of a list-map (a list keyed by one of its entries'
// fields, x-kubernetes-list-type: map) with a JSON patch (RFC 6902) instead of a write of the
// whole object under its resourceVersion.
//
// Every change of an entry tests, in the same patch, that the index it was computed at still
// holds that entry's key (or the whole entry the writer read, when it must not change under
// it). Writers of different entries, and writers of other fields, then never conflict, while a
// patch computed from a stale read fails as a whole: the apiserver answers Invalid (422), as it
// does for a second entry of one key, and the writer reads the object again and edits anew. A
// burst of writers of one object costs one request each instead of a 409 and a reread per
// concurrent writer.
package listpatch

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"

	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// Op is one operation of a JSON patch. A nil Value is left out, which a test reads as "this
// path is missing or null".
type Op struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value,omitempty"`
}

// Test is the operation that fails the patch unless path holds value.
func Test(path string, value any) Op { return Op{Op: "test", Path: path, Value: value} }

// Edit changes entries of the list-map at Path, computed from a read of it.
type Edit struct {
	// Path is the list's JSON pointer, such as /spec/volumes.
	Path string
	// Key is the JSON name of the field that keys its entries, such as name.
	Key string
	// Read are the keys of the entries as read, in their order.
	Read []string
	// Set replaces the entries of these keys, or appends those that Read does not hold.
	Set map[string]any
	// Remove removes the entries of these keys; keys that Read does not hold are ignored.
	Remove []string
	// Expect holds, for a key of Set or Remove, the whole entry it must still hold for the
	// edit to apply (compare and swap); other keys are tested only for being at their index.
	// The entry is compared as JSON: a field stored with its zero value differs from one left
	// out.
	Expect map[string]any
}

// Ops returns the operations of the edit: the tests at the indices read, the replacements, the
// removals from the highest index down, then the appends. An append needs a list that exists,
// which a list read as empty may not (it may be stored empty or not at all): then ok is false,
// and the caller writes the list whole, under the resourceVersion it read.
func (e Edit) Ops() (ops []Op, ok bool) {
	index := make(map[string]int, len(e.Read))
	for i, k := range e.Read {
		index[k] = i
	}
	at := func(i int) string { return fmt.Sprintf("%s/%d", e.Path, i) }
	var tests, changes []Op
	guard := func(k string, i int) {
		if v, ok := e.Expect[k]; ok {
			tests = append(tests, Test(at(i), v))
		} else {
			tests = append(tests, Test(at(i)+"/"+e.Key, k))
		}
	}
	var appends []Op
	for _, k := range slices.Sorted(maps.Keys(e.Set)) {
		i, ok := index[k]
		if !ok {
			appends = append(appends, Op{Op: "add", Path: e.Path + "/-", Value: e.Set[k]})
			continue
		}
		guard(k, i)
		changes = append(changes, Op{Op: "replace", Path: at(i), Value: e.Set[k]})
	}
	if len(appends) > 0 && len(e.Read) == 0 {
		return nil, false
	}
	var removed []int
	for _, k := range e.Remove {
		if i, ok := index[k]; ok && !slices.Contains(removed, i) {
			guard(k, i)
			removed = append(removed, i)
		}
	}
	slices.Sort(removed)
	for _, i := range slices.Backward(removed) {
		changes = append(changes, Op{Op: "remove", Path: at(i)})
	}
	return slices.Concat(tests, changes, appends), true
}

// Diff is the edit of the list-map at path, keyed by the field key (whose value keyOf returns),
// from base, as read, to want: the entries that want changes or adds are set, those it lacks
// removed. With cas, every entry changed or removed must still be as base read it.
func Diff[T any](path, key string, base, want []T, keyOf func(T) string, cas bool) Edit {
	e := Edit{Path: path, Key: key, Set: map[string]any{}, Expect: map[string]any{}}
	old := make(map[string]T, len(base))
	for _, x := range base {
		e.Read = append(e.Read, keyOf(x))
		old[keyOf(x)] = x
	}
	kept := make(map[string]bool, len(want))
	for _, x := range want {
		k := keyOf(x)
		kept[k] = true
		o, ok := old[k]
		if ok && equality.Semantic.DeepEqual(o, x) {
			continue
		}
		e.Set[k] = x
		if ok && cas {
			e.Expect[k] = o
		}
	}
	for _, k := range e.Read {
		if !kept[k] {
			e.Remove = append(e.Remove, k)
			if cas {
				e.Expect[k] = old[k]
			}
		}
	}
	return e
}

// Patch is the JSON patch of ops, for client.Client's Patch and Status().Patch.
func Patch(ops ...Op) (client.Patch, error) {
	data, err := json.Marshal(ops)
	if err != nil {
		return nil, err
	}
	return client.RawPatch(types.JSONPatchType, data), nil
}
