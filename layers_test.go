package kvsidecar_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// module is the import path of this module; the tables below name its
// packages relative to it.
const module = "github.com/kvsidecar/kvsidecar"

// Layers of the module, lowest first. A package may import, in its non-test
// Go files, packages of a layer its own layer lists in mayImport, and no
// other package of this module. docs/design.md (section 2) explains them.
const (
	layerProto   = "wire types"   // generated protobuf code, the Code enum and the one map of errors to it
	layerLeaf    = "leaf"         // imports only the wire types: leaves stay leaves
	layerMemory  = "memory"       // elastic pages, the CUDA backend, the TP group
	layerNetwork = "network"      // QUIC agents and the handshake
	layerEngine  = "engine side"  // the connector and what the engine calls
	layerProgram = "program"      // the binary and the examples
	layerTest    = "test support" // helpers of tests; never linked into a program
)

// layerOf assigns every package of the module to a layer. A package that is
// not here fails TestImportLayers: a new package takes its place here first.
var layerOf = map[string]string{
	"proto/kvsidecar/v1": layerProto,
	"internal/codes":     layerProto,

	"internal/benchxfer": layerLeaf,
	"internal/devtls":    layerLeaf,
	"internal/fdpass":    layerLeaf,
	"internal/kvgen":     layerLeaf,
	"internal/kvgeom":    layerLeaf,
	"internal/netem":     layerLeaf,
	"internal/promutil":  layerLeaf,
	"internal/unixsock":  layerLeaf,
	"internal/wire":      layerLeaf,

	"vmm":                       layerMemory,
	"vmm/cuda":                  layerMemory,
	"vmm/cuda/internal/cudaabi": layerMemory,
	"vmm/tpgroup":               layerMemory,

	"handshake": layerNetwork,
	"transfer":  layerNetwork,

	"connector": layerEngine,
	"localapi":  layerEngine,

	"cmd/kvsidecar":                         layerProgram,
	"cmd/kvsidecar/internal/demo":           layerProgram,
	"cmd/kvsidecar/internal/trace":          layerProgram,
	"cmd/kvsidecar/internal/trace/mooncake": layerProgram,
	"examples/goengine":                     layerProgram,
	"internal/pygen":                        layerProgram,

	"e2e":               layerTest,
	"internal/testutil": layerTest,
	"vmm/cuda/cudatest": layerTest,
	"vmm/vmmtest":       layerTest,
}

// mayImport lists, for each layer, the layers its packages may import.
// Memory and network are side by side: neither imports the other, so
// transfer and handshake never see vmm (the connector hands transfer plain
// regions) and vmm never sees the network.
var mayImport = map[string][]string{
	layerProto:   {layerProto},
	layerLeaf:    {layerProto},
	layerMemory:  {layerProto, layerLeaf, layerMemory},
	layerNetwork: {layerProto, layerLeaf},
	layerEngine:  {layerProto, layerLeaf, layerMemory, layerNetwork, layerEngine},
	layerProgram: {layerProto, layerLeaf, layerMemory, layerNetwork, layerEngine, layerProgram},
	layerTest:    {layerProto, layerLeaf, layerMemory, layerNetwork, layerEngine, layerTest},
}

// onlyImportedBy narrows, for a package, who may import it beyond what the
// layers allow. vmm/cuda is the one cgo package: programs and test support
// link it, libraries never do (the local API's Go client takes a device
// importer through an interface).
var onlyImportedBy = map[string][]string{
	"vmm/cuda": {"cmd/kvsidecar", "examples/goengine", "e2e", "vmm/cuda/cudatest"},
}

// notTesting are the standard-library packages only test support may
// import, so no program links test code.
var notTesting = []string{"testing", "testing/synctest"}

// goPackage is what the rules need of `go list -json`.
type goPackage struct {
	ImportPath string
	Imports    []string
}

