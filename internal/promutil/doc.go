// Package promutil holds the one Prometheus helper every package shares:
// registering collectors on an injected Registerer where several instances
// (one per rank in one process) report into one registry.
package promutil
