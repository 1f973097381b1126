package connector

// SetAfterRead makes r call f once a load's READs all succeeded, before
// its checksums are verified: tests change the landed bytes there.
func SetAfterRead(r *Rank, f func(requestID string)) { r.afterRead = f }
