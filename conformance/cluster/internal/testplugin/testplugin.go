// Package testplugin is a trivial DRA kubelet plugin built on the upstream
// helper library. It lets the harness prove the kubelet's DRA path (plugin
// registration, NodePrepareResources, NodeUnprepareResources) independently
// of Tessera's own driver: it publishes N plain devices for its node, answers
// prepare with one made-up CDI id per allocated device, and appends every
// call it gets to a JSON-lines record file that tests read.
package testplugin

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"
)

type options struct {
	driver      string
	node        string
	kubeconfig  string
	registryDir string
	pluginsDir  string
	devices     int
	record      string
	cdiDir      string
}

// Record is one line of the record file.
type Record struct {
	Time      time.Time `json:"time"`
	Op        string    `json:"op"` // "prepare" or "unprepare"
	Namespace string    `json:"namespace"`
	Name      string    `json:"name"`
	UID       string    `json:"uid"`
	Devices   []string  `json:"devices,omitempty"`
}

// NewCommand returns the `test-dra-plugin` subcommand.
func NewCommand() *cobra.Command {
	o := options{}
	cmd := &cobra.Command{
		Use:          "test-dra-plugin",
		Short:        "Run a trivial DRA kubelet plugin that records the kubelet's calls",
		SilenceUsage: true,
		Args:         cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			return run(o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.driver, "driver-name", "", "DRA driver name (required)")
	f.StringVar(&o.node, "node-name", "", "node the plugin runs for (required)")
	f.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig (required)")
	f.StringVar(&o.registryDir, "registry-dir", "", "kubelet plugin registration directory (required)")
	f.StringVar(&o.pluginsDir, "plugins-dir", "", "kubelet plugins directory; the socket goes to <dir>/<driver> (required)")
	f.IntVar(&o.devices, "devices", 2, "number of devices to publish (dev-0, dev-1, ...); 0 publishes nothing")
	f.StringVar(&o.record, "record", "", "file to append one JSON line per prepared/unprepared claim to (required)")
	f.StringVar(&o.cdiDir, "cdi-dir", "", "directory the container runtime reads CDI specs from (required)")
	for _, n := range []string{"driver-name", "node-name", "kubeconfig", "registry-dir", "plugins-dir", "record", "cdi-dir"} {
		_ = cmd.MarkFlagRequired(n)
	}
	return cmd
}

type plugin struct {
	driver string
	mu     sync.Mutex
	out    *os.File
}

func (p *plugin) write(r Record) error {
	r.Time = time.Now().UTC()
	line, err := json.Marshal(r)
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, err := p.out.Write(append(line, '\n')); err != nil {
		return err
	}
	return p.out.Sync()
}

func (p *plugin) PrepareResourceClaims(_ context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	result := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, c := range claims {
		var devs []kubeletplugin.Device
		var names []string
		if c.Status.Allocation != nil {
			for _, r := range c.Status.Allocation.Devices.Results {
				if r.Driver != p.driver {
					continue
				}
				devs = append(devs, kubeletplugin.Device{
					Requests:     []string{r.Request},
					PoolName:     r.Pool,
					DeviceName:   r.Device,
					CDIDeviceIDs: []string{p.driver + "/device=" + r.Device},
				})
				names = append(names, r.Device)
			}
		}
		err := p.write(Record{Op: "prepare", Namespace: c.Namespace, Name: c.Name, UID: string(c.UID), Devices: names})
		result[c.UID] = kubeletplugin.PrepareResult{Err: err, Devices: devs}
	}
	return result, nil
}

func (p *plugin) UnprepareResourceClaims(_ context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	result := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		result[c.UID] = p.write(Record{Op: "unprepare", Namespace: c.Namespace, Name: c.Name, UID: string(c.UID)})
	}
	return result, nil
}

func (p *plugin) HandleError(_ context.Context, err error, msg string) {
	fmt.Fprintf(os.Stderr, "test-dra-plugin: %s: %v\n", msg, err)
}

func run(o options) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", o.kubeconfig)
	if err != nil {
		return err
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	out, err := os.OpenFile(o.record, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer out.Close()
	dataDir := filepath.Join(o.pluginsDir, o.driver)
	for _, d := range []string{o.registryDir, dataDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return err
		}
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer cancel()

	spec, err := writeCDISpec(o.cdiDir, o.driver, o.devices)
	if err != nil {
		return err
	}
	defer os.Remove(spec)

	p := &plugin{driver: o.driver, out: out}
	helper, err := kubeletplugin.Start(ctx, p,
		kubeletplugin.KubeClient(cs),
		kubeletplugin.DriverName(o.driver),
		kubeletplugin.NodeName(o.node),
		kubeletplugin.RegistrarDirectoryPath(o.registryDir),
		kubeletplugin.PluginDataDirectoryPath(dataDir),
	)
	if err != nil {
		return fmt.Errorf("start plugin: %w", err)
	}
	defer helper.Stop()

	if o.devices > 0 {
		devices := make([]resourceapi.Device, o.devices)
		for i := range devices {
			devices[i] = resourceapi.Device{
				Name: fmt.Sprintf("dev-%d", i),
				Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
					"index": {IntValue: ptr.To(int64(i))},
				},
			}
		}
		res := resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
			o.node: {Slices: []resourceslice.Slice{{Devices: devices}}},
		}}
		if err := helper.PublishResources(ctx, res); err != nil {
			return fmt.Errorf("publish resources: %w", err)
		}
	}
	fmt.Fprintf(os.Stderr, "test-dra-plugin %s serving for node %s (registration in %s)\n", o.driver, o.node, o.registryDir)
	<-ctx.Done()
	// Best effort: leave no slices behind for a driver that is gone.
	delCtx, delCancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer delCancel()
	_ = cs.ResourceV1().ResourceSlices().DeleteCollection(delCtx, metav1.DeleteOptions{},
		metav1.ListOptions{FieldSelector: resourceapi.ResourceSliceSelectorDriver + "=" + o.driver})
	return nil
}

// writeCDISpec writes the spec of this driver's devices, atomically, so the
// runtime never reads half a file. Returns its path.
func writeCDISpec(dir, driver string, n int) (string, error) {
	type edits struct {
		Env []string `json:"env"`
	}
	type device struct {
		Name           string `json:"name"`
		ContainerEdits edits  `json:"containerEdits"`
	}
	spec := struct {
		Version string   `json:"cdiVersion"`
		Kind    string   `json:"kind"`
		Devices []device `json:"devices"`
	}{Version: "0.6.0", Kind: driver + "/device"}
	for i := 0; i < n; i++ {
		name := fmt.Sprintf("dev-%d", i)
		spec.Devices = append(spec.Devices, device{Name: name, ContainerEdits: edits{Env: []string{"TESSERA_TEST_DEVICE=" + name}}})
	}
	data, err := json.Marshal(spec)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	path := filepath.Join(dir, driver+".json")
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return "", err
	}
	return path, os.Rename(tmp, path)
}
