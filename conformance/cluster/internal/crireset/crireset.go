// Package crireset removes every pod sandbox (and so every container) from a
// CRI runtime. `cluster.sh stop` runs it after the kubelet is gone and before
// containerd stops: a stopped kubelet leaves its pods running, and their
// shims, mounts and network namespaces would outlive the cluster.
package crireset

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/spf13/cobra"
	"go.opentelemetry.io/otel/trace/noop"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg"
)

// NewCommand returns the `cri-reset` subcommand.
func NewCommand() *cobra.Command {
	var endpoint string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:          "cri-reset",
		Short:        "Stop and remove every pod sandbox of a CRI runtime",
		SilenceUsage: true,
		Args:         cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			defer cancel()
			return reset(ctx, endpoint, timeout)
		},
	}
	cmd.Flags().StringVar(&endpoint, "endpoint", "", "CRI endpoint, unix:///path (required)")
	cmd.Flags().DurationVar(&timeout, "timeout", 60*time.Second, "give up after this long")
	_ = cmd.MarkFlagRequired("endpoint")
	return cmd
}

func reset(ctx context.Context, endpoint string, timeout time.Duration) error {
	rs, err := cri.NewRemoteRuntimeService(ctx, endpoint, timeout, noop.NewTracerProvider(), false)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", endpoint, err)
	}
	sandboxes, err := rs.ListPodSandbox(ctx, &runtimeapi.PodSandboxFilter{})
	if err != nil {
		return fmt.Errorf("list pod sandboxes: %w", err)
	}
	var failed int
	for _, s := range sandboxes {
		name := s.GetMetadata().GetNamespace() + "/" + s.GetMetadata().GetName()
		// Stop tears down the network namespace; remove deletes the containers.
		if err := rs.StopPodSandbox(ctx, s.Id); err != nil {
			fmt.Fprintf(os.Stderr, "cri-reset: stop %s: %v\n", name, err)
		}
		if err := rs.RemovePodSandbox(ctx, s.Id); err != nil {
			fmt.Fprintf(os.Stderr, "cri-reset: remove %s: %v\n", name, err)
			failed++
		}
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d pod sandboxes could not be removed", failed, len(sandboxes))
	}
	fmt.Fprintf(os.Stderr, "cri-reset: removed %d pod sandboxes\n", len(sandboxes))
	return nil
}
