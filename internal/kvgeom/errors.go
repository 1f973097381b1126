package kvgeom

import "fmt"

// Error reports a geometry value that breaks a rule of this package. Fields
// are the wire field names involved (model, dtype, num_kv_heads, tp_size,
// tp_rank, block_len, page_size), so a caller can name its own flags or
// fields; Rule says what is wrong with which values, e.g. "tp_size=3 does
// not divide num_kv_heads=8". It carries no wire code: callers wrap it in
// their own error class.
type Error struct {
	Fields []string
	Rule   string
}

func (e *Error) Error() string { return "kvgeom: " + e.Rule }

func errorf(fields []string, format string, a ...any) *Error {
	return &Error{Fields: fields, Rule: fmt.Sprintf(format, a...)}
}
