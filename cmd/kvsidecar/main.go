package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// errNotImplemented is returned by subcommands whose issue has not landed.
var errNotImplemented = errors.New("not implemented yet")

// command is one subcommand.
type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

func commands() []command {
	return []command{
		{"serve", "run the sidecar beside one GPU (one tp_rank)", runServe},
		{"demo", "prefill→decode on the host backend, replaying a real trace", runDemo},
		{"bench", "benchmarks: bench handshake | bench transfer", runBench},
		{"ctl", "stats and memory limit of a running sidecar", runCtl},
		{"version", "print the version (also kvsidecar --version)", runVersion},
	}
}

// shutdownSignals end the command's context: serve drains, removes its
// sockets and exits 0. SIGHUP is one of them so that a sidecar whose
// terminal or session goes away shuts down cleanly instead of dying with
// status 129 and leaving its socket behind.
var shutdownSignals = []os.Signal{os.Interrupt, syscall.SIGTERM, syscall.SIGHUP}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), shutdownSignals...)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run executes the command line args and returns the exit status:
// 0 success, 1 failure, 2 usage error, or an exitCoder's status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return 2
	}
	if args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stdout) // asked for: the answer, not an error
		return 0
	}
	if args[0] == "--version" || args[0] == "-version" {
		args = append([]string{"version"}, args[1:]...)
	}
	for _, c := range commands() {
		if c.name != args[0] {
			continue
		}
		err := c.run(ctx, args[1:], stdout, stderr)
		var ec exitCoder
		switch {
		case err == nil:
			return 0
		case errors.Is(err, flag.ErrHelp):
			return 0
		case errors.Is(err, errUsage):
			fmt.Fprintf(stderr, "kvsidecar %s: %v\nsee 'kvsidecar %s --help'\n", c.name, err, c.name)
			return 2
		case errors.As(err, &ec):
			fmt.Fprintf(stderr, "kvsidecar %s: %v\n", c.name, err)
			return ec.ExitCode()
		default:
			fmt.Fprintf(stderr, "kvsidecar %s: %v\n", c.name, err)
			return 1
		}
	}
	fmt.Fprintf(stderr, "kvsidecar: unknown command %q\nsee 'kvsidecar --help'\n", args[0])
	return 2
}

// exitCoder is an error that chooses the exit status (demo: 128 + the
// signal that stopped it).
type exitCoder interface{ ExitCode() int }

// errUsage marks an error in the command line (exit status 2).
var errUsage = errors.New("usage")

func usageErrorf(format string, a ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{errUsage}, a...)...)
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "Usage: kvsidecar <command> [flags]")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Commands:")
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-8s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Run 'kvsidecar <command> --help' for the flags of a command.")
}

// cmdFlags is a command's flag.FlagSet whose help goes to stdout when asked
// for (-h, --help) and nowhere on a parse error: a bad flag or value is one
// error line (run adds where to find the help), not the error above and
// below the whole flag list.
type cmdFlags struct {
	*flag.FlagSet
	stdout io.Writer
	help   bytes.Buffer // the usage flag wrote last, printed only on -h
}

// newFlagSet returns the cmdFlags of command name ("serve", "bench
// handshake"), which returns errors instead of exiting.
func newFlagSet(name, synopsis string, stdout io.Writer) *cmdFlags {
	fs := &cmdFlags{FlagSet: flag.NewFlagSet("kvsidecar "+name, flag.ContinueOnError), stdout: stdout}
	fs.SetOutput(io.Discard)
	// flag calls Usage on -h and on every parse error; it is kept and
	// printed only for -h (parse).
	fs.Usage = func() {
		fs.help.Reset()
		fmt.Fprintf(&fs.help, "Usage: kvsidecar %s [flags]\n\n%s\n\nFlags:\n", name, synopsis)
		fs.SetOutput(&fs.help)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}
	return fs
}

// parse parses args: flag.ErrHelp once the help is on stdout, a usage error
// for a bad flag or value.
func (fs *cmdFlags) parse(args []string) error {
	err := fs.Parse(args)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, flag.ErrHelp):
		_, _ = fs.stdout.Write(fs.help.Bytes())
		return err
	}
	return usageErrorf("%v", err)
}

// parseFlags parses args and rejects positional arguments.
func parseFlags(fs *cmdFlags, args []string) error {
	if err := fs.parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageErrorf("unexpected argument %q", fs.Arg(0))
	}
	return nil
}
