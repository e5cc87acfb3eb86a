//go:build faults

package faults

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
	"github.com/idemstore/idem/internal/testdb"
	idemmysql "github.com/idemstore/idem/mysql"
	idempg "github.com/idemstore/idem/postgres"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// This file is the order service the outage and soak scenarios drive inside
// the test process: a small copy of examples/orders (a package main, which
// cannot be imported). POST /orders runs behind idemhttp's transactional mode
// and inserts an order row in the claimed transaction; POST /payments runs
// behind the leased mode, charges a fake provider outside the database and
// records the payment in the transaction it then takes. A reaper runs for
// the service's whole life.
//
// The business tables have no unique constraint on (tenant, key) on purpose:
// a handler whose effect committed twice shows as two rows, which is what
// the scenarios count as a duplicate.

// inprocConfig tunes the service; zero fields take the defaults noted.
type inprocConfig struct {
	// Retention is idem.Config.Retention. Defaults to 24h.
	Retention time.Duration
	// Lease is idem.Config.LeaseDuration. Defaults to 30s.
	Lease time.Duration
	// WaitTimeout is idem.Config.WaitTimeout. Defaults to 5s.
	WaitTimeout time.Duration
	// ReapInterval is the reaper's interval. Defaults to 1s.
	ReapInterval time.Duration
	// Timeout is idemhttp.Config.Timeout. Defaults to 10s.
	Timeout time.Duration
}

// inprocKey names one idempotent request: a tenant's key on a route.
type inprocKey struct {
	Route  string // inprocOrders or inprocPayments
	Tenant string
	Key    string
}

// The service's two protected routes.
const (
	inprocOrders   = "/orders"
	inprocPayments = "/payments"
)

// inprocService is the running service and what the scenarios need to check
// its effects.
type inprocService struct {
	Dialect string
	URL     string
	client  *http.Client
	prov    *inprocProvider
	// effects counts the business rows per tenant and key, orders and
	// payments apart.
	effects func(ctx context.Context) (map[inprocKey]int, error)
	// keyRows counts the rows of idempotency_keys.
	keyRows func(ctx context.Context) (int, error)
	// Reaped counts the records the reaper deleted; ReapErrors its failed
	// statements.
	Reaped, ReapErrors atomic.Int64
}

// inprocRepo is the business side of the service on one database.
type inprocRepo[TTx any] interface {
	insertOrder(ctx context.Context, tx TTx, tenant, key string, amount int64) (int64, error)
	insertPayment(ctx context.Context, tx TTx, tenant, key, chargeID string, amount int64) (int64, error)
	effects(ctx context.Context) (map[inprocKey]int, error)
	keyRows(ctx context.Context) (int, error)
}

