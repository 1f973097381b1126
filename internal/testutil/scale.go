package testutil

import (
	"os"
	"strconv"
	"time"
)

// TimeScale returns the factor by which real-network timeouts in tests are
// multiplied: the KVSIDECAR_TIME_SCALE environment variable (a positive
// number), 1 when unset or invalid. Slow or loaded CI machines set it to 3–10.
func TimeScale() float64 {
	f, err := strconv.ParseFloat(os.Getenv("KVSIDECAR_TIME_SCALE"), 64)
	if err != nil || f <= 0 {
		return 1
	}
	return f
}

// Scaled multiplies d by TimeScale.
func Scaled(d time.Duration) time.Duration { return time.Duration(float64(d) * TimeScale()) }
