package images

import (
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"sigs.k8s.io/yaml"
)

// fsPrograms are what a node plugin runs to format, check, grow and mount filesystems
// (k8s.io/mount-utils) and to read a device's size and signature.
var fsPrograms = []string{
	"mount", "umount", "blkid", "blockdev",
	"mkfs.ext4", "fsck", "fsck.ext4", "e2fsck", "resize2fs", "dumpe2fs",
	"mkfs.xfs", "fsck.xfs", "xfs_repair", "xfs_growfs", "xfs_io",
}

// Image is one image `make images` builds: what goes in it, not yet where it comes from.
type Image struct {
	// Name is the reference without the tag, as the manifests name it.
	Name string
	// Tag is the image's tag when the manifests do not set it (the lab's own images).
	Tag string
	// Package is the Go package of a pvbridge binary, relative to the repository.
	Package string
	// Tool is the name of a pinned third-party binary the lab builds (hack/build-tools.sh).
	Tool string
	// User is "0" where one of the image's roles needs root, else Nonroot.
	User string
	// Programs come from Debian packages (see Host).
	Programs []string
	// Extra are more entries of the programs' layer.
	Extra []Entry
	// Cmd is the default command.
	Cmd []string
	// Source is the image's source repository (org.opencontainers.image.source).
	Source string
}

const pvbridgeSource = "https://github.com/pvbridge/pvbridge"

// Catalogue lists every image the manifests name. pvbridge's node plugins and the host agent run
// as root (mounts, loop devices, PMEM namespaces, the hypervisor); their controllers run as
// nonroot through the manifests' securityContext. The sidecars run as nonroot.
var Catalogue = []Image{
	{Name: "ghcr.io/pvbridge/guest-csi", Package: "./guest-csi/cmd/guest-csi", User: "0", Programs: fsPrograms, Source: pvbridgeSource},
	{Name: "ghcr.io/pvbridge/guest-csi-tenants", Package: "./guest-csi/cmd/guest-csi-tenants", User: Nonroot, Source: pvbridgeSource},
	{
		Name: "ghcr.io/pvbridge/mgmt-csi", Package: "./mgmt-csi/cmd/mgmt-csi", User: "0", Source: pvbridgeSource,
		Programs: append([]string{
			"losetup", "truncate", // file mode
			"lvcreate", "lvchange", "lvextend", "lvremove", "lvs", "vgs", // lvm mode
			"ndctl", // ndctl mode
			// Replicated volumes: the replica server and the targets, with the libfuse3 and
			// GnuTLS it links; the targets' FUSE exports need only the host's /dev/fuse.
			"qemu-storage-daemon",
		}, fsPrograms...),
	},
	{
		Name: "ghcr.io/pvbridge/vm-operator", Package: "./vm-operator/cmd/vm-operator", User: "0", Source: pvbridgeSource,
		// The qemu hypervisor driver: QEMU, its TCG accelerator module and its firmware, and
		// qemu-img, which makes each VM's overlay of its boot image. The
		// local driver's throttled disks: qemu-storage-daemon, with the libfuse3 it links; as
		// root its FUSE export mounts without fusermount3, and it needs only the host's
		// /dev/fuse, which the privileged host agent has with the host's /dev.
		Programs: []string{
			"qemu-system-x86_64", "/usr/lib/x86_64-linux-gnu/qemu/accel-tcg-x86_64.so", "/usr/share/qemu", "/usr/share/seabios",
			"qemu-storage-daemon", "qemu-img",
		},
	},
	{Name: "registry.k8s.io/sig-storage/csi-provisioner", Tool: "csi-provisioner", User: Nonroot, Source: "https://github.com/kubernetes-csi/external-provisioner"},
	{Name: "registry.k8s.io/sig-storage/csi-attacher", Tool: "csi-attacher", User: Nonroot, Source: "https://github.com/kubernetes-csi/external-attacher"},
	{Name: "registry.k8s.io/sig-storage/csi-resizer", Tool: "csi-resizer", User: Nonroot, Source: "https://github.com/kubernetes-csi/external-resizer"},
	{Name: "registry.k8s.io/sig-storage/csi-snapshotter", Tool: "csi-snapshotter", User: Nonroot, Source: "https://github.com/kubernetes-csi/external-snapshotter"},
	{Name: "registry.k8s.io/sig-storage/snapshot-controller", Tool: "snapshot-controller", User: Nonroot, Source: "https://github.com/kubernetes-csi/external-snapshotter"},
}

