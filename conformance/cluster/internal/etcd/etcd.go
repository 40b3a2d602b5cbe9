// Package etcd runs a single-member etcd server embedded in this process.
package etcd

import (
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/embed"
)

// NewCommand returns the `etcd` subcommand.
func NewCommand() *cobra.Command {
	var (
		dataDir   string
		clientURL string
		peerURL   string
		logLevel  string
		fsync     bool
	)
	cmd := &cobra.Command{
		Use:          "etcd",
		Short:        "Run a single-member embedded etcd for the test control plane",
		SilenceUsage: true,
		Args:         cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			cu, err := url.Parse(clientURL)
			if err != nil {
				return fmt.Errorf("--listen-client-url: %w", err)
			}
			pu, err := url.Parse(peerURL)
			if err != nil {
				return fmt.Errorf("--listen-peer-url: %w", err)
			}
			cfg := embed.NewConfig()
			cfg.Name = "tessera"
			cfg.Dir = dataDir
			cfg.ListenClientUrls = []url.URL{*cu}
			cfg.AdvertiseClientUrls = []url.URL{*cu}
			cfg.ListenPeerUrls = []url.URL{*pu}
			cfg.AdvertisePeerUrls = []url.URL{*pu}
			cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
			cfg.LogLevel = logLevel
			cfg.LogOutputs = []string{"stderr"}
			// A throw-away test cluster: durability is not worth the fsync
			// latency on a small machine.
			cfg.UnsafeNoFsync = !fsync
			cfg.AutoCompactionMode = "periodic"
			cfg.AutoCompactionRetention = "5m"
			// NewConfig leaves this at zero (etcd's own flag parsing sets
			// it), which logs every single request as "expensive".
			cfg.WarningUnaryRequestDuration = embed.DefaultWarningUnaryRequestDuration

			e, err := embed.StartEtcd(cfg)
			if err != nil {
				return fmt.Errorf("start etcd: %w", err)
			}
			defer e.Close()
			select {
			case <-e.Server.ReadyNotify():
				fmt.Fprintf(os.Stderr, "etcd ready, serving clients on %s\n", cu)
			case <-time.After(60 * time.Second):
				e.Server.Stop()
				return fmt.Errorf("etcd did not become ready within 60s")
			}
			sig := make(chan os.Signal, 1)
			signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
			select {
			case s := <-sig:
				fmt.Fprintf(os.Stderr, "etcd: got %s, shutting down\n", s)
				return nil
			case err := <-e.Err():
				return err
			}
		},
	}
	f := cmd.Flags()
	f.StringVar(&dataDir, "data-dir", "", "etcd data directory (required)")
	f.StringVar(&clientURL, "listen-client-url", "http://127.0.0.1:2379", "client URL to listen on and advertise")
	f.StringVar(&peerURL, "listen-peer-url", "http://127.0.0.1:2380", "peer URL to listen on and advertise")
	f.StringVar(&logLevel, "log-level", "warn", "debug, info, warn, error")
	f.BoolVar(&fsync, "fsync", false, "fsync writes (off by default: test data is disposable)")
	_ = cmd.MarkFlagRequired("data-dir")
	return cmd
}