// checkImports returns one error per import that breaks a rule: an import of
// a package of this module from a layer mayImport does not allow or by a
// package onlyImportedBy leaves out, package testing outside test support,
// or a package missing from layerOf.
func checkImports(pkgs []goPackage) []error {
	var errs []error
	for _, p := range pkgs {
		from, ok := strings.CutPrefix(p.ImportPath, module+"/")
		if !ok {
			continue // the module root: tests only
		}
		fromLayer, ok := layerOf[from]
		if !ok {
			errs = append(errs, fmt.Errorf("%s is in no layer: add it to layerOf in layers_test.go", from))
			continue
		}
		for _, imp := range p.Imports {
			if slices.Contains(notTesting, imp) && fromLayer != layerTest {
				errs = append(errs, fmt.Errorf("%s (%s) imports %s: only test support may", from, fromLayer, imp))
			}
			to, ok := strings.CutPrefix(imp, module+"/")
			if !ok {
				continue
			}
			toLayer, ok := layerOf[to]
			if !ok {
				errs = append(errs, fmt.Errorf("%s imports %s, which is in no layer: add it to layerOf in layers_test.go", from, to))
				continue
			}
			if !slices.Contains(mayImport[fromLayer], toLayer) {
				errs = append(errs, fmt.Errorf("%s (%s) imports %s (%s): the %s layer may import only %s",
					from, fromLayer, to, toLayer, fromLayer, strings.Join(mayImport[fromLayer], ", ")))
			}
			if only, ok := onlyImportedBy[to]; ok && !slices.Contains(only, from) {
				errs = append(errs, fmt.Errorf("%s imports %s, which only %s may import", from, to, strings.Join(only, ", ")))
			}
		}
	}
	return errs
}

// listPackages runs `go list -json ./...` in dir with env added, and decodes
// each package's import path and non-test imports.
func listPackages(t *testing.T, dir string, env ...string) []goPackage {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("go command not found: %v", err)
	}
	cmd := exec.Command(goBin, "list", "-json=ImportPath,Imports", "./...")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "go list: %s", stderr.String())
	var pkgs []goPackage
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p goPackage
		err := dec.Decode(&p)
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		pkgs = append(pkgs, p)
	}
	return pkgs
}

// TestImportLayers checks every package of the module, built with and
// without cgo, against the layer rules above.
func TestImportLayers(t *testing.T) {
	for _, cgo := range []string{"1", "0"} {
		t.Run("CGO_ENABLED="+cgo, func(t *testing.T) {
			pkgs := listPackages(t, ".", "CGO_ENABLED="+cgo)
			var listed []string
			for _, p := range pkgs {
				listed = append(listed, strings.TrimPrefix(p.ImportPath, module+"/"))
			}
			for path := range layerOf {
				require.Contains(t, listed, path, "layerOf names %s, which go list does not list: drop it", path)
			}
			require.Empty(t, checkImports(pkgs))
		})
	}
}

// TestBinaryLinksNoTesting checks the whole dependency graph of the binary,
// the standard library and other modules included: package testing is not
// in it.
func TestBinaryLinksNoTesting(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("go command not found: %v", err)
	}
	out, err := exec.Command(goBin, "list", "-deps", "./cmd/kvsidecar").CombinedOutput()
	require.NoError(t, err, "%s", out)
	deps := strings.Fields(string(out))
	require.Contains(t, deps, module+"/cmd/kvsidecar", "go list listed nothing useful: %s", out)
	for _, p := range notTesting {
		require.NotContains(t, deps, p, "the binary links %s", p)
	}
}