// inprocStart serves the API over d and repo until t ends.
func inprocStart[TTx any](t *testing.T, dialect string, d idem.Dialect[TTx], repo inprocRepo[TTx], cfg inprocConfig) *inprocService {
	t.Helper()
	if cfg.ReapInterval == 0 {
		cfg.ReapInterval = time.Second
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
	}
	prov := &inprocProvider{charges: map[string]inprocCharge{}}
	// Every record, debug included, goes through the log scan; the sink
	// checks after the server and the reaper stopped (cleanups run last
	// first).
	logger := logSinkLogger(t, "in-process service on "+dialect)
	store, err := idem.New(d, &idem.Config{
		Logger:        logger,
		Retention:     cfg.Retention,
		LeaseDuration: cfg.Lease,
		WaitTimeout:   cfg.WaitTimeout,
		StatusCheck:   prov.status,
	})
	if err != nil {
		t.Fatalf("idem.New: %v", err)
	}
	svc := &inprocService{Dialect: dialect, prov: prov, effects: repo.effects, keyRows: repo.keyRows}
	reaper, err := idem.NewReaper(store, &idem.ReaperConfig{
		Interval: cfg.ReapInterval,
		OnReport: func(r idem.ReapReport) {
			svc.Reaped.Add(int64(r.Deleted))
			svc.ReapErrors.Add(int64(r.Errors))
		},
	})
	if err != nil {
		t.Fatalf("idem.NewReaper: %v", err)
	}

	mw := idemhttp.Config{
		Tenant: func(r *http.Request) (string, error) {
			if tn := r.Header.Get("X-Tenant-ID"); tn != "" {
				return tn, nil
			}
			return "", &idemhttp.Error{Status: http.StatusBadRequest, Code: "tenant_missing", Message: "X-Tenant-ID is required."}
		},
		Timeout: cfg.Timeout,
		Logger:  logger,
	}
	leased := mw
	leased.Mode = idemhttp.Leased
	a := &inprocAPI[TTx]{repo: repo, prov: prov}
	mux := http.NewServeMux()
	orders, err := idemhttp.New(store, &mw)
	if err != nil {
		t.Fatalf("idemhttp.New: %v", err)
	}
	payments, err := idemhttp.New(store, &leased)
	if err != nil {
		t.Fatalf("idemhttp.New: %v", err)
	}
	mux.Handle("POST "+inprocOrders, orders.Wrap(http.HandlerFunc(a.createOrder)))
	mux.Handle("POST "+inprocPayments, payments.Wrap(http.HandlerFunc(a.pay)))
	srv := httptest.NewServer(mux)
	svc.URL = srv.URL
	// Idle connections close after a second: a burst of slow requests
	// (a checkpoint, the reaper's batch) opens connections that would
	// otherwise stay idle for the rest of the run, three goroutines each,
	// which the soak's goroutine count would read as a leak.
	tr := &http.Transport{MaxIdleConns: 64, MaxIdleConnsPerHost: 64, IdleConnTimeout: time.Second}
	svc.client = &http.Client{Transport: tr, Timeout: 2 * cfg.Timeout}

	reapCtx, stopReaper := context.WithCancel(context.Background())
	var reaping sync.WaitGroup
	reaping.Go(func() { _ = reaper.Run(reapCtx) })
	// Registered after the database's cleanup, so it runs before it: the
	// server and the reaper stop while the database is still open.
	t.Cleanup(func() {
		srv.Close()
		tr.CloseIdleConnections()
		stopReaper()
		reaping.Wait()
	})
	return svc
}

// inprocAPI holds the handlers.
type inprocAPI[TTx any] struct {
	repo inprocRepo[TTx]
	prov *inprocProvider
}

// inprocBody is the body of both POSTs and of their 201s.
type inprocBody struct {
	ID       int64  `json:"id,omitempty"`
	Amount   int64  `json:"amount"`
	ChargeID string `json:"charge_id,omitempty"`
	// Recovered marks a 201 rebuilt by the status check from the provider.
	Recovered bool `json:"recovered,omitempty"`
}

// createOrder runs in the transaction the middleware claimed the key in.
// A failed insert answers the business's own 503: not final, so the
// middleware rolls the transaction back and the key stays free.
func (a *inprocAPI[TTx]) createOrder(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	tx, ok := idemhttp.Tx[TTx](ctx)
	key, _ := idemhttp.Key(ctx)
	if !ok {
		inprocError(w, http.StatusInternalServerError, "no_transaction")
		return
	}
	var in inprocBody
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Amount <= 0 {
		inprocError(w, http.StatusBadRequest, "invalid_body")
		return
	}
	id, err := a.repo.insertOrder(ctx, tx, r.Header.Get("X-Tenant-ID"), key, in.Amount)
	if err != nil {
		inprocError(w, http.StatusServiceUnavailable, "order_unavailable")
		return
	}
	inprocJSON(w, http.StatusCreated, inprocBody{ID: id, Amount: in.Amount})
}

