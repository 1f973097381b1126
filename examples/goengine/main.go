// Command goengine is the smallest engine stand-in in Go: it starts six
// `kvsidecar serve` processes on loopback (a prefill instance of TP 2 and a
// decode instance of TP 4, llama-3.2-1b's KV geometry), moves one request's
// KV from prefill to decode through them with the local API client
// (localapi.Dial), checks every byte on every decode rank and prints
// the bytes it verified. It follows docs/engine-integration.md step by step.
// With --backend cuda the sidecars keep the KV cache in GPU memory and the
// engine imports their pages into its own device address space through
// vmm/cuda (localapi.ClientConfig.DeviceImporter).
//
//	go build -o bin/kvsidecar ./cmd/kvsidecar
//	go run ./examples/goengine --kvsidecar bin/kvsidecar [--backend cuda]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	"github.com/kvsidecar/kvsidecar/localapi"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm/cuda"
)

// The model: llama-3.2-1b has 16 layers (32 regions: K and V of each) and 8
// KV heads of 64 bf16 elements; blocks of 16 tokens. Prefill rank p holds
// heads 4p..4p+3, decode rank d heads 2d, 2d+1.
const (
	prefillTP, decodeTP = 2, 4
	numKVHeads          = 8
	blockSize           = 16
	rowBytes            = 64 * 2 // one head of one token: head_dim × bf16
)

