// Command images builds the container images the manifests name, without a container engine
// and without pulling anything: pvbridge's four binaries on the Debian programs they run, and
// the pinned CSI sidecars and snapshot-controller the lab builds (hack/build-tools.sh), tagged
// as manifests/components/images sets. Each image is an OCI archive in --out; the same sources
// and packages give the same digests. --lab adds the images only the lab needs (pause, busybox).
package main

import (
	"flag"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"pvbridge.io/e2e/images"
)

func main() {
	o := images.Options{}
	flag.StringVar(&o.Out, "out", filepath.Join(os.Getenv("PVBRIDGE_CACHE"), "images"), "directory of the OCI archives")
	flag.StringVar(&o.Root, "root", envOr("PVBRIDGE_ROOT", "."), "pvbridge's repository")
	flag.StringVar(&o.Bin, "bin", os.Getenv("PVBRIDGE_BIN"), "directory of the pinned third-party binaries (make tools)")
	lab := flag.Bool("lab", false, "also build the images only the lab needs")
	kubeadm := flag.String("kubeadm", "", "also build the images kubeadm init runs: <Kubernetes version>,<etcd tag>,<CoreDNS tag>")
	version := flag.Bool("version", false, "print pvbridge's version (the tag of its images in the manifests) and build nothing")
	flag.Parse()
	if *version {
		v, err := images.Version(o.Root)
		if err != nil {
			fmt.Fprintln(os.Stderr, "images:", err)
			os.Exit(1)
		}
		fmt.Println(v)
		return
	}
	if err := run(o, *lab, *kubeadm); err != nil {
		fmt.Fprintln(os.Stderr, "images:", err)
		os.Exit(1)
	}
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func run(o images.Options, lab bool, kubeadm string) error {
	var err error
	if o.Tags, err = images.Tags(filepath.Join(o.Root, images.TagsFile)); err != nil {
		return err
	}
	for _, name := range slices.Sorted(maps.Keys(o.Tags)) {
		if !slices.ContainsFunc(images.Catalogue, func(i images.Image) bool { return i.Name == name }) {
			return fmt.Errorf("the manifests name %s, which no image of the catalogue builds", name)
		}
	}
	imgs := images.Catalogue
	if lab {
		more, err := images.LabImages()
		if err != nil {
			return err
		}
		imgs = append(slices.Clone(imgs), more...)
	}
	if kubeadm != "" {
		tags := strings.Split(kubeadm, ",")
		if len(tags) != 3 {
			return fmt.Errorf("--kubeadm %q: want <Kubernetes version>,<etcd tag>,<CoreDNS tag>", kubeadm)
		}
		imgs = append(slices.Clone(imgs), images.KubeadmImages(tags[0], tags[1], tags[2])...)
	}
	built, err := images.BuildAll(o, imgs)
	if err != nil {
		return err
	}
	var list strings.Builder
	for _, b := range built {
		fi, err := os.Stat(b.File)
		if err != nil {
			return err
		}
		fmt.Printf("%-56s %s %4d MiB\n", b.Ref, b.Digest, fi.Size()>>20)
		fmt.Fprintf(&list, "%s %s %s\n", b.Ref, b.Digest, b.File)
	}
	fmt.Println("archives in", o.Out)
	return os.WriteFile(filepath.Join(o.Out, "images.txt"), []byte(list.String()), 0o644)
}
