// Package benchcmp compares the figures `make bench` prints (`BENCH <name> <value> <unit> ...`)
// with a committed baseline, so that the cost of a change shows when it lands: each figure of
// the baseline is printed with its change, and a ratio figure (unit "x", such as the pod start
// through both layers ÷ directly, where lower is better) more than Tolerance worse is reported
// as a regression.
package benchcmp

import (
	"bufio"
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"
)

// Tolerance is how much worse a ratio figure may get before it is a regression: the machine
// is noisy, but a ratio measured in one run cancels most of it.
const Tolerance = 0.10

// Figure is one measured value.
type Figure struct {
	Value float64
	Unit  string
}

// benchLine is a figure line of the bench's output.
var benchLine = regexp.MustCompile(`^BENCH (\S+) ([0-9.eE+-]+) (\S+)`)

// Parse reads the figures of bench output, or of a baseline file in the same form (`BENCH`
// optional; blank lines and lines starting with # are skipped), and their names in the order
// they first appear. A figure printed twice keeps its last value.
func Parse(r io.Reader) (names []string, figures map[string]Figure, err error) {
	figures = map[string]Figure{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if !strings.HasPrefix(line, "BENCH ") {
			line = "BENCH " + line
		}
		m := benchLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		v, err := strconv.ParseFloat(m[2], 64)
		if err != nil {
			return nil, nil, fmt.Errorf("figure %s: %w", m[1], err)
		}
		if _, seen := figures[m[1]]; !seen {
			names = append(names, m[1])
		}
		figures[m[1]] = Figure{Value: v, Unit: m[3]}
	}
	return names, figures, sc.Err()
}

// Change is a baseline figure beside the one measured now.
type Change struct {
	Name     string
	Baseline Figure
	// Now is the figure measured, nil when the run did not print it.
	Now *Figure
	// Regression: a ratio figure more than Tolerance worse than its baseline.
	Regression bool
}

// Compare returns, for each figure of baseline in order, the change to now.
func Compare(order []string, baseline, now map[string]Figure) []Change {
	changes := make([]Change, 0, len(order))
	for _, name := range order {
		c := Change{Name: name, Baseline: baseline[name]}
		if f, ok := now[name]; ok {
			c.Now = &f
			c.Regression = f.Unit == "x" && c.Baseline.Value > 0 && f.Value > c.Baseline.Value*(1+Tolerance)
		}
		changes = append(changes, c)
	}
	return changes
}

// Report writes the changes, one line each, and a last line that counts the regressions.
func Report(w io.Writer, changes []Change) (regressions int, err error) {
	var b strings.Builder
	b.WriteString("BENCH-CHANGE figure baseline now change\n")
	for _, c := range changes {
		if c.Now == nil {
			fmt.Fprintf(&b, "BENCH-CHANGE %s %g %s not measured\n", c.Name, c.Baseline.Value, c.Baseline.Unit)
			continue
		}
		change := "-"
		if c.Baseline.Value != 0 {
			change = fmt.Sprintf("%+.1f%%", (c.Now.Value/c.Baseline.Value-1)*100)
		}
		mark := ""
		if c.Regression {
			mark = fmt.Sprintf(" REGRESSION (a ratio more than %.0f%% worse)", Tolerance*100)
			regressions++
		}
		fmt.Fprintf(&b, "BENCH-CHANGE %s %g %g %s %s%s\n", c.Name, c.Baseline.Value, c.Now.Value, c.Now.Unit, change, mark)
	}
	fmt.Fprintf(&b, "BENCH-CHANGE %d regressions against the baseline\n", regressions)
	_, err = io.WriteString(w, b.String())
	return regressions, err
}
