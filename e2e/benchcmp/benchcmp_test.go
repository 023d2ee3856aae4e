package benchcmp

import (
	"strings"
	"testing"

	. "github.com/onsi/gomega"
)

func TestCompare(t *testing.T) {
	g := NewWithT(t)
	baseline := `# measured on abc1234
bridge_over_direct_pod_running_p50 2.41 x
bridge_over_direct_pod_running_p99 2.89 x
guest_cpu_per_volume 2.05 s
guest_provisioning_throughput 1.58 volumes/s
direct_attach_p50 1.00 s
`
	output := `Running Suite
BENCH bridge_over_direct_pod_running_p50 2.700 x (spread 1.10x)
BENCH bridge_over_direct_pod_running_p99 2.950 x (spread 1.20x)
BENCH guest_cpu_per_volume 1.700 s (spread 1.05x)
BENCH guest_provisioning_throughput 2.000 volumes/s (spread 1.30x)
BENCH guest_hop pod_scheduled 0.1 s
`
	order, base, err := Parse(strings.NewReader(baseline))
	g.Expect(err).NotTo(HaveOccurred())
	_, now, err := Parse(strings.NewReader(output))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(now).To(HaveKeyWithValue("guest_cpu_per_volume", Figure{1.7, "s"}))
	g.Expect(now).NotTo(HaveKey("guest_hop"), "a line that is not a figure")

	var out strings.Builder
	regressions, err := Report(&out, Compare(order, base, now))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(regressions).To(Equal(1))
	g.Expect(strings.Split(strings.TrimSpace(out.String()), "\n")).To(Equal([]string{
		"BENCH-CHANGE figure baseline now change",
		"BENCH-CHANGE bridge_over_direct_pod_running_p50 2.41 2.7 x +12.0% REGRESSION (a ratio more than 10% worse)",
		"BENCH-CHANGE bridge_over_direct_pod_running_p99 2.89 2.95 x +2.1%",
		"BENCH-CHANGE guest_cpu_per_volume 2.05 1.7 s -17.1%",
		"BENCH-CHANGE guest_provisioning_throughput 1.58 2 volumes/s +26.6%",
		"BENCH-CHANGE direct_attach_p50 1 s not measured",
		"BENCH-CHANGE 1 regressions against the baseline",
	}))
}