// pay charges the provider outside any transaction, then records the
// payment in the transaction idemhttp.Tx begins, where the lease completes.
func (a *inprocAPI[TTx]) pay(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	key, _ := idemhttp.Key(ctx)
	scope, _ := idemhttp.Scope(ctx)
	var in inprocBody
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Amount <= 0 {
		inprocError(w, http.StatusBadRequest, "invalid_body")
		return
	}
	c := a.prov.charge(scope, key, in.Amount)
	tx, ok := idemhttp.Tx[TTx](ctx)
	if !ok {
		inprocError(w, http.StatusServiceUnavailable, "payment_unavailable")
		return
	}
	id, err := a.repo.insertPayment(ctx, tx, r.Header.Get("X-Tenant-ID"), key, c.ID, c.Amount)
	if err != nil {
		inprocError(w, http.StatusServiceUnavailable, "payment_unavailable")
		return
	}
	inprocJSON(w, http.StatusCreated, inprocBody{ID: id, Amount: c.Amount, ChargeID: c.ID})
}

func inprocJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		status, body = http.StatusInternalServerError, []byte(`{"code":"encoding_failed"}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// inprocError answers in idemhttp's JSON error contract.
func inprocError(w http.ResponseWriter, status int, code string) {
	idemhttp.WriteError(w, &idemhttp.Error{Status: status, Code: code, Message: code})
}

// inprocProvider is a fake payment provider. Like a real one it
// deduplicates charges on the key it is given, so a lease released after the
// charge (the database failed before the payment was recorded) and retried
// does not charge twice; Calls counts every call.
type inprocProvider struct {
	mu      sync.Mutex
	charges map[string]inprocCharge
	calls   int
}

type inprocCharge struct {
	ID     string
	Amount int64
}

func (p *inprocProvider) charge(scope, key string, amount int64) inprocCharge {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	k := scope + "\x1f" + key
	c, ok := p.charges[k]
	if !ok {
		c = inprocCharge{ID: "ch_" + strings.ToLower(rand.Text()), Amount: amount}
		p.charges[k] = c
	}
	return c
}

// charged reports whether the provider holds a charge for a tenant's key on
// POST /payments.
func (p *inprocProvider) charged(tenant, key string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.charges[tenant+" POST "+inprocPayments+"\x1f"+key]
	return ok
}

// status is the store's StatusCheck: a payment whose holder lost its lease
// (the database went away before the completion) is settled by asking the
// provider. Orders claim inside their transaction and never need it.
func (p *inprocProvider) status(_ context.Context, rec idem.Record) (idem.Verdict, error) {
	if !strings.HasSuffix(rec.Scope, " POST "+inprocPayments) {
		return idem.Unknown(), nil
	}
	p.mu.Lock()
	c, ok := p.charges[rec.Scope+"\x1f"+rec.Key]
	p.mu.Unlock()
	if !ok {
		return idem.NotCommitted(), nil
	}
	body, err := json.Marshal(inprocBody{Amount: c.Amount, ChargeID: c.ID, Recovered: true})
	if err != nil {
		return idem.Unknown(), err
	}
	return idem.Committed(&idem.Response{
		StatusCode: http.StatusCreated,
		Header:     http.Header{"Content-Type": {"application/json"}},
		Body:       body,
	}), nil
}

// ---- the client side ----

// inprocAnswer is what a client saw for one request.
type inprocAnswer struct {
	Status   int
	Code     string // the JSON error code of a failure
	Replayed bool
	Body     inprocBody
	Err      error // transport error: no answer at all
	Latency  time.Duration
}

// Label is the answer's row in the "answers by code" column.
func (a inprocAnswer) Label() string {
	switch {
	case a.Err != nil:
		return "transport error"
	case a.Replayed:
		return fmt.Sprintf("%d replayed", a.Status)
	case a.Code != "":
		return fmt.Sprintf("%d %s", a.Status, a.Code)
	default:
		return fmt.Sprint(a.Status)
	}
}

// post sends one protected request. The key and tenant go in headers only;
// nothing here logs them.
func (s *inprocService) post(ctx context.Context, k inprocKey, amount int64) inprocAnswer {
	body, _ := json.Marshal(inprocBody{Amount: amount})
	logSecrets.addRequest(k.Tenant, k.Key, http.MethodPost, k.Route, string(body))
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.URL+k.Route, bytes.NewReader(body))
	if err != nil {
		return inprocAnswer{Err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Tenant-ID", k.Tenant)
	req.Header.Set("Idempotency-Key", k.Key)
	start := time.Now()
	resp, err := s.client.Do(req)
	if err != nil {
		return inprocAnswer{Err: err, Latency: time.Since(start)}
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	a := inprocAnswer{Status: resp.StatusCode, Replayed: resp.Header.Get("Idempotency-Replayed") == "true", Latency: time.Since(start)}
	if err != nil {
		a.Err = err
		return a
	}
	if resp.StatusCode >= 400 {
		var e struct {
			Code string `json:"code"`
		}
		if json.Unmarshal(raw, &e) != nil || e.Code == "" {
			e.Code = "unparsed"
		}
		a.Code = e.Code
		return a
	}
	if json.Unmarshal(raw, &a.Body) != nil {
		a.Code = "unparsed"
	}
	return a
}

// inprocCheck counts duplicates and lost acknowledged requests: every key a
// client saw a 201 for (acked) must have exactly one business row, except a
// payment whose 201 the status check rebuilt from the provider's charge (its
// row is for reconciliation to add, as in examples/orders); and no key may
// have more than one row, acknowledged or not.
func inprocCheck(ctx context.Context, s *inprocService, acked map[inprocKey]inprocAnswer) (dups, lost int, err error) {
	rows, err := s.effects(ctx)
	if err != nil {
		return 0, 0, fmt.Errorf("count the business rows: %w", err)
	}
	for _, n := range rows {
		if n > 1 {
			dups += n - 1
		}
	}
	for k, a := range acked {
		switch {
		case rows[k] > 0:
		case k.Route == inprocPayments && a.Body.Recovered && s.prov.charged(k.Tenant, k.Key):
		default:
			lost++
		}
	}
	return dups, lost, nil
}

// inprocNewKey returns a fresh key valid for idemhttp's default format.
func inprocNewKey(prefix string) string {
	return prefix + "-" + strings.ToLower(rand.Text())[:20]
}

// ---- the databases ----

// The business tables, one set per dialect.
const (
	// inprocPGSchema takes the orders and payments tables' names (pgTable).
	inprocPGSchema = `
		CREATE TABLE %s (
			id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
			tenant   text NOT NULL,
			idem_key text NOT NULL,
			amount   bigint NOT NULL
		);
		CREATE TABLE %s (
			id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
			tenant    text NOT NULL,
			idem_key  text NOT NULL,
			charge_id text NOT NULL,
			amount    bigint NOT NULL
		)`
	inprocMySQLOrders = `CREATE TABLE orders (
			id       BIGINT AUTO_INCREMENT PRIMARY KEY,
			tenant   VARCHAR(255) NOT NULL,
			idem_key VARCHAR(255) NOT NULL,
			amount   BIGINT NOT NULL
		) ENGINE = InnoDB`
	inprocMySQLPayments = `CREATE TABLE payments (
			id        BIGINT AUTO_INCREMENT PRIMARY KEY,
			tenant    VARCHAR(255) NOT NULL,
			idem_key  VARCHAR(255) NOT NULL,
			charge_id VARCHAR(255) NOT NULL,
			amount    BIGINT NOT NULL
		) ENGINE = InnoDB`
	inprocSQLiteOrders = `CREATE TABLE orders (
			id       INTEGER PRIMARY KEY,
			tenant   TEXT NOT NULL,
			idem_key TEXT NOT NULL,
			amount   INTEGER NOT NULL
		)`
	inprocSQLitePayments = `CREATE TABLE payments (
			id        INTEGER PRIMARY KEY,
			tenant    TEXT NOT NULL,
			idem_key  TEXT NOT NULL,
			charge_id TEXT NOT NULL,
			amount    INTEGER NOT NULL
		)`
	// inprocEffects counts the rows per route, tenant and key; the same
	// text runs on every dialect (PostgreSQL's with qualified names).
	inprocEffects = `SELECT '` + inprocOrders + `', tenant, idem_key, count(*) FROM orders GROUP BY tenant, idem_key
		UNION ALL
		SELECT '` + inprocPayments + `', tenant, idem_key, count(*) FROM payments GROUP BY tenant, idem_key`
	inprocKeyRows = `SELECT count(*) FROM idempotency_keys`
)

// inprocPGNames are the tables of the in-process service on PostgreSQL,
// qualified with its schema (pgTable): no statement depends on a
// search_path, which a transaction pooler does not keep.
type inprocPGNames struct{ orders, payments, keys string }

func newInprocPGNames(schema string) inprocPGNames {
	return inprocPGNames{orders: pgTable(schema, "orders"), payments: pgTable(schema, "payments"), keys: pgTable(schema, "idempotency_keys")}
}

func (n inprocPGNames) effects() string {
	return `SELECT '` + inprocOrders + `', tenant, idem_key, count(*) FROM ` + n.orders + ` GROUP BY tenant, idem_key
		UNION ALL
		SELECT '` + inprocPayments + `', tenant, idem_key, count(*) FROM ` + n.payments + ` GROUP BY tenant, idem_key`
}

// inprocSQLRepo is inprocRepo on database/sql (MariaDB, SQLite).
type inprocSQLRepo struct{ db *sql.DB }

func (r inprocSQLRepo) insertOrder(ctx context.Context, tx *sql.Tx, tenant, key string, amount int64) (int64, error) {
	res, err := tx.ExecContext(ctx, `INSERT INTO orders (tenant, idem_key, amount) VALUES (?, ?, ?)`, tenant, key, amount)
	if err != nil {
		return 0, err
	}
	return res.LastInsertId()
}

func (r inprocSQLRepo) insertPayment(ctx context.Context, tx *sql.Tx, tenant, key, chargeID string, amount int64) (int64, error) {
	res, err := tx.ExecContext(ctx, `INSERT INTO payments (tenant, idem_key, charge_id, amount) VALUES (?, ?, ?, ?)`, tenant, key, chargeID, amount)
	if err != nil {
		return 0, err
	}
	return res.LastInsertId()
}

func (r inprocSQLRepo) effects(ctx context.Context) (map[inprocKey]int, error) {
	rows, err := r.db.QueryContext(ctx, inprocEffects)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[inprocKey]int{}
	for rows.Next() {
		var k inprocKey
		var n int
		if err := rows.Scan(&k.Route, &k.Tenant, &k.Key, &n); err != nil {
			return nil, err
		}
		out[k] = n
	}
	return out, rows.Err()
}

func (r inprocSQLRepo) keyRows(ctx context.Context) (int, error) {
	var n int
	err := r.db.QueryRowContext(ctx, inprocKeyRows).Scan(&n)
	return n, err
}

// inprocPGRepo is inprocRepo on pgx.
type inprocPGRepo struct {
	pool  *pgxpool.Pool
	names inprocPGNames
}

func (r inprocPGRepo) insertOrder(ctx context.Context, tx pgx.Tx, tenant, key string, amount int64) (int64, error) {
	var id int64
	err := tx.QueryRow(ctx, `INSERT INTO `+r.names.orders+` (tenant, idem_key, amount) VALUES ($1, $2, $3) RETURNING id`, tenant, key, amount).Scan(&id)
	return id, err
}

func (r inprocPGRepo) insertPayment(ctx context.Context, tx pgx.Tx, tenant, key, chargeID string, amount int64) (int64, error) {
	var id int64
	err := tx.QueryRow(ctx, `INSERT INTO `+r.names.payments+` (tenant, idem_key, charge_id, amount) VALUES ($1, $2, $3, $4) RETURNING id`,
		tenant, key, chargeID, amount).Scan(&id)
	return id, err
}

func (r inprocPGRepo) effects(ctx context.Context) (map[inprocKey]int, error) {
	rows, err := r.pool.Query(ctx, r.names.effects())
	if err != nil {
		return nil, err
	}
	out := map[inprocKey]int{}
	var k inprocKey
	var n int
	_, err = pgx.ForEachRow(rows, []any{&k.Route, &k.Tenant, &k.Key, &n}, func() error {
		out[k] = n
		return nil
	})
	return out, err
}

func (r inprocPGRepo) keyRows(ctx context.Context) (int, error) {
	var n int
	err := r.pool.QueryRow(ctx, `SELECT count(*) FROM `+r.names.keys).Scan(&n)
	return n, err
}

// inprocOpenSQLite starts the service on a fresh SQLite file in dir.
func inprocOpenSQLite(t *testing.T, dir string, cfg inprocConfig) (*inprocService, *sql.DB) {
	t.Helper()
	ctx := t.Context()
	db, err := idemsqlite.Open(filepath.Join(dir, "orders.db"))
	if err != nil {
		t.Fatalf("open SQLite: %v", err)
	}
	t.Cleanup(func() { _ = db.Close() })
	if err := idemsqlite.Migrate(ctx, db); err != nil {
		t.Fatalf("migrate SQLite: %v", err)
	}
	for _, q := range []string{inprocSQLiteOrders, inprocSQLitePayments} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatalf("create the business tables: %v", err)
		}
	}
	repo := inprocSQLRepo{db: db}
	return inprocStart(t, dialectSQLite, idemsqlite.New(db), repo, cfg), db
}

// inprocPGAppName is the application_name of the service's connections on
// PostgreSQL, by which the outage scenario finds the backends to terminate.
const inprocPGAppName = "idem-faults-inproc"

// inprocOpenPostgres starts the service on the PostgreSQL at url, in a fresh
// schema when fresh is set (a shared server) or in the database's default
// schema (a private server owned by the test). The fresh schema is named in
// every statement (postgres.WithSchema, qualified business tables), never
// chosen with search_path, and the pool uses pgExecURL's exec mode: both
// work through a transaction pooler.
func inprocOpenPostgres(t *testing.T, url string, fresh bool, cfg inprocConfig) *inprocService {
	t.Helper()
	ctx := t.Context()
	url = pgExecURL(t, url)
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("parse the PostgreSQL URL: %v", err)
	}
	pcfg.MaxConns = 8
	pcfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pcfg.ConnConfig.RuntimeParams["application_name"] = inprocPGAppName
	var opts []idempg.Option
	names := newInprocPGNames("")
	if fresh {
		schema := testdb.Name()
		admin, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatalf("connect to PostgreSQL: %v", err)
		}
		defer admin.Close(context.WithoutCancel(ctx))
		// The schema name is generated (idem_t_ and hex): safe unquoted.
		if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
			t.Fatalf("create schema: %v", err)
		}
		t.Cleanup(func() {
			cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			conn, err := pgx.Connect(cctx, url)
			if err != nil {
				t.Errorf("drop schema: %v", err)
				return
			}
			defer conn.Close(cctx)
			if _, err := conn.Exec(cctx, "DROP SCHEMA "+schema+" CASCADE"); err != nil {
				t.Errorf("drop schema: %v", err)
			}
		})
		opts = append(opts, idempg.WithSchema(schema))
		names = newInprocPGNames(schema)
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatalf("open the pool: %v", err)
	}
	t.Cleanup(pool.Close)
	if err := idempg.Migrate(ctx, pool, opts...); err != nil {
		t.Fatalf("migrate PostgreSQL: %v", err)
	}
	if _, err := pool.Exec(ctx, fmt.Sprintf(inprocPGSchema, names.orders, names.payments)); err != nil {
		t.Fatalf("create the business tables: %v", err)
	}
	return inprocStart(t, dialectPostgres, idempg.New(pool, opts...), inprocPGRepo{pool: pool, names: names}, cfg)
}

// inprocMySQLConfig parses dsn with the parameters idem needs.
func inprocMySQLConfig(t *testing.T, dsn string) *gomysql.Config {
	t.Helper()
	c, err := gomysql.ParseDSN(dsn)
	if err != nil {
		t.Fatalf("parse the MySQL DSN: %v", err)
	}
	c.ParseTime = true
	c.Loc = time.UTC
	c.InterpolateParams = true
	c.Timeout = 2 * time.Second
	// The driver prints every connection an outage breaks; the scenarios
	// count the answers instead.
	c.Logger = &gomysql.NopLogger{}
	return c
}

// inprocOpenMySQL starts the service on a fresh database of the MariaDB
// server at dsn, and returns it with the database's name.
func inprocOpenMySQL(t *testing.T, dsn string, cfg inprocConfig) (*inprocService, string) {
	t.Helper()
	ctx := t.Context()
	mcfg := inprocMySQLConfig(t, dsn)
	admin := inprocMySQLDB(t, mcfg, 1)
	name := testdb.Name()
	// The name is generated (idem_t_ and hex): safe unquoted.
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatalf("create database: %v", err)
	}
	t.Cleanup(func() {
		cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.ExecContext(cctx, "DROP DATABASE IF EXISTS "+name); err != nil {
			t.Errorf("drop database: %v", err)
		}
	})
	scfg := mcfg.Clone()
	scfg.DBName = name
	db := inprocMySQLDB(t, scfg, 8)
	if err := idemmysql.Migrate(ctx, db); err != nil {
		t.Fatalf("migrate MariaDB: %v", err)
	}
	for _, q := range []string{inprocMySQLOrders, inprocMySQLPayments} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatalf("create the business tables: %v", err)
		}
	}
	return inprocStart(t, dialectMySQL, idemmysql.New(db), inprocSQLRepo{db: db}, cfg), name
}

// inprocMySQLDB opens a pool of at most conns connections, closed when t
// ends, through idem's connector (Do's BEGIN with its claim, its COMMIT
// with its completion), as examples/orders does.
func inprocMySQLDB(t *testing.T, cfg *gomysql.Config, conns int) *sql.DB {
	t.Helper()
	connector, err := idemmysql.NewConnector(cfg)
	if err != nil {
		t.Fatalf("MySQL connector: %v", err)
	}
	db := sql.OpenDB(connector)
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// inprocMySQLAddr extracts the address of a DSN, for testdb.MySQLDSN.
func inprocMySQLAddr(dsn string) (string, error) {
	c, err := gomysql.ParseDSN(dsn)
	if err != nil {
		return "", err
	}
	return c.Addr, nil
}

// inprocIsUnavailable reports whether a is one of the answers a client may
// get while the database is away: the middleware's 503, the business's own
// 503, or a 409 for a key whose earlier attempt still holds it. A transport
// error is not one: the HTTP server stays up through a database outage.
func inprocIsUnavailable(a inprocAnswer) bool {
	switch {
	case a.Err != nil:
		return false
	case a.Status == http.StatusServiceUnavailable:
		return a.Code == idemhttp.CodeStoreUnavailable || a.Code == idemhttp.CodeLeaseLost ||
			a.Code == "order_unavailable" || a.Code == "payment_unavailable"
	case a.Status == http.StatusConflict:
		return a.Code == idemhttp.CodeInProgress
	}
	return false
}
