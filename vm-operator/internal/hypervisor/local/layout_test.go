package local

import (
	"slices"
	"testing"

	. "github.com/onsi/gomega"
)

func TestDiskNameFollowsTheKernel(t *testing.T) {
	tests := []struct {
		index int
		want  string
	}{
		{0, "vda"},
		{1, "vdb"},
		{25, "vdz"},
		{26, "vdaa"},
		{27, "vdab"},
		{51, "vdaz"},
		{52, "vdba"},
		{701, "vdzz"},
		{702, "vdaaa"},
	}
	for _, tt := range tests {
		t.Run(tt.want, func(t *testing.T) {
			g := NewWithT(t)
			g.Expect(diskName(tt.index)).To(Equal(tt.want))
			g.Expect(isDiskName(tt.want)).To(BeTrue())
		})
	}
}

func TestDiskNamesSortByIndex(t *testing.T) {
	g := NewWithT(t)
	var names []string
	for i := range 800 {
		names = append(names, diskName(i))
	}
	shuffled := slices.Clone(names)
	slices.Reverse(shuffled)

	slices.SortFunc(shuffled, compareNames)

	g.Expect(shuffled).To(Equal(names))
}

func TestIsDiskName(t *testing.T) {
	tests := []struct {
		name string
		want bool
	}{
		{"vda", true},
		{"vdaa", true},
		{"vd", false},
		{"sda", false},
		{"vdA", false},
		{"vd1", false},
		{"vda/..", false},
		{"../vda", false},
		{"", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			NewWithT(t).Expect(isDiskName(tt.name)).To(Equal(tt.want))
		})
	}
}

func TestParseRecordRefusesACorruptRecord(t *testing.T) {
	tests := []struct {
		name, serial, data string
		wantErr            bool
	}{
		{name: "valid", serial: "disk-1", data: `{"serial":"disk-1","name":"vda","device":"/dev/loop3","major":7,"minor":3}`},
		{name: "not JSON", serial: "disk-1", data: `{"serial":`, wantErr: true},
		{name: "another serial", serial: "disk-1", data: `{"serial":"disk-2","name":"vda"}`, wantErr: true},
		{name: "name climbing out", serial: "disk-1", data: `{"serial":"disk-1","name":"../../etc"}`, wantErr: true},
		{name: "invalid serial", serial: "a b", data: `{"serial":"a b","name":"vda"}`, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			rec, err := parseRecord(tt.serial, []byte(tt.data))
			if tt.wantErr {
				g.Expect(err).To(HaveOccurred())
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(rec).To(Equal(record{Serial: "disk-1", Name: "vda", Device: "/dev/loop3", Major: 7, Minor: 3}))
			g.Expect(rec.number()).To(Equal("7:3"))
		})
	}
}
