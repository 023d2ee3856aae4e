package sanity_test

import (
	"testing"

	. "github.com/onsi/gomega"
)

func TestParseSummary(t *testing.T) {
	tests := []struct {
		name    string
		out     string
		want    summary
		wantErr bool
	}{
		{
			name: "a passing suite",
			out:  "Ran 75 of 103 Specs in 40.1 seconds\nSUCCESS! -- 75 Passed | 0 Failed | 1 Pending | 27 Skipped\nPASS\n",
			want: summary{Passed: 75, Pending: 1, Skipped: 27},
		},
		{
			name: "a failing suite in colour",
			out:  "\x1b[1mRan 75 of 103 Specs\x1b[0m\n\x1b[38;5;9m\x1b[1mFAIL! -- 73 Passed | 2 Failed | 1 Pending | 27 Skipped\x1b[0m\n--- FAIL: TestSanity\n",
			want: summary{Passed: 73, Failed: 2, Pending: 1, Skipped: 27},
		},
		{
			name: "the last report counts",
			out:  "0 Passed | 0 Failed | 0 Pending | 0 Skipped\nFAIL! -- 1 Passed | 2 Failed | 3 Pending | 4 Skipped\n",
			want: summary{Passed: 1, Failed: 2, Pending: 3, Skipped: 4},
		},
		{name: "no report: csi-sanity did not get to run", out: "Connection timed out\n", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			got, err := parseSummary([]byte(tt.out))
			if tt.wantErr {
				g.Expect(err).To(HaveOccurred())
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got).To(Equal(tt.want))
		})
	}
}
