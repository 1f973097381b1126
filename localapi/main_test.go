package localapi_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvsidecar/kvsidecar/internal/devtls"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm/cuda/cudatest"
)

func TestMain(m *testing.M) {
	// quic-go's warning about UDP buffer sizes is noise here.
	os.Setenv("QUIC_GO_DISABLE_RECEIVE_BUFFER_WARNING", "true")
	goleak.VerifyTestMain(cudatest.M(m))
}

// gqa8 is a small GQA geometry with 8 KV heads (llama-like, 2 layers).
var gqa8 = &v1.ModelGeometry{Model: "tiny-gqa8", NumLayers: 2, NumKvHeads: 8, HeadDim: 64,
	Dtype: v1.DType_DTYPE_BFLOAT16, BlockSize: 16, Layout: v1.Layout_LAYOUT_HND, Attention: v1.Attention_ATTENTION_GQA}

// gqa2 has 2 KV heads, replicated when TP > 2.
var gqa2 = &v1.ModelGeometry{Model: "tiny-gqa2", NumLayers: 2, NumKvHeads: 2, HeadDim: 64,
	Dtype: v1.DType_DTYPE_BFLOAT16, BlockSize: 16, Layout: v1.Layout_LAYOUT_HND, Attention: v1.Attention_ATTENTION_GQA}

var testCA = func() *devtls.CA {
	ca, err := devtls.NewCA()
	if err != nil {
		panic(err)
	}
	return ca
}()
