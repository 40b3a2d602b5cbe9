//go:build !tessera_k8s_1_36

package testplugin

import (
	"context"

	"k8s.io/dynamic-resource-allocation/kubeletplugin"
)

// WatchHealthStatus is part of the plugin interface since 1.37's helper
// (the DRAResourceHealth service it serves by default). The test plugin
// reports no health: ErrHealthNotSupported makes the helper answer the
// kubelet's watch with Unimplemented, so the kubelet stops asking.
// 1.36's helper has neither; cluster.sh builds it with the tag
// tessera_k8s_1_36, which leaves this file out.
func (p *plugin) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}