func main() {
	bin := flag.String("kvsidecar", "bin/kvsidecar", "path of the kvsidecar binary")
	tokens := flag.Int("tokens", 1000, "prompt tokens of the request")
	backend := flag.String("backend", "host", "the sidecars' page backend: host or cuda (GPU 0)")
	cudaLib := flag.String("cuda-library", cuda.DefaultLibrary, "CUDA driver library (cuda backend)")
	flag.Parse()
	lib := ""
	switch *backend {
	case "host":
	case "cuda":
		lib = *cudaLib
	default:
		fmt.Fprintf(os.Stderr, "goengine: --backend %q: want host or cuda\n", *backend)
		os.Exit(2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := run(ctx, *bin, *tokens, lib, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "goengine:", err)
		os.Exit(1)
	}
}

// run does the whole example and writes its report to out. With cudaLib
// set, the sidecars run --backend cuda with that driver library and the
// engine imports their device pages through a vmm/cuda backend on GPU 0.
func run(ctx context.Context, bin string, tokens int, cudaLib string, out io.Writer) (err error) {
	dir, err := os.MkdirTemp("", "kvsgo")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	c, err := newCluster(dir, bin)
	if err != nil {
		return err
	}
	if cudaLib != "" {
		imp, ierr := cuda.New(&cuda.Config{Library: cudaLib})
		if ierr != nil {
			return fmt.Errorf("the engine's CUDA device: %w", ierr)
		}
		// Closed after the connections that map its pages (c.stop).
		defer func() { err = errors.Join(err, imp.Close()) }()
		c.serveArgs = []string{"--backend", "cuda", "--cuda-library", cudaLib}
		c.client = &localapi.ClientConfig{DeviceImporter: imp}
	}
	defer func() { err = errors.Join(err, c.stop()) }()

	// One sidecar per rank; each engine rank attaches to its own.
	prefill, err := c.startInstance(ctx, "prefill-a", "prefill", prefillTP)
	if err != nil {
		return err
	}
	decode, err := c.startInstance(ctx, "decode-a", "decode", decodeTP)
	if err != nil {
		return err
	}
	infos := map[*localapi.Client]*v1.KVCacheInfo{}
	for _, ranks := range [][]*localapi.Client{prefill, decode} {
		for r, lc := range ranks {
			// No geometry: the sidecar was started with --model.
			info, err := lc.Attach(ctx, &v1.CreateKVCache{TpRank: uint32(r), TpSize: uint32(len(ranks))})
			if err != nil {
				return fmt.Errorf("attach rank %d: %w", r, err)
			}
			infos[lc] = info
		}
	}
	nblocks := (tokens + blockSize - 1) / blockSize
	const key = 42 // the request's content key: kvgen's bytes are a function of it

	// Prefill: every rank allocates the request's blocks (each rank's own
	// ids; they need not agree), the model writes each rank's heads of every
	// layer, then every rank calls RequestFinished with its ids; the ranks'
	// kv_transfer_params, merged (each rank's export), go to the decode.
	src := make([][]uint32, prefillTP)
	for p, lc := range prefill {
		ids, err := lc.Alloc(ctx, nblocks)
		if err != nil {
			return fmt.Errorf("prefill rank %d: alloc: %w", p, err)
		}
		src[p] = ids
		// The model's output for the block, written through this process's
		// mapping of the shared page (host or device memory).
		shape := kvgen.Shape{BlockSize: blockSize, RowBytes: rowBytes, FirstHead: p * numKVHeads / prefillTP, Heads: numKVHeads / prefillTP}
		b := make([]byte, infos[lc].GetBlockLen())
		for r := range int(infos[lc].GetNumRegions()) {
			for k, id := range ids {
				kvgen.FillBlock(b, shape, key, r, k*blockSize)
				if err := lc.WriteBlock(r, int(id), b); err != nil {
					return err
				}
			}
		}
	}
	var parts []*v1.KVTransferParams
	for p, lc := range prefill {
		got, err := lc.RequestFinished(ctx, "req-1", src[p], v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
		if err != nil {
			return fmt.Errorf("prefill rank %d: RequestFinished: %w", p, err)
		}
		parts = append(parts, got)
	}
	params, err := connector.MergeExports(parts...)
	if err != nil {
		return err
	}
	// The proxy carries the params as JSON from the prefill's response to
	// the decode's request.
	js, err := connector.MarshalKVTransferParams(params)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "kv_transfer_params: %s\n", js)
	if params, err = connector.UnmarshalKVTransferParams(js); err != nil {
		return err
	}

	// Decode: every rank allocates blocks for the prompt and starts the
	// load; each reads its heads from the prefill rank that holds them.
	dst := make([][]uint32, decodeTP)
	for d, lc := range decode {
		if dst[d], err = lc.Alloc(ctx, nblocks); err != nil {
			return fmt.Errorf("decode rank %d: alloc: %w", d, err)
		}
		// No local prefix hit: remote block i lands in dst[d][i].
		if err := lc.StartLoad(ctx, &v1.ReqMeta{RequestId: "req-1", LocalBlockIds: dst[d], Params: params, RemoteHitBlocks: new(uint32(0))}); err != nil {
			return fmt.Errorf("decode rank %d: StartLoad: %w", d, err)
		}
	}
	// An engine polls GetFinished once per step.
	for d, lc := range decode {
		f, err := waitFinished(ctx, lc, func(f *v1.GetFinishedReply) bool { return len(f.GetDoneRecving())+len(f.GetFailed()) > 0 })
		if err != nil {
			return fmt.Errorf("decode rank %d: %w", d, err)
		}
		if len(f.GetFailed()) > 0 {
			fl := f.GetFailed()[0]
			return fmt.Errorf("decode rank %d: load of %s failed (%v), %d blocks to recompute", d, fl.GetRequestId(), fl.GetError(), len(fl.GetBlockIds()))
		}
	}
	var verified int64
	for d, lc := range decode {
		shape := kvgen.Shape{BlockSize: blockSize, RowBytes: rowBytes, FirstHead: d * numKVHeads / decodeTP, Heads: numKVHeads / decodeTP}
		b := make([]byte, infos[lc].GetBlockLen())
		for r := range int(infos[lc].GetNumRegions()) {
			for k, id := range dst[d] {
				if err := lc.ReadBlock(r, int(id), b); err != nil {
					return err
				}
				if bad, first := kvgen.CheckBlock(b, shape, key, r, k*blockSize); bad != 0 {
					return fmt.Errorf("decode rank %d region %d block %d: %d bytes differ, the first at %d", d, r, id, bad, first)
				}
				verified += int64(len(b))
			}
		}
		if err := lc.Free(ctx, dst[d]); err != nil {
			return err
		}
	}
	// The decode notified every prefill rank: each reports the request in
	// done_sending and freed its blocks (local ownership).
	for p, lc := range prefill {
		if _, err := waitFinished(ctx, lc, func(f *v1.GetFinishedReply) bool { return len(f.GetDoneSending()) > 0 }); err != nil {
			return fmt.Errorf("prefill rank %d: %w", p, err)
		}
	}
	fmt.Fprintf(out, "moved req-1 (%d tokens, %d blocks × 32 regions) prefill TP %d -> decode TP %d: %d bytes verified, 0 mismatches\n",
		tokens, nblocks, prefillTP, decodeTP, verified)
	return nil
}

func waitFinished(ctx context.Context, lc *localapi.Client, done func(*v1.GetFinishedReply) bool) (*v1.GetFinishedReply, error) {
	acc := &v1.GetFinishedReply{}
	for {
		f, err := lc.GetFinished(ctx)
		if err != nil {
			return nil, err
		}
		acc.DoneSending = append(acc.DoneSending, f.GetDoneSending()...)
		acc.DoneRecving = append(acc.DoneRecving, f.GetDoneRecving()...)
		acc.Failed = append(acc.Failed, f.GetFailed()...)
		if done(acc) {
			return acc, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("GetFinished: %w", context.Cause(ctx))
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// cluster is the sidecar processes of the example and what they share: a
// dev CA, one certificate for 127.0.0.1, a capability key, a socket dir.
type cluster struct {
	dir, bin  string
	tls       devtls.Files
	capKey    string
	socketDir string
	procs     []*exec.Cmd
	logs      []*os.File
	clients   []*localapi.Client
	// serveArgs are extra flags of every sidecar; client configures the
	// engine's connections (the DeviceImporter for --backend cuda).
	serveArgs []string
	client    *localapi.ClientConfig
}

func newCluster(dir, bin string) (*cluster, error) {
	ca, err := devtls.NewCA()
	if err != nil {
		return nil, err
	}
	tf, err := ca.WriteFiles(filepath.Join(dir, "tls"), "rank")
	if err != nil {
		return nil, err
	}
	c := &cluster{dir: dir, bin: bin, tls: tf, capKey: filepath.Join(dir, "cap.key"), socketDir: filepath.Join(dir, "sock")}
	if err := os.WriteFile(c.capKey, []byte("goengine-example-capability-key!"), 0o600); err != nil {
		return nil, err
	}
	return c, os.Mkdir(c.socketDir, 0o700)
}

// startInstance starts the tp ranks of one engine instance, each on a UDP
// port picked here and given to all of them with --rank-addrs, and returns
// a local API connection to each.
func (c *cluster) startInstance(ctx context.Context, engine, role string, tp int) ([]*localapi.Client, error) {
	addrs, err := freeUDPAddrs(tp)
	if err != nil {
		return nil, err
	}
	var out []*localapi.Client
	for r := range tp {
		log, err := os.Create(filepath.Join(c.dir, fmt.Sprintf("%s-tp%d.log", engine, r)))
		if err != nil {
			return nil, err
		}
		cmd := exec.Command(c.bin, append([]string{"serve", "--engine-id", engine, "--role", role, "--tp-rank", strconv.Itoa(r),
			"--tp-size", strconv.Itoa(tp), "--model", "llama-3.2-1b", "--num-blocks", "1024",
			"--listen", addrs[r], "--rank-addrs", strings.Join(addrs, ","),
			"--tls-cert", c.tls.Cert, "--tls-key", c.tls.Key, "--tls-ca", c.tls.CA,
			"--capability-key-file", c.capKey, "--socket-dir", c.socketDir,
			// Every rank here is on loopback: params naming any other
			// address are refused before a packet is sent.
			"--allow-peers", "127.0.0.0/8"}, c.serveArgs...)...)
		cmd.Stderr = log
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("start %s: %w", c.bin, err)
		}
		c.procs, c.logs = append(c.procs, cmd), append(c.logs, log)
		path, err := localapi.SocketPath(c.socketDir, engine, r)
		if err != nil {
			return nil, err
		}
		lc, err := dialWhenUp(ctx, path, cmd, c.client)
		if err != nil {
			b, _ := os.ReadFile(log.Name())
			return nil, fmt.Errorf("%s rank %d: %w\n%s", engine, r, err, b)
		}
		c.clients = append(c.clients, lc)
		out = append(out, lc)
	}
	return out, nil
}

// dialWhenUp dials the socket until the sidecar answers (it listens before
// it logs "serving") or the process exits.
func dialWhenUp(ctx context.Context, path string, cmd *exec.Cmd, cfg *localapi.ClientConfig) (*localapi.Client, error) {
	for {
		if lc, err := localapi.Dial(ctx, path, cfg); err == nil {
			if _, err := lc.Stats(ctx); err == nil {
				return lc, nil
			}
			_ = lc.Close()
		}
		if err := cmd.Process.Signal(syscall.Signal(0)); err != nil {
			return nil, fmt.Errorf("kvsidecar serve exited")
		}
		select {
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// stop closes the connections, then sends SIGTERM to every sidecar (it
// drains and exits 0) and waits.
func (c *cluster) stop() error {
	var errs []error
	for _, lc := range c.clients {
		_ = lc.Close()
	}
	for _, p := range c.procs {
		_ = p.Process.Signal(syscall.SIGTERM)
	}
	for i, p := range c.procs {
		if err := p.Wait(); err != nil {
			b, _ := os.ReadFile(c.logs[i].Name())
			errs = append(errs, fmt.Errorf("%s: %w\n%s", p.Args[0], err, b))
		}
		_ = c.logs[i].Close()
	}
	return errors.Join(errs...)
}

func freeUDPAddrs(n int) ([]string, error) {
	var out []string
	var conns []net.PacketConn
	defer func() {
		for _, pc := range conns {
			_ = pc.Close()
		}
	}()
	for range n {
		pc, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		conns = append(conns, pc)
		out = append(out, pc.LocalAddr().String())
	}
	return out, nil
}
