// Command tessera-kube is a single multi-call binary that runs the Kubernetes
// components of Tessera's local test control plane. Each subcommand hands its
// arguments to the upstream component's own cobra command, so the behaviour is
// exactly that of the released component; only one link step is needed for all
// of them.
//
// Usage: tessera-kube <component> [flags...]
package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"

	kubectlcmd "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"

	"tessera.dev/cluster/internal/certs"
	"tessera.dev/cluster/internal/crireset"
	"tessera.dev/cluster/internal/etcd"
	"tessera.dev/cluster/internal/fakenodes"
	"tessera.dev/cluster/internal/testplugin"
)

// component builds the cobra command of one subcommand. Only the selected
// component is constructed, so flag registrations of the others never run.
type component struct {
	help string
	run  func() int
}

func runCobra(cmd *cobra.Command) int {
	return cli.Run(cmd)
}

var components = map[string]component{
	"etcd": {"embedded etcd server (go.etcd.io/etcd/server/v3/embed)", func() int {
		return runCobra(etcd.NewCommand())
	}},
	"kube-apiserver": {"upstream kube-apiserver", func() int {
		return runCobra(apiserver.NewAPIServerCommand())
	}},
	"kube-controller-manager": {"upstream kube-controller-manager", func() int {
		return runCobra(controllermanager.NewControllerManagerCommand())
	}},
	"kube-scheduler": {"upstream kube-scheduler", func() int {
		return runCobra(scheduler.NewSchedulerCommand())
	}},
	"kubelet": {"upstream kubelet", func() int {
		return runCobra(kubelet.NewKubeletCommand(context.Background()))
	}},
	"kubectl": {"upstream kubectl", func() int {
		cmd := kubectlcmd.NewDefaultKubectlCommand()
		if err := cli.RunNoErrOutput(cmd); err != nil {
			kubectlutil.CheckErr(err)
		}
		return 0
	}},
	"certs": {"generate the cluster PKI and kubeconfigs", func() int {
		return runCobra(certs.NewCommand())
	}},
	"cri-reset": {"stop and remove every pod sandbox of a CRI runtime (cluster stop)", func() int {
		return runCobra(crireset.NewCommand())
	}},
	"fake-nodes": {"register Ready nodes without a kubelet and keep their leases fresh", func() int {
		return runCobra(fakenodes.NewCommand())
	}},
	"test-dra-plugin": {"trivial DRA kubelet plugin that records prepare/unprepare calls (tests)", func() int {
		return runCobra(testplugin.NewCommand())
	}},
	"free-ports": {"print N currently free TCP ports on 127.0.0.1", func() int {
		return runCobra(freePortsCommand())
	}},
}

// freePortsCommand asks the kernel for N distinct unused loopback ports. All
// listeners are held open until every port is known, so the ports differ.
func freePortsCommand() *cobra.Command {
	return &cobra.Command{
		Use:          "free-ports N",
		Short:        "Print N free TCP ports on 127.0.0.1, one per line",
		SilenceUsage: true,
		Args:         cobra.ExactArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			n, err := strconv.Atoi(args[0])
			if err != nil || n < 1 || n > 64 {
				return fmt.Errorf("N must be an integer in 1..64, got %q", args[0])
			}
			ls := make([]net.Listener, 0, n)
			defer func() {
				for _, l := range ls {
					_ = l.Close()
				}
			}()
			for range n {
				l, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					return err
				}
				ls = append(ls, l)
				fmt.Println(l.Addr().(*net.TCPAddr).Port)
			}
			return nil
		},
	}
}

func usage() {
	names := make([]string, 0, len(components))
	for n := range components {
		names = append(names, n)
	}
	sort.Strings(names)
	fmt.Fprintf(os.Stderr, "usage: %s <component> [flags]\n\ncomponents:\n", filepath.Base(os.Args[0]))
	for _, n := range names {
		fmt.Fprintf(os.Stderr, "  %-24s %s\n", n, components[n].help)
	}
}

func main() {
	// Also allow being invoked through a symlink named after a component.
	name := filepath.Base(os.Args[0])
	args := os.Args[1:]
	if _, ok := components[name]; !ok {
		if len(args) == 0 || strings.HasPrefix(args[0], "-") {
			usage()
			os.Exit(2)
		}
		name, args = args[0], args[1:]
	}
	c, ok := components[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "unknown component %q\n\n", name)
		usage()
		os.Exit(2)
	}
	// The upstream commands read os.Args (cobra, kubectl plugin lookup), so
	// present them exactly as the standalone binary would see them.
	os.Args = append([]string{name}, args...)
	os.Exit(c.run())
}
