// Command charts writes pvbridge's Helm charts into charts/ from the kustomize overlays
// (e2e/charts; make generate), or, with -check, renders each with helm and fails unless it
// makes the objects of its overlay (make verify).
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"pvbridge.io/e2e/charts"
)

func main() {
	bin := os.Getenv("PVBRIDGE_BIN") // make sets it; hack/build-tools.sh's default otherwise
	if bin == "" {
		cache, _ := os.UserCacheDir()
		bin = filepath.Join(cache, "pvbridge", "bin")
	}
	root := flag.String("root", ".", "the repository")
	kubectl := flag.String("kubectl", filepath.Join(bin, "kubectl"), "the pinned kubectl")
	helm := flag.String("helm", filepath.Join(bin, "helm"), "the pinned helm (with -check)")
	check := flag.Bool("check", false, "check the charts in charts/ instead of writing them")
	flag.Parse()
	for _, c := range charts.Charts {
		dir := filepath.Join(*root, "charts", c.Name)
		var err error
		if *check {
			err = c.Check(*helm, *kubectl, *root, dir)
		} else {
			var files charts.Files
			if files, err = c.Make(*kubectl, *root); err == nil {
				err = files.Write(dir)
			}
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "charts:", err)
			os.Exit(1)
		}
	}
}
