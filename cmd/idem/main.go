// Command idem is the operators' command line for idem's store, on
// PostgreSQL, MySQL/MariaDB and SQLite:
//
//	idem migrate up|down|status --db DSN
//	idem check   --db DSN                      start-up check; changes nothing
//	idem stats   --db DSN                      counts by status, leases, reaper backlog
//	idem inspect --db DSN --digest D           the record behind a log line's key digest
//	idem inspect --db DSN --scope S --key K    (or --tenant T --method M --route R --key K)
//	idem purge   --db DSN (--digest D | --scope S [--key K]) --yes [--force]
//	idem release --db DSN (--digest D | --scope S --key K) --token N
//	idem reap    --db DSN --once
//
// DSN is postgres://… (with --schema for postgres.WithSchema), mysql://
// followed by a go-sql-driver DSN (with parseTime=true), a SQLite path or
// sqlite://path; IDEM_DB is used when --db is absent. Output is for people;
// --json prints one JSON document for scripts. inspect hides response
// bodies unless --show-body is given. Errors name records by their key
// digest, never by key, scope or body, and never echo the DSN.
//
// Exit codes:
//
//	0  done
//	1  failed for another reason
//	2  bad input: unknown command or flag, bad DSN, unknown dialect,
//	   malformed digest, purge without --yes
//	3  the store is unavailable (cannot connect, timed out)
//	4  check: the store is not ready (the problems are printed)
//	5  not found: no record for the digest or key
//	6  refused: a live lease (purge without --force), or the token is not
//	   the record's (release, purge of one key)
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
)

