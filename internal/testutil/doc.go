// Package testutil holds helpers shared by tests: a loopback QUIC pair, a
// development TLS CA, time scaling for real-network timeouts, and a leak check.
package testutil