// LabImages are what the lab's nodes run besides the manifests' images, which no registry serves
// here: the pod sandbox (pause) and the busybox of test pods, from Debian's busybox-static.
func LabImages() ([]Image, error) {
	bb, err := busybox("docker.io/library/busybox", "latest")
	if err != nil {
		return nil, err
	}
	return []Image{
		{Name: "registry.k8s.io/pause", Tag: "3.10.2", Package: "./e2e/cmd/pause", User: "65535:65535", Source: pvbridgeSource},
		bb,
	}, nil
}

// notApplets are the programs a busybox image takes from Debian instead of busybox's applets:
// the storage tests write block volumes with `dd oflag=nocache`, which busybox's dd lacks, and
// sh is bash, because Debian's busybox sh runs its own applets before looking at PATH. Not
// dash: the tests' scripts use `let` (volumeIO's init container counts with it), which dash
// lacks, and a loop that never counts up fills the volume until the test times out.
var notApplets = []string{"dd", "sh"}

// busybox is an image of Debian's busybox-static with every applet but notApplets, which come
// from coreutils and bash, run as root with sh.
func busybox(name, tag string) (Image, error) {
	out, err := exec.Command("busybox", "--list-full").Output()
	if err != nil {
		return Image{}, fmt.Errorf("busybox --list-full (Debian package busybox-static): %w", err)
	}
	applets := []Entry{Symlink("/usr/bin/sh", "/usr/bin/bash")}
	for _, a := range strings.Fields(string(out)) {
		p := "/usr/" + strings.TrimPrefix(a, "usr/")
		if p != "/usr/bin/busybox" && !slices.Contains(notApplets, path.Base(p)) {
			applets = append(applets, Symlink(p, "/usr/bin/busybox"))
		}
	}
	return Image{
		Name: name, Tag: tag, User: "0", Programs: []string{"busybox", "bash", "dd"}, Extra: applets,
		Cmd: []string{"sh"}, Source: "https://packages.debian.org/bookworm/busybox-static",
	}, nil
}

// ConformanceImages are the images Kubernetes' storage tests run, as e2e.test names them (refs,
// from `e2e.test --list-images`): agnhost is the one the lab builds at the pinned Kubernetes
// version (hack/build-tools.sh), at /agnhost as upstream's, on busybox's applets (the tests run
// shell scripts in its containers too); busybox is Debian's; nginx and glibc-dns-testing, in
// which the storage tests only run shell scripts, are busybox too. Other refs are not built.
func ConformanceImages(refs []string) ([]Image, error) {
	var imgs []Image
	for _, ref := range refs {
		name, tag, ok := strings.Cut(ref, ":")
		if !ok || strings.Contains(tag, "/") {
			return nil, fmt.Errorf("image reference %q has no tag", ref)
		}
		base := path.Base(name)
		if !slices.Contains([]string{"busybox", "nginx", "glibc-dns-testing", "agnhost"}, base) {
			continue
		}
		img, err := busybox(name, tag)
		if err != nil {
			return nil, err
		}
		if base == "agnhost" {
			img.Tool, img.Cmd, img.Source = "agnhost", nil, "https://github.com/kubernetes/kubernetes/tree/master/test/images/agnhost"
			img.Extra = append(img.Extra, Symlink("/agnhost", "/usr/local/bin/agnhost"))
		}
		imgs = append(imgs, img)
	}
	return imgs, nil
}

