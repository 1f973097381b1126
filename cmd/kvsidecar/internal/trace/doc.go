// Package trace reads request traces in the Mooncake JSONL format (one
// request per line: timestamp ms, input_length, output_length, hash_ids) as
// a stream, reporting the file name and line number of a malformed line.
// The Mooncake conversation trace itself is embedded by package mooncake,
// below this one.
package trace
