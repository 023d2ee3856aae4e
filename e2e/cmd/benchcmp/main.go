// Command benchcmp passes `make bench`'s output through and, at its end, prints each figure of a
// baseline file beside the one measured, with the change, and the ratio figures that got more
// than 10 % worse as regressions (package pvbridge.io/e2e/benchcmp).
//
// Usage: make bench | benchcmp -baseline e2e/benchcmp/baseline.txt
package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"

	"pvbridge.io/e2e/benchcmp"
)

func main() {
	baseline := flag.String("baseline", "", "the baseline file: lines `<name> <value> <unit>`")
	flag.Parse()
	if err := run(*baseline, os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "benchcmp:", err)
		os.Exit(1)
	}
}

func run(baselineFile string, in io.Reader, out io.Writer) error {
	data, err := os.ReadFile(baselineFile)
	if err != nil {
		return err
	}
	var output bytes.Buffer
	if _, err := io.Copy(io.MultiWriter(out, &output), in); err != nil {
		return err
	}
	order, base, err := benchcmp.Parse(bytes.NewReader(data))
	if err != nil {
		return err
	}
	_, now, err := benchcmp.Parse(&output)
	if err != nil {
		return err
	}
	_, err = benchcmp.Report(out, benchcmp.Compare(order, base, now))
	return err
}