// Tags reads the tag of each image from a kustomize images component (the manifests' one place
// for versions): name -> tag.
func Tags(component string) (map[string]string, error) {
	data, err := os.ReadFile(component)
	if err != nil {
		return nil, err
	}
	var k struct {
		Images []struct {
			Name    string `json:"name"`
			NewName string `json:"newName"`
			NewTag  string `json:"newTag"`
		} `json:"images"`
	}
	if err := yaml.Unmarshal(data, &k); err != nil {
		return nil, fmt.Errorf("%s: %w", component, err)
	}
	tags := map[string]string{}
	for _, i := range k.Images {
		if i.NewName != "" || i.NewTag == "" || strings.Contains(i.NewTag, "@") {
			return nil, fmt.Errorf("%s: image %s: only a newTag is expected", component, i.Name)
		}
		tags[i.Name] = i.NewTag
	}
	return tags, nil
}

// TagsFile is the kustomize images component below the repository's root that Tags reads.
var TagsFile = filepath.Join("manifests", "components", "images", "kustomization.yaml")

// ownImages is the prefix of pvbridge's own images.
const ownImages = "ghcr.io/pvbridge/"

// versionRE is a release version as the tags, the charts and clusterctl write it: vX.Y.Z, with an
// optional pre-release (v0.2.0-rc.1).
var versionRE = regexp.MustCompile(`^v(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[0-9A-Za-z.-]+)?$`)

// Version is pvbridge's version in the repository at root: the one tag the manifests give each
// of pvbridge's own images (Tags), stamped into its binaries and charts. Images of other tags,
// or a tag that is no version, are an error.
func Version(root string) (string, error) {
	tags, err := Tags(filepath.Join(root, TagsFile))
	if err != nil {
		return "", err
	}
	version := ""
	for _, name := range slices.Sorted(maps.Keys(tags)) {
		if !strings.HasPrefix(name, ownImages) {
			continue
		}
		if version != "" && tags[name] != version {
			return "", fmt.Errorf("%s: pvbridge's images have two tags, %s and %s (%s): one version tags them all", TagsFile, version, tags[name], name)
		}
		version = tags[name]
	}
	if !versionRE.MatchString(version) {
		return "", fmt.Errorf("%s: pvbridge's images are tagged %q, not a version vX.Y.Z", TagsFile, version)
	}
	return version, nil
}

// KubeadmImages are the images `kubeadm init` runs (the control plane as static pods, the
// kube-proxy and CoreDNS addons), built from the lab's pinned binaries and named as kubeadm
// names them for version (`kubeadm config images list`), etcd tagged etcdTag (the lab's etcd,
// which a cluster configuration's etcd.local.imageTag names) and CoreDNS corednsTag (the pinned
// CoreDNS is the one kubeadm deploys). kubeadm sets each container's command (or, for CoreDNS,
// its arguments), so no image has one. kube-proxy programs the Service rules with the
// iptables of this machine (nf_tables), whose extensions it loads from xtables/. CoreDNS runs
// as root: upstream's image runs it as nonroot with a file capability to bind port 53, which
// the lab's layers do not carry, and kubeadm's Deployment leaves it NET_BIND_SERVICE alone.
func KubeadmImages(version, etcdTag, corednsTag string) []Image {
	k8s := "https://github.com/kubernetes/kubernetes"
	return []Image{
		{Name: "registry.k8s.io/kube-apiserver", Tag: version, Tool: "kube-apiserver", User: "0", Source: k8s},
		{Name: "registry.k8s.io/kube-controller-manager", Tag: version, Tool: "kube-controller-manager", User: "0", Source: k8s},
		{Name: "registry.k8s.io/kube-scheduler", Tag: version, Tool: "kube-scheduler", User: "0", Source: k8s},
		{Name: "registry.k8s.io/etcd", Tag: etcdTag, Tool: "etcd", User: "0", Source: "https://github.com/etcd-io/etcd"},
		{
			Name: "registry.k8s.io/kube-proxy", Tag: version, Tool: "kube-proxy", User: "0", Source: k8s,
			Programs: []string{
				"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore",
				"/usr/lib/x86_64-linux-gnu/xtables",
			},
		},
		{Name: "registry.k8s.io/coredns/coredns", Tag: corednsTag, Tool: "coredns", User: "0", Source: "https://github.com/coredns/coredns"},
	}
}
