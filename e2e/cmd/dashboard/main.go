// Command dashboard prints pvbridge's Grafana dashboard (e2e/monitoring) as JSON; `make generate`
// writes it into manifests/components/monitoring/dashboard.json.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"pvbridge.io/e2e/monitoring"
)

func main() {
	d, err := monitoring.Dashboard()
	if err == nil {
		var out []byte
		if out, err = json.MarshalIndent(d, "", "  "); err == nil {
			_, err = fmt.Println(string(out))
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "dashboard:", err)
		os.Exit(1)
	}
}
