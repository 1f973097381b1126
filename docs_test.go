package kvsidecar_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// matrixRow is one row of docs/fault-matrix.md: its name and the tests its
// "proved by" cell lists, as "file.go TestName".
type matrixRow struct {
	name  string
	tests []string
}

var (
	// rowRe matches a table row whose first cell is a backquoted row name;
	// the last cell lists the tests.
	rowRe = regexp.MustCompile("^\\| `([a-z0-9-]+)` \\|.*\\| ([^|]+) \\|$")
	// cellTestRe matches one entry of the tests cell: an optional
	// backquoted file and a Go test, fuzz or benchmark name, or a pytest
	// test function.
	cellTestRe = regexp.MustCompile("^(?:`([^`]+)` )?((?:Test|Fuzz|Benchmark)\\w+|test_\\w+)$")
	// tagRe matches the tag a Go test carries in its doc comment; pyTagRe
	// the comment line above a pytest function (or its decorators).
	tagRe    = regexp.MustCompile(`^// fault-matrix: (\S+)$`)
	funcRe   = regexp.MustCompile(`^func (\w+)\(`)
	pyTagRe  = regexp.MustCompile(`^# fault-matrix: (\S+)$`)
	pyFuncRe = regexp.MustCompile(`^def (test_\w+)\(`)
)

// parseMatrix reads the rows of the fault matrix.
func parseMatrix(t *testing.T, path string) []matrixRow {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	var rows []matrixRow
	for i, line := range strings.Split(string(b), "\n") {
		m := rowRe.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		r := matrixRow{name: m[1]}
		file := ""
		for _, part := range strings.Split(m[2], ",") {
			tm := cellTestRe.FindStringSubmatch(strings.TrimSpace(part))
			require.NotNil(t, tm, "%s:%d: row %s: %q is not `file` TestName", path, i+1, r.name, part)
			if tm[1] != "" {
				file = tm[1]
			}
			require.NotEmpty(t, file, "%s:%d: row %s: %q names no file", path, i+1, r.name, part)
			r.tests = append(r.tests, file+" "+tm[2])
		}
		rows = append(rows, r)
	}
	return rows
}

// matrixTags returns, for every row name, the tests ("file.go TestName",
// "file.py test_name") whose doc comment carries `// fault-matrix: <row>`
// (Go, every _test.go file under root) or whose comment line above carries
// `# fault-matrix: <row>` (pytest, every test_*.py file under root).
func matrixTags(t *testing.T, root string) map[string][]string {
	t.Helper()
	tags := map[string][]string{}
	collect(t, root, "_test.go", tagRe, funcRe, "//", tags)
	collect(t, root, ".py", pyTagRe, pyFuncRe, "@", tags)
	return tags
}

// collect adds to tags the tests of files under root ending in suffix:
// lines matching tag name rows, and the next line matching fn names the
// test; lines starting with skip (comments, decorators) may sit between.
func collect(t *testing.T, root, suffix string, tag, fn *regexp.Regexp, skip string, tags map[string][]string) {
	t.Helper()
	walkFiles(t, root, suffix, func(path string, b []byte) {
		if suffix == ".py" && !strings.HasPrefix(filepath.Base(path), "test_") {
			return
		}
		var pending []string
		for i, line := range strings.Split(string(b), "\n") {
			if m := tag.FindStringSubmatch(line); m != nil {
				pending = append(pending, m[1])
				continue
			}
			if strings.HasPrefix(line, skip) || strings.HasPrefix(line, "#") && suffix == ".py" {
				continue
			}
			if m := fn.FindStringSubmatch(line); m != nil {
				for _, row := range pending {
					tags[row] = append(tags[row], filepath.ToSlash(path)+" "+m[1])
				}
			} else if len(pending) > 0 {
				t.Errorf("%s:%d: a fault-matrix tag must sit right above a test function", path, i+1)
			}
			pending = nil
		}
	})
}

// walkFiles calls fn with the path and contents of every file under root
// whose name ends in suffix, outside hidden directories (.git, .venv) and
// testdata.
func walkFiles(t *testing.T, root, suffix string, fn func(path string, b []byte)) {
	t.Helper()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != root && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, suffix) {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		fn(path, b)
		return nil
	})
	require.NoError(t, err)
}

