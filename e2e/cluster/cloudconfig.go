package cluster

import (
	"bytes"
	"compress/gzip"
	"encoding/base64"
	"fmt"
	"io"
	"net"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"

	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// CloudConfig is the part of a cloud-init cloud-config that a lab VM runs, as cloud-init runs it
// on first boot: the files, then the boot commands' and the run commands' shell lines. It is what
// Cluster API's kubeadm bootstrap provider writes (files, kubeadm init or join, the
// bootstrap-success sentinel). Other modules of cloud-init are not run; Unsupported names those
// the user data asked for.
type CloudConfig struct {
	WriteFiles []CloudFile `json:"write_files"`
	// BootCmd and RunCmd are commands: a string is a shell line, a list an argv.
	BootCmd []CloudCommand `json:"bootcmd"`
	RunCmd  []CloudCommand `json:"runcmd"`
	// Unsupported are the other top-level keys of the user data, sorted.
	Unsupported []string `json:"-"`
}

// CloudFile is one entry of write_files.
type CloudFile struct {
	Path        string `json:"path"`
	Content     string `json:"content"`
	Encoding    string `json:"encoding"`
	Permissions string `json:"permissions"`
	Owner       string `json:"owner"`
	Append      bool   `json:"append"`
}

// CloudCommand is a cloud-config command: Shell is a line for sh -c, else Argv is run as is.
type CloudCommand struct {
	Shell string
	Argv  []string
}

// UnmarshalJSON reads a string or a list of strings.
func (c *CloudCommand) UnmarshalJSON(data []byte) error {
	if err := yaml.Unmarshal(data, &c.Argv); err == nil {
		return nil
	}
	return yaml.Unmarshal(data, &c.Shell)
}

// Args returns the command line.
func (c CloudCommand) Args() []string {
	if c.Argv != nil {
		return c.Argv
	}
	return []string{"/bin/sh", "-c", c.Shell}
}

// jinjaMetaData is the only Jinja that Cluster API's templates use in a cloud-config:
// `{{ ds.meta_data.<key> }}`, the key with its dashes as underscores.
var jinjaMetaData = regexp.MustCompile(`\{\{\s*ds\.meta_data\.([A-Za-z0-9_]+)\s*\}\}`)

// ParseCloudConfig reads user data: a cloud-config ("#cloud-config" on its first line, or on
// the line after "## template: jinja", whose `{{ ds.meta_data.x }}` become the NoCloud
// meta-data's values). Any other user data (a script, a MIME archive) is refused.
func ParseCloudConfig(userData, metaData []byte) (*CloudConfig, error) {
	text := string(userData)
	first, rest, _ := strings.Cut(text, "\n")
	jinja := strings.TrimSpace(first) == "## template: jinja"
	if jinja {
		first, _, _ = strings.Cut(rest, "\n")
	}
	if strings.TrimSpace(first) != "#cloud-config" {
		return nil, fmt.Errorf("user data is not a cloud-config (first line %q)", first)
	}
	if jinja {
		meta := map[string]any{}
		if err := yaml.Unmarshal(metaData, &meta); err != nil {
			return nil, fmt.Errorf("meta-data: %w", err)
		}
		values := map[string]string{}
		for k, v := range meta {
			values[strings.ReplaceAll(k, "-", "_")] = fmt.Sprint(v)
		}
		var missing []string
		text = jinjaMetaData.ReplaceAllStringFunc(text, func(m string) string {
			key := jinjaMetaData.FindStringSubmatch(m)[1]
			v, ok := values[key]
			if !ok {
				missing = append(missing, key)
			}
			return v
		})
		if len(missing) > 0 {
			return nil, fmt.Errorf("user data uses meta-data the VM does not have: %s", strings.Join(missing, ", "))
		}
		if strings.Contains(text, "{{") || strings.Contains(text, "{%") {
			return nil, fmt.Errorf("user data has Jinja other than {{ ds.meta_data.<key> }}")
		}
	}
	var c CloudConfig
	if err := yaml.Unmarshal([]byte(text), &c); err != nil {
		return nil, fmt.Errorf("cloud-config: %w", err)
	}
	var keys map[string]any
	if err := yaml.Unmarshal([]byte(text), &keys); err != nil {
		return nil, fmt.Errorf("cloud-config: %w", err)
	}
	for k := range keys {
		if !slices.Contains([]string{"write_files", "bootcmd", "runcmd"}, k) {
			c.Unsupported = append(c.Unsupported, k)
		}
	}
	slices.Sort(c.Unsupported)
	for _, f := range c.WriteFiles {
		if !path.IsAbs(f.Path) {
			return nil, fmt.Errorf("write_files: path %q is not absolute", f.Path)
		}
		if _, err := f.Data(); err != nil {
			return nil, err
		}
		if _, err := f.Mode(); err != nil {
			return nil, err
		}
	}
	return &c, nil
}

// Data returns the file's content, decoded.
func (f CloudFile) Data() ([]byte, error) {
	switch f.Encoding {
	case "", "text/plain":
		return []byte(f.Content), nil
	case "b64", "base64":
		return base64.StdEncoding.DecodeString(f.Content)
	case "gz", "gzip":
		return gunzip([]byte(f.Content))
	case "gz+b64", "gzip+base64", "gz+base64", "gzip+b64":
		data, err := base64.StdEncoding.DecodeString(f.Content)
		if err != nil {
			return nil, fmt.Errorf("write_files %s: %w", f.Path, err)
		}
		return gunzip(data)
	}
	return nil, fmt.Errorf("write_files %s: unknown encoding %q", f.Path, f.Encoding)
}

func gunzip(data []byte) ([]byte, error) {
	r, err := gzip.NewReader(bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	return io.ReadAll(r)
}

// Mode returns the file's permissions (cloud-init's default 0644).
func (f CloudFile) Mode() (uint32, error) {
	if f.Permissions == "" {
		return 0o644, nil
	}
	m, err := strconv.ParseUint(f.Permissions, 8, 32)
	if err != nil || m > 0o7777 {
		return 0, fmt.Errorf("write_files %s: permissions %q are not octal", f.Path, f.Permissions)
	}
	return uint32(m), nil
}

// KeepsEndpoint says whether a control plane machine's data holds its endpoint's address itself,
// with keepalived among the control plane machines (cluster-template-ha.yaml): keepalived's
// configuration is among its files.
func (c *CloudConfig) KeepsEndpoint() bool {
	return slices.ContainsFunc(c.WriteFiles, func(f CloudFile) bool { return strings.HasPrefix(f.Path, "/etc/keepalived/") })
}

// ControlPlane returns the host of the control plane endpoint a control plane machine's data
// serves, and whether it is the first (kubeadm init: the endpoint of its ClusterConfiguration),
// or a joining one's (kubeadm join with a JoinConfiguration's controlPlane: the endpoint it
// discovers the cluster at); "" for a worker's data.
func (c *CloudConfig) ControlPlane() (endpoint string, first bool) {
	host := func(hostPort string) string {
		if h, _, err := net.SplitHostPort(hostPort); err == nil {
			return h
		}
		return hostPort
	}
	for _, f := range c.WriteFiles {
		data, err := f.Data()
		if err != nil {
			continue
		}
		dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
		for {
			var doc struct {
				Kind                 string    `json:"kind"`
				ControlPlaneEndpoint string    `json:"controlPlaneEndpoint"`
				ControlPlane         *struct{} `json:"controlPlane"`
				Discovery            struct {
					BootstrapToken struct {
						APIServerEndpoint string `json:"apiServerEndpoint"`
					} `json:"bootstrapToken"`
				} `json:"discovery"`
			}
			if err := dec.Decode(&doc); err != nil {
				break
			}
			switch {
			case doc.Kind == "ClusterConfiguration" && doc.ControlPlaneEndpoint != "":
				return host(doc.ControlPlaneEndpoint), true
			case doc.Kind == "JoinConfiguration" && doc.ControlPlane != nil && doc.Discovery.BootstrapToken.APIServerEndpoint != "":
				return host(doc.Discovery.BootstrapToken.APIServerEndpoint), false
			}
		}
	}
	return "", false
}
