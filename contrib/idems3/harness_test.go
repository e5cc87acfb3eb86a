package idems3_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	gomysql "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/conformance"
	"github.com/idemstore/idem/contrib/idems3"
	"github.com/idemstore/idem/internal/testdb"
	idemmysql "github.com/idemstore/idem/mysql"
	idempg "github.com/idemstore/idem/postgres"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// The tests run against a real S3-compatible server on loopback, which
// .ci/s3.sh starts (SeaweedFS) and names in these variables. Without them
// the tests skip, or fail under CI or IDEM_TEST_REQUIRE_S3=1.
const (
	endpointEnv  = "IDEM_TEST_S3_ENDPOINT" // http://127.0.0.1:<port>
	bucketEnv    = "IDEM_TEST_S3_BUCKET"
	accessKeyEnv = "IDEM_TEST_S3_ACCESS_KEY"
	secretKeyEnv = "IDEM_TEST_S3_SECRET_KEY"
)

func s3Required() bool {
	return os.Getenv("CI") != "" || os.Getenv("IDEM_TEST_REQUIRE_S3") == "1"
}

// server is the S3 server of the environment.
type server struct {
	endpoint, bucket, access, secret string
}

func s3Server(t testing.TB) server {
	t.Helper()
	s := server{os.Getenv(endpointEnv), os.Getenv(bucketEnv), os.Getenv(accessKeyEnv), os.Getenv(secretKeyEnv)}
	if s.endpoint == "" || s.bucket == "" {
		if s3Required() {
			t.Fatalf("idems3: %s and %s are not set, and CI or IDEM_TEST_REQUIRE_S3=1 requires an S3 server (cd contrib/idems3 && bash ../../.ci/s3.sh run go test ./...)", endpointEnv, bucketEnv)
		}
		t.Skipf("idems3: %s and %s are not set; run them under `bash ../../.ci/s3.sh run go test ./...`, or set IDEM_TEST_REQUIRE_S3=1 to fail instead of skipping", endpointEnv, bucketEnv)
	}
	return s
}

// client returns an S3 client of the server at endpoint (the server's own,
// or a proxy's in front of it).
func (s server) client(endpoint string) *s3.Client {
	return s3.New(s3.Options{
		BaseEndpoint: aws.String(endpoint),
		Region:       "us-east-1",
		UsePathStyle: true,
		Credentials:  credentials.NewStaticCredentialsProvider(s.access, s.secret, ""),
		// Fail fast when the server is down: the down cases wait on it.
		RetryMaxAttempts: 2,
	})
}

// newPrefix is a prefix of the bucket no other test uses.
func newPrefix() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "t-" + hex.EncodeToString(b[:]) + "/"
}

// s3Stores is the conformance suite's BodyStoreHarness: every store has a
// prefix of its own in the bucket and reaches the server through a proxy
// on loopback whose port Break closes (the server is down, as far as the
// store can tell) and Mend opens again.
type s3Stores struct{ srv server }

func (h s3Stores) Open(ctx context.Context, t *testing.T) *conformance.BodyStoreFixture {
	t.Helper()
	p := newProxy(t, h.srv.endpoint)
	prefix := newPrefix()
	st, err := idems3.New(idems3.Config{Client: h.srv.client(p.url()), Bucket: h.srv.bucket, Prefix: prefix})
	require.NoError(t, err)
	direct := h.srv.client(h.srv.endpoint)
	t.Cleanup(func() { removePrefix(t, direct, h.srv.bucket, prefix) })
	aged := &agedStore{Store: st}
	key := func(a string) *string { return aws.String(prefix + a) }
	return &conformance.BodyStoreFixture{
		Store:     aged,
		PutBuffer: idems3.MinPartSize, // the default Config.PartSize
		Break:     p.close,
		Mend:      p.open,
		Age:       func(*testing.T) { aged.age(2 * time.Hour) },
		Remove: func(ctx context.Context, t *testing.T, a string) {
			_, err := direct.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: &h.srv.bucket, Key: key(a)})
			require.NoError(t, err)
		},
		Rewrite: func(ctx context.Context, t *testing.T, a string, edit func([]byte) []byte) {
			out, err := direct.GetObject(ctx, &s3.GetObjectInput{Bucket: &h.srv.bucket, Key: key(a)})
			require.NoError(t, err)
			data, err := io.ReadAll(out.Body)
			require.NoError(t, errors.Join(err, out.Body.Close()))
			data = edit(data)
			_, err = direct.PutObject(ctx, &s3.PutObjectInput{Bucket: &h.srv.bucket, Key: key(a),
				Body: bytes.NewReader(data), ContentLength: aws.Int64(int64(len(data)))})
			require.NoError(t, err)
		},
	}
}