// Exit codes; see the package documentation.
const (
	exitOK          = 0
	exitFailed      = 1
	exitUsage       = 2
	exitUnavailable = 3
	exitNotReady    = 4
	exitNotFound    = 5
	exitRefused     = 6
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

const usage = `usage: idem <command> [flags]

commands:
  migrate up|down|status   apply, undo one, or list idem's migrations
  check                    verify the schema and connection settings (changes nothing)
  stats                    count records by status, leases and the reaper's backlog
  inspect                  show a record, by --digest or --scope/--key
  purge                    delete a record (--digest, --scope --key) or a whole --scope; needs --yes
  release                  free a stuck lease by deleting its record; needs the record's --token
  reap --once              run one reaper pass

Run idem <command> -h for its flags. Exit codes: 0 done, 1 failed, 2 bad input,
3 store unavailable, 4 not ready, 5 not found, 6 refused.
`

// common are the flags every command takes.
type common struct {
	db, schema string
	json       bool
	timeout    time.Duration
}

func flags(name string, stderr io.Writer) (*flag.FlagSet, *common) {
	fs := flag.NewFlagSet("idem "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	c := &common{}
	fs.StringVar(&c.db, "db", os.Getenv("IDEM_DB"), "database: postgres://…, mysql://…, a SQLite path or sqlite://… (default $IDEM_DB)")
	fs.StringVar(&c.schema, "schema", "", "PostgreSQL schema of idem's table (postgres.WithSchema)")
	fs.BoolVar(&c.json, "json", false, "print JSON for scripts")
	fs.DurationVar(&c.timeout, "timeout", 30*time.Second, "give up after this long")
	return fs, c
}

// selector names a record or a scope.
type selector struct {
	digest, scope, key, tenant, method, route string
}

func (s *selector) register(fs *flag.FlagSet) {
	fs.StringVar(&s.digest, "digest", "", "key digest from a log line (16 hex digits)")
	fs.StringVar(&s.scope, "scope", "", "scope of the key")
	fs.StringVar(&s.key, "key", "", "idempotency key")
	fs.StringVar(&s.tenant, "tenant", "", "idemhttp tenant (with --method and --route instead of --scope)")
	fs.StringVar(&s.method, "method", "", "idemhttp request method, e.g. POST")
	fs.StringVar(&s.route, "route", "", "idemhttp route, e.g. /orders")
}

// resolve fills in the scope from idemhttp's parts and checks the choice.
func (s *selector) resolve(needKey bool) error {
	if s.method != "" || s.route != "" || s.tenant != "" {
		if s.scope != "" {
			return usagef("give --scope or --tenant/--method/--route, not both")
		}
		if s.method == "" || s.route == "" {
			return usagef("--method and --route go together")
		}
		s.scope = idemhttp.ScopeFor(s.tenant, s.method, s.route)
	}
	switch {
	case s.digest != "" && (s.scope != "" || s.key != ""):
		return usagef("give --digest or --scope/--key, not both")
	case s.digest != "":
		if !validDigest(s.digest) {
			return usagef("malformed digest: want the 16 hexadecimal digits of a log line's key= field")
		}
	case s.scope == "":
		return usagef("name the record: --digest, or --scope (or --tenant/--method/--route) and --key")
	case needKey && s.key == "":
		return usagef("--key is needed with --scope")
	}
	return nil
}

func validDigest(d string) bool {
	if len(d) != 16 {
		return false
	}
	_, err := strconv.ParseUint(d, 16, 64)
	return err == nil
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	cmd, rest := args[0], args[1:]
	var err error
	switch cmd {
	case "migrate":
		err = cmdMigrate(ctx, rest, stdout, stderr)
	case "check":
		err = cmdCheck(ctx, rest, stdout, stderr)
	case "stats":
		err = cmdStats(ctx, rest, stdout, stderr)
	case "inspect":
		err = cmdInspect(ctx, rest, stdout, stderr)
	case "purge":
		err = cmdPurge(ctx, rest, stdout, stderr)
	case "release":
		err = cmdRelease(ctx, rest, stdout, stderr)
	case "reap":
		err = cmdReap(ctx, rest, stdout, stderr)
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return exitOK
	default:
		fmt.Fprintf(stderr, "idem: unknown command %q\n\n%s", cmd, usage)
		return exitUsage
	}
	if err == nil {
		return exitOK
	}
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	var ce *idem.CheckError
	if errors.As(err, &ce) {
		fmt.Fprintf(stderr, "idem: %s store not ready:\n", ce.Dialect)
		for _, p := range ce.Problems {
			fmt.Fprintf(stderr, "  - %s\n    fix: %s\n", p.What, p.Fix)
		}
		return exitNotReady
	}
	fmt.Fprintf(stderr, "idem %s: %v\n", cmd, err)
	var ue *usageError
	switch {
	case errors.As(err, &ue), errors.Is(err, idem.ErrInvalidDigest), errors.Is(err, idem.ErrInvalidKey), errors.Is(err, idem.ErrInvalidScope):
		return exitUsage
	case errors.Is(err, idem.ErrStoreUnavailable):
		return exitUnavailable
	case errors.Is(err, idem.ErrNotFound):
		return exitNotFound
	case errors.Is(err, idem.ErrLeaseLive), errors.Is(err, idem.ErrFenced):
		return exitRefused
	default:
		return exitFailed
	}
}

// parse parses args, refusing stray arguments.
func parse(fs *flag.FlagSet, args []string, positional int) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usagef("%v", err)
	}
	if fs.NArg() != positional {
		return usagef("unexpected arguments (see idem %s -h)", strings.TrimPrefix(fs.Name(), "idem "))
	}
	return nil
}

