// Package devtls makes a throwaway development certificate authority and the
// server and client certificates kvsidecar agents use for mutual TLS on
// loopback. It exists for tests and the demo only: keys are generated in
// memory per call, never persisted unless WriteFiles is called, and the CA
// signs certificates for 127.0.0.1, ::1 and localhost only.
//
//	ca, err := devtls.NewCA()
//	srv, err := ca.ServerConfig() // tls.Config requiring a client cert
//	cli, err := ca.ClientConfig()
package devtls
