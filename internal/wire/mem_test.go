package wire_test

import "runtime"

type runtimeMem struct{ s runtime.MemStats }

// heap returns the total bytes allocated so far (monotonic).
func (m *runtimeMem) heap() uint64 {
	runtime.ReadMemStats(&m.s)
	return m.s.TotalAlloc
}
