// Package allocbench times the scheduler's own DRA allocator on the
// ResourceSlices Tessera publishes: what the scheduler's Filter pays per
// claim and node, without a cluster and its noise. The slices come from
// `tessera slices -o json` on a simulated node, the classes from
// deploy/deviceclasses.yaml; conformance/bench-allocator.sh runs it.
//
// Each benchmark fills the node: claims of one class, one device each,
// allocated one after another as the scheduler would place pods that
// arrive in turn, each result counted as allocated before the next.
package allocbench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/dynamic-resource-allocation/structured/schedulerapi"
	"sigs.k8s.io/yaml"
)

// The features of a 1.37 scheduler with its default gates and consumable
// capacity on (shares need it): the allocator it picks for them.
var features = structured.Features{
	AdminAccess:            true,
	ConsumableCapacity:     true,
	DeviceBindingAndStatus: true,
	DeviceTaints:           true,
	PartitionableDevices:   true,
	PrioritizedList:        true,
}

type classes map[string]*resourceapi.DeviceClass

func (c classes) List() ([]*resourceapi.DeviceClass, error) {
	out := make([]*resourceapi.DeviceClass, 0, len(c))
	for _, class := range c {
		out = append(out, class)
	}
	return out, nil
}

func (c classes) Get(name string) (*resourceapi.DeviceClass, error) {
	if class, ok := c[name]; ok {
		return class, nil
	}
	return nil, fmt.Errorf("no DeviceClass %s", name)
}

func inputs(b *testing.B) ([]*resourceapi.ResourceSlice, classes) {
	slicesFile, classesFile := os.Getenv("TESSERA_BENCH_SLICES"), os.Getenv("TESSERA_BENCH_CLASSES")
	if slicesFile == "" || classesFile == "" {
		b.Skip("TESSERA_BENCH_SLICES and TESSERA_BENCH_CLASSES not set (conformance/bench-allocator.sh sets them)")
	}
	raw, err := os.ReadFile(slicesFile)
	if err != nil {
		b.Fatal(err)
	}
	var list resourceapi.ResourceSliceList
	if err := json.Unmarshal(raw, &list); err != nil {
		b.Fatalf("%s: %v", slicesFile, err)
	}
	var slices []*resourceapi.ResourceSlice
	for i := range list.Items {
		slices = append(slices, &list.Items[i])
	}
	raw, err = os.ReadFile(classesFile)
	if err != nil {
		b.Fatal(err)
	}
	known := classes{}
	for _, doc := range bytes.Split(raw, []byte("\n---")) {
		var class resourceapi.DeviceClass
		if err := yaml.UnmarshalStrict(doc, &class); err != nil {
			b.Fatalf("%s: %v", classesFile, err)
		}
		if class.Name != "" {
			known[class.Name] = &class
		}
	}
	return slices, known
}

func claim(i int, class string, capacity map[resourceapi.QualifiedName]resource.Quantity) *resourceapi.ResourceClaim {
	request := &resourceapi.ExactDeviceRequest{
		DeviceClassName: class,
		AllocationMode:  resourceapi.DeviceAllocationModeExactCount,
		Count:           1,
	}
	if capacity != nil {
		request.Capacity = &resourceapi.CapacityRequirements{Requests: capacity}
	}
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("bench-%03d", i), Namespace: "bench", UID: types.UID(fmt.Sprintf("uid-%03d", i))},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: request}},
		}},
	}
}

// charge records an allocation as the scheduler's allocated state would.
func charge(state *structured.AllocatedState, r resourceapi.DeviceRequestAllocationResult) {
	id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
	if r.ShareID == nil {
		state.AllocatedDevices.Insert(id)
		return
	}
	state.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(id, r.ShareID))
	used := state.AggregatedCapacity[id]
	if used == nil {
		used = schedulerapi.NewConsumedCapacity()
		state.AggregatedCapacity[id] = used
	}
	for name, q := range r.ConsumedCapacity {
		if sum, ok := used[name]; ok {
			sum.Add(q)
		} else {
			q := q.DeepCopy()
			used[name] = &q
		}
	}
}

// fill allocates claims of `class` in turn on the node, one per whole GPU
// published.
func fill(b *testing.B, class string, capacity map[resourceapi.QualifiedName]resource.Quantity) {
	slices, known := inputs(b)
	claims := wholeGPUs(slices)
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: slices[0].Spec.Pool.Name}}
	cache := cel.NewCache(10, cel.Features{})
	ctx := context.Background()
	var spent time.Duration
	for b.Loop() {
		state := structured.AllocatedState{
			AllocatedDevices:         sets.New[structured.DeviceID](),
			AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
			AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
		}
		for i := range claims {
			began := time.Now()
			allocator, err := structured.NewAllocator(ctx, features, state, known, slices, cache)
			if err != nil {
				b.Fatal(err)
			}
			results, err := allocator.Allocate(ctx, node, []*resourceapi.ResourceClaim{claim(i, class, capacity)})
			spent += time.Since(began)
			if err != nil || len(results) != 1 {
				b.Fatalf("claim %d of %s: %v (results %d)", i, class, err, len(results))
			}
			charge(&state, results[0].Devices.Results[0])
		}
	}
	b.ReportMetric(float64(spent.Microseconds())/1e3/float64(b.N*claims), "ms/claim")
}

// wholeGPUs is the number of whole GPUs the slices publish.
func wholeGPUs(slices []*resourceapi.ResourceSlice) int {
	n := 0
	for _, s := range slices {
		for _, d := range s.Spec.Devices {
			if t, ok := d.Attributes["type"]; ok && t.StringValue != nil && *t.StringValue == "gpu" {
				n++
			}
		}
	}
	return n
}

func BenchmarkWholeGPUs(b *testing.B) {
	fill(b, "gpu.tessera.dev", nil)
}

func BenchmarkIsolatedShares(b *testing.B) {
	fill(b, "gpu-isolated.tessera.dev", map[resourceapi.QualifiedName]resource.Quantity{
		"memory": resource.MustParse("1Gi"),
		"cores":  resource.MustParse("1"),
	})
}

func BenchmarkMIGDevices(b *testing.B) {
	fill(b, "mig.tessera.dev", nil)
}
