package localapi

import (
	"fmt"
	"strconv"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/unixsock"
)

// SocketPath returns the local API socket of rank tpRank of engine
// engineID in dir: <dir>/kvsidecar-<id>-tp<rank>-api.sock. Like
// tpgroup.SocketPath it depends only on the engine id and the rank (never
// the device): <id> is engineID when it is only [A-Za-z0-9._-] and fits,
// otherwise a sanitized prefix plus "-" and 12 hex digits of its SHA-256.
// Errors (class CODE_INVALID_ARGUMENT): rank outside [0, MaxTPSize)
// (ErrInvalidArgument), dir not absolute or too long, empty engine id.
func SocketPath(dir, engineID string, tpRank int) (string, error) {
	if tpRank < 0 || tpRank >= connector.MaxTPSize {
		return "", fmt.Errorf("%w: tp_rank %d must be in [0, %d)", ErrInvalidArgument, tpRank, connector.MaxTPSize)
	}
	return unixsock.Path(dir, engineID, "-tp"+strconv.Itoa(tpRank)+"-api.sock")
}