// agedStore is the store whose List sees the objects it holds as written
// shift ago: the server sets LastModified and no S3 call backdates it, so
// a test that cannot wait out a sweep's grace period moves List's bound
// instead. Every call still reaches the real store and server.
type agedStore struct {
	*idems3.Store
	shift atomic.Int64
}

func (a *agedStore) age(d time.Duration) { a.shift.Store(int64(d)) }

func (a *agedStore) List(ctx context.Context, writtenBefore time.Time, fn func(string) error) error {
	return a.Store.List(ctx, writtenBefore.Add(time.Duration(a.shift.Load())), fn)
}

// removePrefix deletes what a test left under prefix.
func removePrefix(t *testing.T, c *s3.Client, bucket, prefix string) {
	ctx := context.Background()
	p := s3.NewListObjectsV2Paginator(c, &s3.ListObjectsV2Input{Bucket: &bucket, Prefix: &prefix})
	for p.HasMorePages() {
		page, err := p.NextPage(ctx)
		if !assert.NoError(t, err) {
			return
		}
		for _, o := range page.Contents {
			_, err := c.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: &bucket, Key: o.Key})
			assert.NoError(t, err)
		}
	}
}

// proxy forwards TCP connections from a loopback port of its own to the
// server. close closes the port and every connection through it, so that
// the store meets a refused connection, as when the server is down; open
// listens on the same port again.
type proxy struct {
	target string
	mu     sync.Mutex
	addr   string
	ln     net.Listener
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
}

func newProxy(t *testing.T, endpoint string) *proxy {
	t.Helper()
	u, err := parseHostPort(endpoint)
	require.NoError(t, err)
	p := &proxy{target: u, addr: "127.0.0.1:0", conns: map[net.Conn]struct{}{}}
	p.open(t)
	t.Cleanup(func() { p.close(t); p.wg.Wait() })
	return p
}

func parseHostPort(endpoint string) (string, error) {
	for _, scheme := range []string{"http://", "https://"} {
		if rest, ok := strings.CutPrefix(endpoint, scheme); ok {
			return rest, nil
		}
	}
	return "", errors.New("endpoint is not an http:// address")
}

func (p *proxy) url() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return "http://" + p.addr
}

func (p *proxy) open(t *testing.T) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	ln, err := net.Listen("tcp", p.addr)
	require.NoError(t, err)
	p.ln, p.addr = ln, ln.Addr().String()
	p.wg.Go(func() { p.serve(ln) })
}

func (p *proxy) serve(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		if p.ln != ln { // closed meanwhile
			p.mu.Unlock()
			_, _ = c.Close(), up.Close()
			return
		}
		p.conns[c], p.conns[up] = struct{}{}, struct{}{}
		p.mu.Unlock()
		p.wg.Go(func() { _, _ = io.Copy(up, c); _ = up.Close() })
		p.wg.Go(func() { _, _ = io.Copy(c, up); _ = c.Close() })
	}
}

func (p *proxy) close(*testing.T) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		_ = p.ln.Close()
		p.ln = nil
	}
	for c := range p.conns {
		_ = c.Close()
	}
	clear(p.conns)
}

// ---- dialects: the namespaces the conformance body-store cases use ----

type sqliteHarness struct{}

