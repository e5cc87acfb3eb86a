// Command orders is an order API whose POST /orders is made safe to retry by
// idemhttp: a retry gets the original 201, a reused key a conflict, and a
// duplicate in flight never creates a second order.
//
//	go run ./examples/orders -demo          # scripted client, prints a table, exits 0 if all went as expected
//	go run ./examples/orders                # serves on 127.0.0.1:8080, SQLite in a temporary directory
//	go run ./examples/orders -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
//	go run ./examples/orders -db 'mysql://root@tcp(127.0.0.1:3306)/shop'
//	go run ./examples/orders -db 'postgres://...@pgbouncer:6432/shop?default_query_exec_mode=exec' -schema shop
//
// Behind a transaction pooler (PgBouncer, pool_mode=transaction), give
// -schema, so that every statement names its table rather than relying on
// a search_path the pooler does not keep, and a default_query_exec_mode
// (exec or simple_protocol) that keeps no prepared statement across
// transactions.
//
// The API:
//
//	POST /orders        Idempotency-Key, {"sku": "...", "qty": N, "amount_cents": N}
//	                    → 201, Location: /orders/{id}, the order
//	GET  /orders/{id}   → the order
//	GET  /orders        → {"count": N, "orders": [...]}
//	POST /payments      Idempotency-Key, {"amount_cents": N}
//	                    → 201, Location: /payments/{id}, the payment, charged once
//	                    at a (fake, in-memory) payment provider
//	POST /exports       Idempotency-Key → 201, a CSV of the tenant's orders; over
//	                    -inline-body-max it is kept in the body store (-bodies) and
//	                    a retry replays it from there, byte for byte
//
// Every request carries Authorization: Bearer <token>; the tenant it acts
// for is the token's (auth.go), never a header the client picks, because a
// stored response goes to whoever presents its tenant and key (see
// docs/security.md). The server prints a token for tenant acme when it
// starts; -token-secret (or $ORDERS_TOKEN_SECRET) fixes the signing secret.
//
// POST /orders writes to the database only: idemhttp claims its key inside
// the order's transaction. POST /payments calls a payment provider, which no
// rollback can undo: idemhttp's leased mode commits its claim before the
// provider is called, and the store's StatusCheck asks the provider about a
// holder that crashed.
//
// Two flags exist for the fault suite (faults/) and nothing else:
//
//	-provider-url URL   POST /payments charges an outside provider at URL
//	                    (POST URL/charges and POST URL/charges/lookup, JSON
//	                    {"key": ..., "amount_cents": N}; see payments.go)
//	                    instead of the in-memory fake, so that its charges
//	                    survive a crash of this process and the StatusCheck
//	                    of the restarted process can find them. The suite
//	                    plays many tenants with tokens signed with the
//	                    -token-secret it gives.
//	-fault-injection    TEST AID, off by default, never for production: a
//	                    request with X-Fault-Crash: before-claim, after-claim,
//	                    after-commit, before-provider-call,
//	                    during-provider-call or after-body-write makes the
//	                    process SIGKILL itself
//	                    at that stage (see faults.go).
//
// Try it with curl while it serves:
//
//	curl -i -X POST localhost:8080/orders -H 'Authorization: Bearer <the printed token>' \
//	    -H 'Idempotency-Key: order-0001-retry-me' -d '{"sku":"tea","qty":2,"amount_cents":900}'
//
// Run the same command again: the answer is the same 201, with
// Idempotency-Replayed: true, and GET /orders still counts one order.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/idemstore/idem"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	switch {
	case errors.Is(err, flag.ErrHelp): // -h: the usage is printed
	case err != nil:
		fmt.Fprintln(os.Stderr, "orders:", err)
		os.Exit(1)
	}
}