func openFor(ctx context.Context, c *common, create bool) (*target, context.Context, context.CancelFunc, error) {
	tctx, cancel := context.WithTimeout(ctx, c.timeout)
	t, err := open(tctx, c.db, c.schema, create)
	if err != nil {
		cancel()
		return nil, nil, nil, err
	}
	return t, tctx, func() { t.close(); cancel() }, nil
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func cmdMigrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, c := flags("migrate", stderr)
	// The subcommand may come before or after the flags.
	var sub string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		sub, args = args[0], args[1:]
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usagef("%v", err)
	}
	if sub == "" && fs.NArg() == 1 {
		sub = fs.Arg(0)
	} else if fs.NArg() != 0 {
		return usagef("usage: idem migrate up|down|status --db DSN")
	}
	if sub != "up" && sub != "down" && sub != "status" {
		return usagef("usage: idem migrate up|down|status --db DSN")
	}
	t, ctx, done, err := openFor(ctx, c, sub == "up")
	if err != nil {
		return err
	}
	defer done()
	if sub == "up" {
		if err := t.up(ctx); err != nil {
			return err
		}
	}
	p, err := t.provider()
	if err != nil {
		return err
	}
	defer p.Close()
	if sub == "down" {
		res, err := p.Down(ctx)
		if err != nil {
			return err
		}
		if !c.json {
			fmt.Fprintf(stdout, "undid migration %d (%s)\n", res.Source.Version, res.Source.Path)
		}
	}
	status, err := p.Status(ctx)
	if err != nil {
		return err
	}
	type row struct {
		Version   int64     `json:"version"`
		File      string    `json:"file"`
		Applied   bool      `json:"applied"`
		AppliedAt time.Time `json:"applied_at,omitzero"`
	}
	rows := make([]row, 0, len(status))
	for _, s := range status {
		rows = append(rows, row{Version: s.Source.Version, File: s.Source.Path, Applied: s.State == "applied", AppliedAt: s.AppliedAt})
	}
	if c.json {
		return printJSON(stdout, map[string]any{"dialect": t.dialect, "migrations": rows})
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VERSION\tSTATE\tAPPLIED AT\tFILE")
	for _, r := range rows {
		state, at := "pending", ""
		if r.Applied {
			state, at = "applied", r.AppliedAt.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\n", r.Version, state, at, r.File)
	}
	return tw.Flush()
}

func cmdCheck(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, c := flags("check", stderr)
	if err := parse(fs, args, 0); err != nil {
		return err
	}
	t, ctx, done, err := openFor(ctx, c, false)
	if err != nil {
		return err
	}
	defer done()
	if err := t.store.Check(ctx); err != nil {
		var ce *idem.CheckError
		if c.json && errors.As(err, &ce) {
			_ = printJSON(stdout, map[string]any{"dialect": t.dialect, "ready": false, "problems": ce.Problems})
		}
		return err
	}
	if c.json {
		return printJSON(stdout, map[string]any{"dialect": t.dialect, "ready": true})
	}
	fmt.Fprintf(stdout, "%s store ready\n", t.dialect)
	return nil
}

type statsJSON struct {
	Now              time.Time `json:"now"`
	Total            int64     `json:"total"`
	Processing       int64     `json:"processing"`
	Succeeded        int64     `json:"succeeded"`
	Failed           int64     `json:"failed"`
	LiveLeases       int64     `json:"live_leases"`
	StaleLeases      int64     `json:"stale_leases"`
	Expired          int64     `json:"expired"`
	OldestProcessing time.Time `json:"oldest_processing,omitzero"`
}

func cmdStats(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, c := flags("stats", stderr)
	if err := parse(fs, args, 0); err != nil {
		return err
	}
	t, ctx, done, err := openFor(ctx, c, false)
	if err != nil {
		return err
	}
	defer done()
	st, err := t.store.Stats(ctx)
	if err != nil {
		return err
	}
	if c.json {
		return printJSON(stdout, statsJSON(*st))
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "records\t%d\n", st.Total)
	fmt.Fprintf(tw, "  processing\t%d\t(live leases %d, stale leases %d)\n", st.Processing, st.LiveLeases, st.StaleLeases)
	fmt.Fprintf(tw, "  succeeded\t%d\n", st.Succeeded)
	fmt.Fprintf(tw, "  failed\t%d\n", st.Failed)
	fmt.Fprintf(tw, "expired, awaiting the reaper\t%d\n", st.Expired)
	if !st.OldestProcessing.IsZero() {
		fmt.Fprintf(tw, "oldest processing record\tclaimed %s (%s ago)\n", st.OldestProcessing.Format(time.RFC3339), st.Now.Sub(st.OldestProcessing).Round(time.Second))
	}
	fmt.Fprintf(tw, "as of\t%s\n", st.Now.Format(time.RFC3339Nano))
	return tw.Flush()
}

// find returns the records sel names.
func find(ctx context.Context, s ops, sel *selector) ([]*idem.Record, error) {
	if sel.digest != "" {
		return s.LookupDigest(ctx, sel.digest)
	}
	rec, err := s.Lookup(ctx, sel.scope, sel.key)
	if err != nil {
		return nil, err
	}
	return []*idem.Record{rec}, nil
}

type recordJSON struct {
	Digest         string              `json:"digest"`
	Scope          string              `json:"scope"`
	Key            string              `json:"key"`
	Status         string              `json:"status"`
	Token          int64               `json:"token"`
	Attempt        int                 `json:"attempt"`
	Fingerprint    string              `json:"fingerprint"`
	CreatedAt      time.Time           `json:"created_at"`
	UpdatedAt      time.Time           `json:"updated_at"`
	LeaseExpiresAt time.Time           `json:"lease_expires_at"`
	CompletedAt    time.Time           `json:"completed_at,omitzero"`
	ExpiresAt      time.Time           `json:"expires_at"`
	ResponseStatus int                 `json:"response_status,omitempty"`
	ResponseHeader map[string][]string `json:"response_header,omitempty"`
	BodyBytes      int                 `json:"response_body_bytes"`
	Body           *string             `json:"response_body,omitempty"`
}

func toJSON(r *idem.Record, showBody bool) recordJSON {
	out := recordJSON{
		Digest: idem.KeyDigest(r.Scope, r.Key), Scope: r.Scope, Key: r.Key, Status: r.Status.String(),
		Token: r.Token, Attempt: r.Attempt, Fingerprint: fmt.Sprintf("%x", r.Fingerprint[:]),
		CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt, LeaseExpiresAt: r.LeaseExpiresAt,
		CompletedAt: r.CompletedAt, ExpiresAt: r.ExpiresAt,
	}
	if r.Response != nil {
		out.ResponseStatus = r.Response.StatusCode
		out.ResponseHeader = r.Response.Header
		out.BodyBytes = len(r.Response.Body)
		if showBody {
			b := string(r.Response.Body)
			out.Body = &b
		}
	}
	return out
}

func cmdInspect(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, c := flags("inspect", stderr)
	var sel selector
	sel.register(fs)
	showBody := fs.Bool("show-body", false, "print the stored response body")
	if err := parse(fs, args, 0); err != nil {
		return err
	}
	if err := sel.resolve(true); err != nil {
		return err
	}
	t, ctx, done, err := openFor(ctx, c, false)
	if err != nil {
		return err
	}
	defer done()
	recs, err := find(ctx, t.store, &sel)
	if err != nil {
		return err
	}
	out := make([]recordJSON, 0, len(recs))
	for _, r := range recs {
		out = append(out, toJSON(r, *showBody))
	}
	if c.json {
		return printJSON(stdout, out)
	}
	now := time.Now()
	for i, r := range out {
		if i > 0 {
			fmt.Fprintln(stdout)
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintf(tw, "digest\t%s\n", r.Digest)
		fmt.Fprintf(tw, "scope\t%q\n", r.Scope)
		fmt.Fprintf(tw, "key\t%q\n", r.Key)
		fmt.Fprintf(tw, "status\t%s\n", r.Status)
		fmt.Fprintf(tw, "token\t%d\t(idem release --token %d)\n", r.Token, r.Token)
		fmt.Fprintf(tw, "attempt\t%d\n", r.Attempt)
		fmt.Fprintf(tw, "fingerprint\t%s\n", r.Fingerprint)
		fmt.Fprintf(tw, "created\t%s\n", r.CreatedAt.Format(time.RFC3339Nano))
		if r.Status == "processing" {
			state := "live"
			if !r.LeaseExpiresAt.After(now) {
				state = "ran out"
			}
			fmt.Fprintf(tw, "lease expires\t%s\t(%s)\n", r.LeaseExpiresAt.Format(time.RFC3339Nano), state)
		} else {
			fmt.Fprintf(tw, "completed\t%s\n", r.CompletedAt.Format(time.RFC3339Nano))
			fmt.Fprintf(tw, "response\t%d, %d header(s), %d body bytes\n", r.ResponseStatus, len(r.ResponseHeader), r.BodyBytes)
		}
		fmt.Fprintf(tw, "retained until\t%s\n", r.ExpiresAt.Format(time.RFC3339Nano))
		if err := tw.Flush(); err != nil {
			return err
		}
		if r.Body != nil {
			fmt.Fprintf(stdout, "body:\n%s\n", *r.Body)
		} else if r.BodyBytes > 0 {
			fmt.Fprintln(stdout, "body hidden (--show-body prints it)")
		}
	}
	return nil
}

// one returns the single record sel names, refusing an ambiguous digest.
func one(ctx context.Context, s ops, sel *selector) (*idem.Record, error) {
	recs, err := find(ctx, s, sel)
	if err != nil {
		return nil, err
	}
	if len(recs) != 1 {
		return nil, usagef("digest %s names %d records: give --scope and --key", strings.ToLower(sel.digest), len(recs))
	}
	return recs[0], nil
}

func cmdPurge(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, c := flags("purge", stderr)
	var sel selector
	sel.register(fs)
	yes := fs.Bool("yes", false, "confirm the deletion")
	force := fs.Bool("force", false, "also delete processing records whose lease is live")
	token := fs.Int64("token", 0, "delete the record only while it carries this token")
	if err := parse(fs, args, 0); err != nil {
		return err
	}
	if err := sel.resolve(false); err != nil {
		return err
	}
	if !*yes {
		return usagef("purge deletes stored responses, so the next retry runs again: add --yes to confirm")
	}
	t, ctx, done, err := openFor(ctx, c, false)
	if err != nil {
		return err
	}
	defer done()
	opts := &idem.DeleteOptions{Force: *force, Token: *token}
	if sel.key == "" && sel.digest == "" {
		n, err := t.store.PurgeScope(ctx, sel.scope, opts)
		if c.json {
			_ = printJSON(stdout, map[string]any{"deleted": n})
		} else {
			fmt.Fprintf(stdout, "deleted %d record(s)\n", n)
		}
		return err
	}
	rec, err := one(ctx, t.store, &sel)
	if err != nil {
		return err
	}
	if err := t.store.Delete(ctx, rec.Scope, rec.Key, opts); err != nil {
		return err
	}
	if c.json {
		return printJSON(stdout, map[string]any{"deleted": 1, "digest": idem.KeyDigest(rec.Scope, rec.Key)})
	}
	fmt.Fprintf(stdout, "deleted record %s\n", idem.KeyDigest(rec.Scope, rec.Key))
	return nil
}

func cmdRelease(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, c := flags("release", stderr)
	var sel selector
	sel.register(fs)
	token := fs.Int64("token", 0, "the record's fencing token, as shown by idem inspect")
	if err := parse(fs, args, 0); err != nil {
		return err
	}
	if err := sel.resolve(true); err != nil {
		return err
	}
	if *token == 0 {
		return usagef("--token is needed: take it from idem inspect, after checking the business state")
	}
	t, ctx, done, err := openFor(ctx, c, false)
	if err != nil {
		return err
	}
	defer done()
	rec, err := one(ctx, t.store, &sel)
	if err != nil {
		return err
	}
	if err := t.store.ReleaseLease(ctx, rec.Scope, rec.Key, *token); err != nil {
		return err
	}
	d := idem.KeyDigest(rec.Scope, rec.Key)
	if c.json {
		return printJSON(stdout, map[string]any{"released": d})
	}
	fmt.Fprintf(stdout, "released %s: the next retry runs the request again\n", d)
	return nil
}

func cmdReap(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, c := flags("reap", stderr)
	once := fs.Bool("once", false, "run one pass (required: run the Reaper in your service for a loop)")
	if err := parse(fs, args, 0); err != nil {
		return err
	}
	if !*once {
		return usagef("idem reap runs one pass only: add --once")
	}
	t, ctx, done, err := openFor(ctx, c, false)
	if err != nil {
		return err
	}
	defer done()
	rep, err := t.reap(ctx)
	if c.json {
		_ = printJSON(stdout, map[string]int{
			"deleted": rep.Deleted, "finalised": rep.Finalised, "handed_over": rep.HandedOver,
			"unknown": rep.Unknown, "unresolved": rep.Unresolved, "errors": rep.Errors,
		})
	} else {
		fmt.Fprintf(stdout, "deleted %d expired record(s); %d stale lease(s) left to the service's status check\n", rep.Deleted, rep.Unresolved)
	}
	return err
}
