package promutil

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Register registers *c on reg, or, when a collector with the same
// descriptors is already registered there, replaces *c with that one so
// every instance counts into it. A nil reg registers nothing.
func Register[C prometheus.Collector](reg prometheus.Registerer, c *C) error {
	if reg == nil {
		return nil
	}
	err := reg.Register(*c)
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			*c = existing
			return nil
		}
	}
	return err
}