// TestFaultMatrixNamesItsTests checks docs/fault-matrix.md against the
// tests: every row is proved by a test that names it (`// fault-matrix:
// <row>` in its doc comment), every tag names a row, and a row's "proved
// by" cell lists exactly the tests that carry its tag.
func TestFaultMatrixNamesItsTests(t *testing.T) {
	rows := parseMatrix(t, "docs/fault-matrix.md")
	require.NotEmpty(t, rows, "no rows parsed")
	tags := matrixTags(t, ".")
	seen := map[string]bool{}
	for _, r := range rows {
		require.False(t, seen[r.name], "row %s appears twice", r.name)
		seen[r.name] = true
		want := slices.Sorted(slices.Values(r.tests))
		got := slices.Sorted(slices.Values(tags[r.name]))
		require.Equal(t, want, got, "row %s: the tests its cell lists vs the tests tagged `fault-matrix: %s`", r.name, r.name)
	}
	for name, tests := range tags {
		require.True(t, seen[name], "%v carry `fault-matrix: %s`, which is no row of docs/fault-matrix.md", tests, name)
	}
}

// TestMarkdownLinksResolve checks that every relative link in the
// repository's Markdown files points at a file or directory that exists.
func TestMarkdownLinksResolve(t *testing.T) {
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	n := 0
	walkFiles(t, ".", ".md", func(path string, b []byte) {
		for _, m := range link.FindAllStringSubmatch(string(b), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "#") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			target, _, _ = strings.Cut(target, "#")
			n++
			_, err := os.Stat(filepath.Join(filepath.Dir(path), target))
			require.NoError(t, err, "%s links to %s, which does not exist", path, m[1])
		}
	})
	require.NotZero(t, n, "no relative links found: the walk is broken")
}

// TestReadmeLogLinesAreTheBinarys: a backquoted README span that reads as
// one of the binary's log messages (it starts with the first two words of
// one) is one of them, or a prefix of one ending in "..." (issue 36: the
// README quoted `engine gone: released its state` where the binary logged
// another line). Messages are the constant first arguments of the slog
// calls in the non-test Go files; the few built at run time are listed.
func TestReadmeLogLinesAreTheBinarys(t *testing.T) {
	// slog's Info/Warn/Error/Debug, and transfer's rate-limited refusal
	// loggers (logRefusal(peer, msg, ...), refusals.log(logger, key, msg, ...)).
	call := regexp.MustCompile(`\.(?:Info|Warn|Error|Debug|logRefusal\(\w+(?:\.\w+)?,|log\([^,]+,[^,]+,)\(?\s*"([^"]+)"`)
	msgs := map[string]bool{
		// transfer/serve.go: "transfer: refused a "+op.String().
		"transfer: refused a READ": true, "transfer: refused a WRITE": true,
	}
	walkFiles(t, ".", ".go", func(path string, b []byte) {
		if strings.HasSuffix(path, "_test.go") || strings.HasSuffix(path, ".pb.go") {
			return
		}
		for _, m := range call.FindAllStringSubmatch(string(b), -1) {
			msgs[m[1]] = true
		}
	})
	require.Greater(t, len(msgs), 50, "the slog messages of the tree")
	firstTwo := func(s string) string { return strings.Join(strings.Fields(s)[:min(2, len(strings.Fields(s)))], " ") }
	families := map[string]bool{}
	for m := range msgs {
		if len(strings.Fields(m)) >= 2 {
			families[firstTwo(m)] = true
		}
	}
	b, err := os.ReadFile("README.md")
	require.NoError(t, err)
	checked := 0
	for _, m := range regexp.MustCompile("`([^`\n]+)`").FindAllStringSubmatch(string(b), -1) {
		span := m[1]
		if !families[firstTwo(span)] {
			continue
		}
		checked++
		if msgs[span] {
			continue
		}
		prefix, cut := strings.CutSuffix(span, " ...")
		found := false
		for msg := range msgs {
			found = found || (cut && strings.HasPrefix(msg, prefix))
		}
		require.True(t, found, "README quotes `%s` as a log line; the binary logs no such message", span)
	}
	require.Greater(t, checked, 5, "README spans checked")
}
