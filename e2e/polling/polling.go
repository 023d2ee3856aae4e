// Package polling sets how often the end-to-end tests' Gomega assertions poll.
package polling

import (
	"time"

	"github.com/onsi/gomega"
)

// Interval is how often an Eventually or Consistently of the end-to-end tests polls, where it
// does not say (Gomega's default is 10 ms). Most of them read from a lab's apiserver: at 10 ms
// every wait costs the apiserver and the test up to a hundred requests a second, which the labs
// running side by side on a 2-core machine pay for, while a condition seen 50 ms later on
// average changes no result.
const Interval = 100 * time.Millisecond

// Set makes Interval the polling interval of Gomega's global assertions and of each Gomega
// that NewWithT makes after it (NewWithT copies the global defaults).
func Set() {
	gomega.SetDefaultEventuallyPollingInterval(Interval)
	gomega.SetDefaultConsistentlyPollingInterval(Interval)
}
