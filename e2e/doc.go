// Package e2e holds black-box tests that build the kvsidecar binary once and
// run it as several processes on loopback (and, as root with iproute2, in
// two network namespaces joined by veth). They drive the sidecars only
// through their sockets, flags, signals, HTTP endpoints and the Go client
// (connector.DialLocal), never through internals.
//
// harness.go: Binary builds the binary; NewEnv makes the temp dirs, dev TLS
// files and a shared capability key; Env.StartSidecar / StartGroup start
// ranks (StartGroup with --rank-addrs); Proc has WaitLog, Signal, Kill,
// Wait; Env.Restart starts a sidecar again on its address; StartInNetns runs
// a process under `ip netns exec`; Sidecar.Get/Metric/Ctl/Stats read it.
// serve_test.go covers the daemon, fault_test.go and netns_test.go the
// fault matrix, security_test.go hostile peers, untrusted clients and bad
// kv_transfer_params, shutdown_test.go the signals.
//
// Real-network timeouts scale with KVSIDECAR_TIME_SCALE; KVSIDECAR_E2E_RACE=1
// builds the sidecars with the race detector (a reported race fails).
package e2e
