package cli

import "github.com/mooncake-go/mooncake-go/pkg/transfer"

// gpuTransports are the GPU transports this binary can install (nvlink,
// mnnvl), in preference order; none where no GPU is usable.
func gpuTransports() []transfer.Transport { return nil }

// gpuUnavailable says why no GPU transport is installed.
func gpuUnavailable() string { return "no GPU transport is available in this build" }
