// Package e2e holds black-box tests that build the kvsidecar binary and run
// it as several processes on loopback (and, as root with iproute2, in two
// network namespaces joined by veth). They drive the sidecars only through
// their sockets, flags, signals, HTTP endpoints and the Go client
// (localapi.Dial), never through internals.
//
// The harness (harness.go) is shared by every e2e test:
//
//	env := e2e.NewEnv(t)                       // temp dir, dev CA, capability key, socket dir
//	s := env.StartSidecar(t, e2e.SidecarOpts{Engine: "prefill-a", Args: []string{"--model", "llama-3.1-8b"}})
//	code, body := s.Get(t, "/readyz")          // metrics endpoint on a kernel-picked port
//	n := s.Metric(t, "kvsidecar_transfer_bytes_total")
//	rc, out, errOut := s.Ctl(t, "limit", "50%") // kvsidecar ctl against its socket
//	s.Signal(t, syscall.SIGSTOP)               // SIGTERM, SIGKILL, SIGSTOP, SIGCONT
//	rc = s.Wait(t, e2e.ExitTimeout)
//
// Also: Env.StartGroup starts every rank of an engine with --rank-addrs,
// Env.Restart starts a sidecar again on its address, StartInNetns runs a
// process under `ip netns exec`, Sidecar.Stats parses `ctl stats`.
// serve_test.go covers the daemon, fault_test.go and netns_test.go the fault
// matrix, security_test.go hostile peers, untrusted clients and bad
// kv_transfer_params, shutdown_test.go the signals.
//
// Binary builds ./cmd/kvsidecar once per test binary (KVSIDECAR_E2E_RACE=1
// adds -race, and a reported race fails the test); Start runs any
// subcommand; every wait is scaled by KVSIDECAR_TIME_SCALE. Processes log
// JSON to stderr; WaitLog waits for a message, and the logs of a failed test
// are printed.
package e2e
