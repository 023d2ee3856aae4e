package qos

import (
	"testing"

	. "github.com/onsi/gomega"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name    string
		params  map[string]string
		want    Limits
		wantErr string
	}{
		{name: "none", params: nil, want: Limits{}},
		{name: "both", params: map[string]string{MaxIOPSParam: "200", MaxBytesPerSecondParam: "8Mi"}, want: Limits{IOPS: 200, BytesPerSecond: 8 << 20}},
		{name: "decimal bytes", params: map[string]string{MaxBytesPerSecondParam: "10M"}, want: Limits{BytesPerSecond: 10_000_000}},
		{name: "a round number of IOPS", params: map[string]string{MaxIOPSParam: "100000"}, want: Limits{IOPS: 100000}},
		{name: "zero is no limit", params: map[string]string{MaxIOPSParam: "0"}, want: Limits{}},
		{name: "unknown", params: map[string]string{"maxIops": "5"}, wantErr: `maxIops "5": unknown parameter`},
		{name: "iops with a suffix", params: map[string]string{MaxIOPSParam: "2k"}, wantErr: `maxIOPS "2k": not a whole number`},
		{name: "fraction", params: map[string]string{MaxBytesPerSecondParam: "1.5"}, wantErr: "not a whole number of bytes"},
		{name: "negative", params: map[string]string{MaxIOPSParam: "-1"}, wantErr: "negative"},
		{name: "garbage", params: map[string]string{MaxBytesPerSecondParam: "fast"}, wantErr: "not a number"},
		{name: "too many IOPS", params: map[string]string{MaxIOPSParam: "1000000000000000001"}, wantErr: "above"},
		{name: "too large", params: map[string]string{MaxBytesPerSecondParam: "2E"}, wantErr: "above"},
		{name: "every error", params: map[string]string{MaxIOPSParam: "x", MaxBytesPerSecondParam: "-1"}, wantErr: `maxBytesPerSecond "-1": negative; maxIOPS "x": not a whole number`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			got, err := Parse(tc.params)
			if tc.wantErr != "" {
				g.Expect(err).To(MatchError(ContainSubstring(tc.wantErr)))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got).To(Equal(tc.want))
		})
	}
}

func TestString(t *testing.T) {
	g := NewWithT(t)
	g.Expect(Limits{}.String()).To(Equal("no limits"))
	g.Expect(Limits{IOPS: 5, BytesPerSecond: 7}.String()).To(Equal("5 IOPS, 7 bytes/s"))
}
