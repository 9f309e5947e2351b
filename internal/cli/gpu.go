package cli

import (
	"context"
	"fmt"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// gpuTransports are the GPU transports this binary can install (nvlink,
// mnnvl), in preference order; none where no GPU is usable.
func gpuTransports() []transfer.Transport { return nil }

// gpuUnavailable says why no GPU transport is installed.
func gpuUnavailable() string { return "no GPU transport is available in this build" }

// allocDevice allocates and registers GPU memory for bench --use-vram.
func allocDevice(ctx context.Context, e *transfer.Engine, size int64, gpu int) (uintptr, func(), error) {
	return 0, nil, fmt.Errorf("--use-vram: %s", gpuUnavailable())
}
