// Package fakecri serves a minimal in-memory CRI runtime and image service on
// a unix socket so that a real kubelet can "run" pods without any containers.
// Sandboxes and containers only exist as records; a started container reports
// the Running state, which is all the control plane needs to observe.
package fakecri

import (
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	criFake "k8s.io/cri-client/pkg/fake"
)

// NewCommand returns the `fake-cri` subcommand.
func NewCommand() *cobra.Command {
	var (
		socket   string
		imageDir string
	)
	cmd := &cobra.Command{
		Use:          "fake-cri",
		Short:        "Serve a fake CRI runtime + image service on a unix socket",
		SilenceUsage: true,
		Args:         cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			path := strings.TrimPrefix(socket, "unix://")
			if !filepath.IsAbs(path) {
				return fmt.Errorf("--socket must be an absolute path, got %q", socket)
			}
			if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
				return err
			}
			// A stale socket from a killed run would make listen fail.
			if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
				return err
			}
			rt := criFake.NewFakeRemoteRuntime()
			// Any image "pulls" instantly; the kubelet rejects images without
			// a size, so give every one a nominal size.
			rt.ImageService.SetFakeImageSize(1 << 20)
			if imageDir != "" {
				if err := os.MkdirAll(imageDir, 0o750); err != nil {
					return err
				}
				// The kubelet's image GC and eviction manager look up the
				// image filesystem by mountpoint; give them a real directory.
				usage := []*runtimeapi.FilesystemUsage{{
					Timestamp:  1,
					FsId:       &runtimeapi.FilesystemIdentifier{Mountpoint: imageDir},
					UsedBytes:  &runtimeapi.UInt64Value{Value: 0},
					InodesUsed: &runtimeapi.UInt64Value{Value: 0},
				}}
				rt.ImageService.SetFakeFilesystemUsage(usage)
				rt.ImageService.SetFakeContainerFilesystemUsage(usage)
			}
			if err := rt.Start("unix://" + path); err != nil {
				return err
			}
			defer func() {
				rt.Stop()
				_ = os.Remove(path)
			}()
			fmt.Fprintf(os.Stderr, "fake CRI serving on unix://%s\n", path)
			sig := make(chan os.Signal, 1)
			signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
			s := <-sig
			fmt.Fprintf(os.Stderr, "fake-cri: got %s, shutting down\n", s)
			return nil
		},
	}
	cmd.Flags().StringVar(&socket, "socket", "", "unix socket path to serve on (required)")
	cmd.Flags().StringVar(&imageDir, "image-dir", "", "directory reported as the image filesystem")
	_ = cmd.MarkFlagRequired("socket")
	return cmd
}