// TestImportRulesRefuse feeds checkImports edge lists with one forbidden
// import each, to show the rules catch what they are for.
func TestImportRulesRefuse(t *testing.T) {
	m := func(path string, imports ...string) goPackage {
		p := goPackage{ImportPath: module + "/" + path}
		for _, imp := range imports {
			if !strings.Contains(imp, ".") && !slices.Contains(notTesting, imp) {
				imp = module + "/" + imp
			}
			p.Imports = append(p.Imports, imp)
		}
		return p
	}
	tests := []struct {
		name string
		pkg  goPackage
		want string // in the one error; "" for none
	}{
		{"the connector on both halves", m("connector", "vmm", "transfer", "handshake", "internal/codes", "proto/kvsidecar/v1", "github.com/prometheus/client_golang/prometheus"), ""},
		{"a test helper on the memory layer", m("vmm/vmmtest", "vmm", "testing"), ""},
		{"transfer imports vmm", m("transfer", "vmm"), "transfer (network) imports vmm (memory)"},
		{"handshake imports vmm", m("handshake", "vmm"), "handshake (network) imports vmm (memory)"},
		{"transfer imports handshake", m("transfer", "handshake"), "transfer (network) imports handshake (network)"},
		{"handshake imports transfer", m("handshake", "transfer"), "handshake (network) imports transfer (network)"},
		{"vmm imports transfer", m("vmm", "transfer"), "vmm (memory) imports transfer (network)"},
		{"a leaf imports another leaf", m("internal/wire", "internal/fdpass"), "internal/wire (leaf) imports internal/fdpass (leaf)"},
		{"a leaf names its errors' classes", m("internal/unixsock", "internal/codes", "proto/kvsidecar/v1"), ""},
		{"a leaf imports vmm", m("internal/kvgen", "vmm"), "internal/kvgen (leaf) imports vmm (memory)"},
		{"the wire types import a leaf", m("proto/kvsidecar/v1", "internal/wire"), "proto/kvsidecar/v1 (wire types) imports internal/wire (leaf)"},
		{"the connector imports test support", m("connector", "internal/testutil"), "connector (engine side) imports internal/testutil (test support)"},
		{"the demo imports test support", m("cmd/kvsidecar/internal/demo", "internal/testutil"), "imports internal/testutil (test support)"},
		{"a library imports testing", m("vmm", "testing"), "vmm (memory) imports testing: only test support may"},
		{"a leaf imports testing/synctest", m("internal/netem", "testing/synctest"), "imports testing/synctest"},
		{"the connector imports the cgo package", m("connector", "vmm/cuda"), "connector imports vmm/cuda, which only cmd/kvsidecar, examples/goengine, e2e, vmm/cuda/cudatest may import"},
		{"the TP group imports the cgo package", m("vmm/tpgroup", "vmm/cuda"), "vmm/tpgroup imports vmm/cuda, which only"},
		{"test support imports the binary's demo", m("e2e", "cmd/kvsidecar/internal/demo"), "e2e (test support) imports cmd/kvsidecar/internal/demo (program)"},
		{"a package in no layer", m("internal/grabbag"), "internal/grabbag is in no layer"},
		{"an import of a package in no layer", m("connector", "internal/grabbag"), "imports internal/grabbag, which is in no layer"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			errs := checkImports([]goPackage{tc.pkg})
			if tc.want == "" {
				require.Empty(t, errs)
				return
			}
			require.Len(t, errs, 1, "%v", errs)
			require.ErrorContains(t, errs[0], tc.want)
		})
	}
}

// TestImportRulesRefuseAModule runs the whole check, `go list` included, on
// a throwaway module of this module's path in which transfer imports vmm.
func TestImportRulesRefuseAModule(t *testing.T) {
	dir := t.TempDir()
	for name, src := range map[string]string{
		"go.mod":               "module " + module + "\n\ngo 1.26\n",
		"vmm/vmm.go":           "package vmm\n\nconst PageSize = 2 << 20\n",
		"transfer/transfer.go": "package transfer\n\nimport \"" + module + "/vmm\"\n\nconst Chunk = vmm.PageSize\n",
	} {
		path := filepath.Join(dir, name)
		require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
		require.NoError(t, os.WriteFile(path, []byte(src), 0o644))
	}
	errs := checkImports(listPackages(t, dir, "GOWORK=off", "GOFLAGS=-mod=mod"))
	require.Len(t, errs, 1, "%v", errs)
	require.ErrorContains(t, errs[0], "transfer (network) imports vmm (memory)")
}
