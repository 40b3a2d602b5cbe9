// Package fakenodes registers Node objects that have no kubelet behind them
// and keeps them Ready by renewing their leases, so that scheduler-scale tests
// can place pods on many nodes on a small machine.
package fakenodes

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
)

// Label set on every node this command registers.
const Label = "tessera.dev/fake-node"

type options struct {
	kubeconfig string
	prefix     string
	start      int
	count      int
	cpu        string
	memory     string
	pods       string
	renew      time.Duration
}

// NewCommand returns the `fake-nodes` subcommand.
func NewCommand() *cobra.Command {
	o := options{}
	cmd := &cobra.Command{
		Use:          "fake-nodes",
		Short:        "Register Ready nodes without a kubelet and renew their leases until terminated",
		SilenceUsage: true,
		Args:         cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			return run(o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.kubeconfig, "kubeconfig", "", "admin kubeconfig (required)")
	f.StringVar(&o.prefix, "prefix", "tessera-fake-", "node name prefix")
	f.IntVar(&o.start, "start-index", 0, "index of the first node")
	f.IntVar(&o.count, "count", 1, "number of nodes")
	f.StringVar(&o.cpu, "cpu", "32", "allocatable cpu per node")
	f.StringVar(&o.memory, "memory", "256Gi", "allocatable memory per node")
	f.StringVar(&o.pods, "pods", "110", "allocatable pods per node")
	f.DurationVar(&o.renew, "renew-interval", 10*time.Second, "lease renewal interval")
	_ = cmd.MarkFlagRequired("kubeconfig")
	return cmd
}

func run(o options) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", o.kubeconfig)
	if err != nil {
		return err
	}
	cfg.QPS, cfg.Burst = 100, 200
	cfg.UserAgent = "tessera-fake-nodes"
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	alloc := corev1.ResourceList{}
	for name, v := range map[corev1.ResourceName]string{corev1.ResourceCPU: o.cpu, corev1.ResourceMemory: o.memory, corev1.ResourcePods: o.pods} {
		q, err := resource.ParseQuantity(v)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		alloc[name] = q
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer cancel()

	names := make([]string, o.count)
	for i := range names {
		names[i] = fmt.Sprintf("%s%d", o.prefix, o.start+i)
	}
	if err := forEach(ctx, names, func(name string) error { return register(ctx, cs, name, alloc) }); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "registered %d nodes %s%d..%s%d\n", o.count, o.prefix, o.start, o.prefix, o.start+o.count-1)

	t := time.NewTicker(o.renew)
	defer t.Stop()
	for {
		if err := forEach(ctx, names, func(name string) error { return renew(ctx, cs, name) }); err != nil && ctx.Err() == nil {
			fmt.Fprintf(os.Stderr, "lease renewal: %v\n", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// forEach runs fn over names with bounded concurrency and returns the first error.
func forEach(ctx context.Context, names []string, fn func(string) error) error {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	sem := make(chan struct{}, 16)
	for _, n := range names {
		if ctx.Err() != nil {
			break
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			if err := fn(n); err != nil {
				mu.Lock()
				if first == nil {
					first = fmt.Errorf("%s: %w", n, err)
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return first
}

func register(ctx context.Context, cs kubernetes.Interface, name string, alloc corev1.ResourceList) error {
	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name: name,
			Labels: map[string]string{
				"kubernetes.io/hostname": name,
				"kubernetes.io/os":       "linux",
				"kubernetes.io/arch":     "amd64",
				Label:                    "true",
			},
		},
	}
	if _, err := cs.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	now := metav1.Now()
	status := corev1.NodeStatus{
		Capacity:    alloc,
		Allocatable: alloc,
		Phase:       corev1.NodeRunning,
		NodeInfo:    corev1.NodeSystemInfo{OperatingSystem: "linux", Architecture: "amd64", KubeletVersion: "fake"},
		Conditions: []corev1.NodeCondition{
			{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "FakeNodeReady", Message: "no kubelet; kept Ready by tessera-kube fake-nodes", LastHeartbeatTime: now, LastTransitionTime: now},
			{Type: corev1.NodeMemoryPressure, Status: corev1.ConditionFalse, Reason: "FakeNode", LastHeartbeatTime: now, LastTransitionTime: now},
			{Type: corev1.NodeDiskPressure, Status: corev1.ConditionFalse, Reason: "FakeNode", LastHeartbeatTime: now, LastTransitionTime: now},
			{Type: corev1.NodePIDPressure, Status: corev1.ConditionFalse, Reason: "FakeNode", LastHeartbeatTime: now, LastTransitionTime: now},
		},
	}
	// A merge patch of the status subresource: controllers (node lifecycle,
	// taints) update the node concurrently, so a read-modify-write would
	// conflict.
	patch, err := json.Marshal(map[string]any{"status": status})
	if err != nil {
		return err
	}
	if _, err := cs.CoreV1().Nodes().Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}, "status"); err != nil {
		return err
	}
	return renew(ctx, cs, name)
}

// renew creates or refreshes the node's Lease in kube-node-lease, which is
// what the node lifecycle controller watches to keep a node Ready.
func renew(ctx context.Context, cs kubernetes.Interface, name string) error {
	leases := cs.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	now := metav1.NewMicroTime(time.Now())
	lease, err := leases.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = leases.Create(ctx, &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: coordinationv1.LeaseSpec{
				HolderIdentity:       ptr.To(name),
				LeaseDurationSeconds: ptr.To[int32](40),
				RenewTime:            &now,
			},
		}, metav1.CreateOptions{})
		return err
	}
	if err != nil {
		return err
	}
	lease.Spec.RenewTime = &now
	_, err = leases.Update(ctx, lease, metav1.UpdateOptions{})
	return err
}
