// Command apiref writes docs/api-reference.md from the CRDs in manifests/crd (make generate).
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"pvbridge.io/e2e/apiref"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "apiref:", err)
		os.Exit(1)
	}
}

func run() error {
	crds, err := apiref.Load(filepath.Join("manifests", "crd", "bases"), filepath.Join("manifests", "crd", "infrastructure"))
	if err != nil {
		return err
	}
	out, err := os.Create(filepath.Join("docs", "api-reference.md"))
	if err != nil {
		return err
	}
	if err := apiref.Render(out, crds); err != nil {
		_ = out.Close()
		return err
	}
	return out.Close()
}
