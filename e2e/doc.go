// Package e2e holds black-box tests that build the kvsidecar binary and run
// it as several processes on loopback. They never reach into internals.
package e2e
