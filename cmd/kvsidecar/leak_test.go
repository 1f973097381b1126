package main

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/kvsidecar/kvsidecar/vmm/cuda/cudatest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(cudatest.M(m)) }
