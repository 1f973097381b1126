package trace

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
)

// HashBlockTokens is the number of prompt tokens each hash id covers in the
// Mooncake traces (its README: one hash per 512-token block).
const HashBlockTokens = 512

// maxLine bounds one line of a trace (1 MiB).
const maxLine = 1 << 20

// Request is one request of a trace.
type Request struct {
	// Timestamp is the arrival time in milliseconds after the first request.
	Timestamp int64 `json:"timestamp"`
	// InputLength is the prompt length in tokens.
	InputLength int `json:"input_length"`
	// OutputLength is the number of generated tokens.
	OutputLength int `json:"output_length"`
	// HashIDs are the prefix-block hashes, one per HashBlockTokens of prompt
	// (the last block may be partial).
	HashIDs []int64 `json:"hash_ids"`
}

// LineError is a malformed line: errors name the file and the line number.
type LineError struct {
	File string
	Line int
	Err  error
}

func (e *LineError) Error() string { return fmt.Sprintf("trace: %s:%d: %v", e.File, e.Line, e.Err) }

// Unwrap returns the cause.
func (e *LineError) Unwrap() error { return e.Err }

// Reader streams the requests of one trace.
type Reader struct {
	name string
	sc   *bufio.Scanner
	line int
	last int64
}

// NewReader reads a trace from r; name is used in errors.
func NewReader(r io.Reader, name string) *Reader {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), maxLine)
	return &Reader{name: name, sc: sc}
}

// Next returns the next request, io.EOF after the last one, or a
// *LineError. Blank lines are skipped. A line must be one JSON object with
// known fields only, timestamp >= 0 and not before the previous request,
// input_length >= 1, output_length >= 0, and one hash id per started
// 512-token block of the prompt.
func (r *Reader) Next() (Request, error) {
	for r.sc.Scan() {
		r.line++
		b := bytes.TrimSpace(r.sc.Bytes())
		if len(b) == 0 {
			continue
		}
		req, err := r.parse(b)
		if err != nil {
			return Request{}, &LineError{File: r.name, Line: r.line, Err: err}
		}
		return req, nil
	}
	if err := r.sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			err = fmt.Errorf("line longer than %d bytes", maxLine)
		}
		return Request{}, &LineError{File: r.name, Line: r.line + 1, Err: err}
	}
	return Request{}, io.EOF
}

func (r *Reader) parse(b []byte) (Request, error) {
	var req Request
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		return Request{}, err
	}
	if dec.More() {
		return Request{}, errors.New("more than one JSON value on the line")
	}
	want := (req.InputLength + HashBlockTokens - 1) / HashBlockTokens
	switch {
	case req.Timestamp < 0:
		return Request{}, fmt.Errorf("timestamp=%d must not be negative", req.Timestamp)
	case req.Timestamp < r.last:
		return Request{}, fmt.Errorf("timestamp=%d is before the previous request's %d", req.Timestamp, r.last)
	case req.InputLength < 1:
		return Request{}, fmt.Errorf("input_length=%d must be at least 1", req.InputLength)
	case req.OutputLength < 0:
		return Request{}, fmt.Errorf("output_length=%d must not be negative", req.OutputLength)
	case len(req.HashIDs) != want:
		return Request{}, fmt.Errorf("hash_ids has %d entries, want %d (one per %d tokens of input_length=%d)",
			len(req.HashIDs), want, HashBlockTokens, req.InputLength)
	}
	r.last = req.Timestamp
	return req, nil
}

// ReadFile reads the first n requests of the trace at path (all when
// n <= 0). Errors: a missing or unreadable file ("trace: open ...",
// wrapping the *fs.PathError), or a *LineError naming path and line.
func ReadFile(path string, n int) ([]Request, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("trace: %w", err)
	}
	defer f.Close()
	return Read(f, path, n)
}

// Read reads the first n requests of the trace in r (all when n <= 0);
// name is used in errors. It returns fewer than n requests, and no error,
// when the trace is shorter; a malformed line is a *LineError.
func Read(r io.Reader, name string, n int) ([]Request, error) {
	tr := NewReader(r, name)
	var out []Request
	for n <= 0 || len(out) < n {
		req, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, err
		}
		out = append(out, req)
	}
	return out, nil
}