// options are the command line flags.
type options struct {
	addr string
	db   string
	// schema is the PostgreSQL schema of every table; empty: search_path's.
	schema       string
	retention    time.Duration
	lease        time.Duration
	waitTimeout  time.Duration
	reapInterval time.Duration
	handlerDelay time.Duration
	// providerDelay is how long the fake payment provider takes to charge.
	providerDelay time.Duration
	// providerURL is an outside payment provider; empty: in memory.
	providerURL string
	// tokenSecret signs the bearer tokens (auth.go); empty: random.
	tokenSecret string
	// faultInjection enables the X-Fault-Crash header (faults.go), a test aid.
	faultInjection bool
	// bodyDir is the DirBodyStore of responses over inlineBodyMax.
	bodyDir       string
	inlineBodyMax int
	demo          bool
	// set records the flags given on the command line.
	set map[string]bool
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{set: map[string]bool{}}
	fs := flag.NewFlagSet("orders", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.addr, "addr", "127.0.0.1:8080", "listen address")
	fs.StringVar(&o.db, "db", "", "an SQLite file path, a postgres:// URL, or mysql:// followed by a go-sql-driver DSN;\nempty: an SQLite file in a new temporary directory")
	fs.StringVar(&o.schema, "schema", "", "PostgreSQL only: the existing schema that holds every table (idem's and the service's),\nnamed in every statement, as a transaction pooler such as PgBouncer keeps no search_path;\nempty: the tables the connection's search_path finds")
	fs.DurationVar(&o.retention, "retention", 24*time.Hour, "how long a key's record is kept (idem.Config.Retention)")
	fs.DurationVar(&o.lease, "lease", 30*time.Second, "how long a processing record is presumed alive (idem.Config.LeaseDuration)")
	fs.DurationVar(&o.waitTimeout, "wait-timeout", 5*time.Second, "how long a duplicate waits for an in-flight original before 409 (idem.Config.WaitTimeout)")
	fs.DurationVar(&o.reapInterval, "reap-interval", time.Minute, "how often the reaper deletes expired records")
	fs.DurationVar(&o.handlerDelay, "handler-delay", 0, "how long POST /orders sleeps inside its transaction, to make in-flight duplicates easy to see")
	fs.DurationVar(&o.providerDelay, "provider-delay", 0, "how long the fake payment provider of POST /payments takes to charge")
	fs.StringVar(&o.providerURL, "provider-url", "", "base URL of an outside payment provider for POST /payments (POST /charges, POST /charges/lookup);\nempty: a fake provider in this process's memory, which forgets its charges when the process dies")
	fs.StringVar(&o.tokenSecret, "token-secret", os.Getenv("ORDERS_TOKEN_SECRET"), "the secret that signs bearer tokens (default $ORDERS_TOKEN_SECRET; empty: random, printed tokens last as long as the process)")
	fs.BoolVar(&o.faultInjection, "fault-injection", false, "TEST AID, never in production: honour the X-Fault-Crash request header, which kills the process (SIGKILL) at a chosen stage")
	fs.StringVar(&o.bodyDir, "bodies", "", "directory of the body store (idem.DirBodyStore) holding response bodies over -inline-body-max, such as POST /exports' CSV;\n\"table\": the database's idempotency_bodies table (NewTableBodyStore), where a body commits with its record; empty: a new temporary directory")
	fs.IntVar(&o.inlineBodyMax, "inline-body-max", idem.DefaultInlineBodyMax, "largest response body stored in the record; larger ones go to the body store (idem.Config.InlineBodyMax)")
	fs.BoolVar(&o.demo, "demo", false, "serve on a random local port, play a scripted client against it, print a table, and exit;\n-wait-timeout defaults to 300ms (1s on MySQL), -handler-delay to 500ms more, -provider-delay to 500ms")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	fs.Visit(func(f *flag.Flag) { o.set[f.Name] = true })
	return o, nil
}

// run starts the service and serves until ctx ends (SIGINT or SIGTERM in
// main), or, with -demo, until the scripted client is done. It returns nil
// after a clean shutdown, and an error when a demo step went wrong.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(stderr, nil))
	if o.demo {
		logger = slog.New(slog.DiscardHandler)
		o.addr = "127.0.0.1:0"
	}

	db, err := openDatabase(ctx, o.db, o.schema)
	if err != nil {
		return err
	}
	defer db.close()
	if o.demo {
		demoTimings(o, db.dialect)
	}
	svc, err := db.service(ctx, o, logger)
	if err != nil {
		return err
	}

	// Not ctx itself: as with net.Listen, a signal that arrives during
	// startup must still end in a clean shutdown, not a failed listen.
	ln, err := (&net.ListenConfig{}).Listen(context.WithoutCancel(ctx), "tcp", o.addr)
	if err != nil {
		return err
	}
	handler := svc.handler
	if o.faultInjection {
		handler = withFaultInjection(handler)
		logger.Warn("orders: fault injection is on: X-Fault-Crash kills this process")
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(logger.Handler(), slog.LevelWarn)}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()

	reapCtx, stopReaper := context.WithCancel(ctx)
	var reaping sync.WaitGroup
	reaping.Go(func() { svc.reap(reapCtx) })

	base := "http://" + ln.Addr().String()
	fmt.Fprintf(stdout, "orders: serving on %s (database: %s)\n", base, db.describe)
	if !o.demo {
		fmt.Fprintf(stdout, "orders: authenticate as tenant acme with -H 'Authorization: Bearer %s'\n", svc.token("acme"))
	}

	var demoErr error
	if o.demo {
		demoErr = playDemo(ctx, stdout, base, db, svc, o)
	} else {
		select {
		case <-ctx.Done():
		case err := <-serveErr:
			stopReaper()
			reaping.Wait()
			return err
		}
	}

	// Shut down: stop accepting, let requests in flight finish (their
	// transactions commit), stop the reaper, then close the database.
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	err = srv.Shutdown(shutdownCtx)
	stopReaper()
	reaping.Wait()
	if !o.demo {
		fmt.Fprintln(stdout, "orders: stopped")
	}
	if serr := <-serveErr; !errors.Is(serr, http.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	return errors.Join(demoErr, err)
}

// demoTimings picks a handler delay longer than the wait timeout, so that
// the demo's in-flight duplicate meets an original that is still running,
// unless the flags set them. MySQL counts lock waits in whole seconds.
func demoTimings(o *options, dialect string) {
	if !o.set["wait-timeout"] {
		o.waitTimeout = 300 * time.Millisecond
		if dialect == dialectMySQL {
			o.waitTimeout = time.Second
		}
	}
	if !o.set["handler-delay"] {
		o.handlerDelay = o.waitTimeout + 500*time.Millisecond
	}
	if !o.set["provider-delay"] {
		o.providerDelay = 500 * time.Millisecond
	}
}