func (sqliteHarness) Open(ctx context.Context, t *testing.T) *conformance.Namespace[*sql.Tx] {
	t.Helper()
	db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, idemsqlite.Migrate(ctx, db))
	_, err = db.ExecContext(ctx, `CREATE TABLE orders (id INTEGER PRIMARY KEY, ref TEXT NOT NULL)`)
	require.NoError(t, err)
	return &conformance.Namespace[*sql.Tx]{
		Dialect: idemsqlite.New(db),
		InsertOrder: func(ctx context.Context, tx *sql.Tx, ref string) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO orders (ref) VALUES (?)`, ref)
			return err
		},
		CountOrders: func(ctx context.Context, ref string) (int, error) {
			var n int
			err := db.QueryRowContext(ctx, `SELECT count(*) FROM orders WHERE ref = ?`, ref).Scan(&n)
			return n, err
		},
		CountRecords: func(ctx context.Context) (int, error) {
			var n int
			err := db.QueryRowContext(ctx, `SELECT count(*) FROM idempotency_keys`).Scan(&n)
			return n, err
		},
		Close: func() { _ = db.Close() },
	}
}

func (sqliteHarness) Unreachable(_ context.Context, t *testing.T) idem.Dialect[*sql.Tx] {
	t.Helper()
	db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "missing", "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return idemsqlite.New(db)
}

func (sqliteHarness) Features() conformance.Features {
	return conformance.Features{TimePrecision: time.Microsecond, SingleWriter: true, WaitGranularity: time.Millisecond}
}

type pgHarness struct{ url string }

func (h pgHarness) Open(ctx context.Context, t *testing.T) *conformance.Namespace[pgx.Tx] {
	t.Helper()
	schema := testdb.Name()
	admin, err := pgx.Connect(ctx, h.url)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, "CREATE SCHEMA "+schema)
	require.NoError(t, errors.Join(err, admin.Close(ctx)))
	t.Cleanup(func() {
		ctx := context.WithoutCancel(ctx)
		admin, err := pgx.Connect(ctx, h.url)
		if assert.NoError(t, err) {
			_, err = admin.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE")
			assert.NoError(t, errors.Join(err, admin.Close(ctx)))
		}
	})
	cfg, err := pgxpool.ParseConfig(h.url)
	require.NoError(t, err)
	cfg.MaxConns = 4
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, idempg.Migrate(ctx, pool))
	_, err = pool.Exec(ctx, `CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, ref text NOT NULL)`)
	require.NoError(t, err)
	return &conformance.Namespace[pgx.Tx]{
		Dialect: idempg.New(pool),
		InsertOrder: func(ctx context.Context, tx pgx.Tx, ref string) error {
			_, err := tx.Exec(ctx, `INSERT INTO orders (ref) VALUES ($1)`, ref)
			return err
		},
		CountOrders: func(ctx context.Context, ref string) (int, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM orders WHERE ref = $1`, ref).Scan(&n)
			return n, err
		},
		CountRecords: func(ctx context.Context) (int, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys`).Scan(&n)
			return n, err
		},
		Close: pool.Close,
	}
}

func (pgHarness) Unreachable(ctx context.Context, t *testing.T) idem.Dialect[pgx.Tx] {
	t.Helper()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=2")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return idempg.New(pool)
}

func (pgHarness) Features() conformance.Features {
	return conformance.Features{TimePrecision: time.Microsecond, WaitAbortsTx: true, WaitGranularity: time.Millisecond}
}

type mysqlHarness struct{ cfg *gomysql.Config }

func newMySQLHarness(t *testing.T) mysqlHarness {
	t.Helper()
	dsn := testdb.MySQLDSN(t, func(dsn string) (string, error) {
		cfg, err := gomysql.ParseDSN(dsn)
		if err != nil {
			return "", err
		}
		return cfg.Addr, nil
	})
	cfg, err := gomysql.ParseDSN(dsn)
	require.NoError(t, err)
	cfg.ParseTime, cfg.Loc = true, time.UTC
	return mysqlHarness{cfg: cfg}
}

func (h mysqlHarness) open(t *testing.T, dbName string) *sql.DB {
	t.Helper()
	cfg := h.cfg.Clone()
	cfg.DBName = dbName
	conn, err := gomysql.NewConnector(cfg)
	require.NoError(t, err)
	db := sql.OpenDB(conn)
	db.SetMaxOpenConns(4)
	return db
}

func (h mysqlHarness) Open(ctx context.Context, t *testing.T) *conformance.Namespace[*sql.Tx] {
	t.Helper()
	name := testdb.Name()
	admin := h.open(t, "")
	t.Cleanup(func() { _ = admin.Close() })
	_, err := admin.ExecContext(ctx, "CREATE DATABASE "+name)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := admin.ExecContext(context.WithoutCancel(ctx), "DROP DATABASE IF EXISTS "+name)
		assert.NoError(t, err)
	})
	db := h.open(t, name)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, idemmysql.Migrate(ctx, db))
	_, err = db.ExecContext(ctx, `CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, ref VARCHAR(255) NOT NULL) ENGINE = InnoDB`)
	require.NoError(t, err)
	return &conformance.Namespace[*sql.Tx]{
		Dialect: idemmysql.New(db),
		InsertOrder: func(ctx context.Context, tx *sql.Tx, ref string) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO orders (ref) VALUES (?)`, ref)
			return err
		},
		CountOrders: func(ctx context.Context, ref string) (int, error) {
			var n int
			err := db.QueryRowContext(ctx, `SELECT count(*) FROM orders WHERE ref = ?`, ref).Scan(&n)
			return n, err
		},
		CountRecords: func(ctx context.Context) (int, error) {
			var n int
			err := db.QueryRowContext(ctx, `SELECT count(*) FROM idempotency_keys`).Scan(&n)
			return n, err
		},
		Close: func() { _ = db.Close() },
	}
}

func (h mysqlHarness) Unreachable(_ context.Context, t *testing.T) idem.Dialect[*sql.Tx] {
	t.Helper()
	cfg := h.cfg.Clone()
	cfg.Addr, cfg.Timeout = "127.0.0.1:1", 2*time.Second
	conn, err := gomysql.NewConnector(cfg)
	require.NoError(t, err)
	db := sql.OpenDB(conn)
	t.Cleanup(func() { _ = db.Close() })
	return idemmysql.New(db)
}

func (mysqlHarness) Features() conformance.Features {
	return conformance.Features{TimePrecision: time.Microsecond, WaitGranularity: time.Second}
}
