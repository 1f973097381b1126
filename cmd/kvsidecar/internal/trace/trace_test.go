package trace_test

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvsidecar/kvsidecar/cmd/kvsidecar/internal/trace"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestRead(t *testing.T) {
	const two = `{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}

{"timestamp": 9, "input_length": 512, "output_length": 0, "hash_ids": [7]}
`
	tests := []struct {
		name string
		in   string
		n    int
		want int
	}{
		{"all", two, 0, 2},
		{"first", two, 1, 1},
		{"fewer than asked", two, 5, 2},
		{"empty", "", 8, 0},
		{"blank lines only", "\n \n", 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			reqs, err := trace.Read(strings.NewReader(tc.in), "t.jsonl", tc.n)
			require.NoError(t, err)
			require.Len(t, reqs, tc.want)
			if tc.want > 0 {
				require.Equal(t, 600, reqs[0].InputLength)
			}
		})
	}
	p := filepath.Join(t.TempDir(), "two.jsonl")
	require.NoError(t, os.WriteFile(p, []byte(two), 0o600))
	reqs, err := trace.ReadFile(p, 0)
	require.NoError(t, err)
	require.Equal(t, []int64{7}, reqs[1].HashIDs)
}

func TestMalformedLineNamesFileAndLine(t *testing.T) {
	good := `{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}`
	tests := []struct {
		name string
		line string
		want string
	}{
		{"not json", `{"timestamp": 7,`, "t.jsonl:3: unexpected EOF"},
		{"unknown field", `{"timestamp": 7, "input_length": 1, "output_length": 1, "hash_ids": [1], "x": 1}`, `t.jsonl:3: json: unknown field "x"`},
		{"wrong hash count", `{"timestamp": 7, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}`, "t.jsonl:3: hash_ids has 2 entries, want 3"},
		{"zero input", `{"timestamp": 7, "input_length": 0, "output_length": 1, "hash_ids": []}`, "t.jsonl:3: input_length=0 must be at least 1"},
		{"time goes back", `{"timestamp": 4, "input_length": 1, "output_length": 1, "hash_ids": [9]}`, "t.jsonl:3: timestamp=4 is before the previous request's 5"},
		{"two values", good + ` {}`, "t.jsonl:3: more than one JSON value"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			in := good + "\n\n" + tc.line + "\n" + good + "\n"
			r := trace.NewReader(strings.NewReader(in), "t.jsonl")
			_, err := r.Next()
			require.NoError(t, err)
			_, err = r.Next()
			var le *trace.LineError
			require.True(t, errors.As(err, &le), "%v", err)
			require.Equal(t, 3, le.Line)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

func TestReadFileErrors(t *testing.T) {
	_, err := trace.ReadFile(filepath.Join(t.TempDir(), "missing.jsonl"), 0)
	require.ErrorIs(t, err, os.ErrNotExist)

	p := filepath.Join(t.TempDir(), "long.jsonl")
	require.NoError(t, os.WriteFile(p, []byte(strings.Repeat("x", 2<<20)), 0o600))
	_, err = trace.ReadFile(p, 0)
	require.ErrorContains(t, err, "long.jsonl:1: line longer than 1048576 bytes")

	r := trace.NewReader(strings.NewReader(""), "empty")
	_, err = r.Next()
	require.ErrorIs(t, err, io.EOF)
}

func FuzzTraceLine(f *testing.F) {
	f.Add([]byte(`{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0,1,2,3,4,5,6,7,8,9,10,11,12,13]}`))
	f.Fuzz(func(t *testing.T, in []byte) {
		r := trace.NewReader(strings.NewReader(string(in)), "fuzz")
		for {
			req, err := r.Next()
			if err != nil {
				return
			}
			require.GreaterOrEqual(t, req.InputLength, 1)
			require.Len(t, req.HashIDs, (req.InputLength+511)/512)
		}
	})
}
