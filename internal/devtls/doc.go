// Package devtls makes a throwaway development certificate authority and the
// server and client certificates kvsidecar agents use for mutual TLS on
// loopback, for tests and the demo: keys are generated in memory per call,
// never persisted unless WriteFiles is called, and every certificate names
// 127.0.0.1, ::1 and localhost plus the hosts Leaf is given.
//
//	ca, err := devtls.NewCA()
//	srv, err := ca.ServerConfig() // tls.Config requiring a client cert
//	cli, err := ca.ClientConfig()
//
// Files it writes (WriteFiles) load like a real CA's with
// transfer.LoadTLSFiles.
package devtls
