package mysql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/testdb"
	"github.com/idemstore/idem/internal/workload"
	idemmysql "github.com/idemstore/idem/mysql"
)

// BenchmarkReplayDo compares a replay through Store.Do (its read on the
// pool first) with the bare primary-key SELECT of the same rows, from 8
// goroutines on a pool of 8: the pair of issue 17's replay target.
func BenchmarkReplayDo(b *testing.B) {
	ctx := context.Background()
	dsn := testdb.MySQLDSN(b, func(dsn string) (string, error) {
		cfg, err := gomysql.ParseDSN(dsn)
		if err != nil {
			return "", err
		}
		return cfg.Addr, nil
	})
	base, err := gomysql.ParseDSN(dsn)
	if err != nil {
		b.Fatal(err)
	}
	name := testdb.Name()
	server := benchMySQLDB(b, base, "", 2)
	if _, err := server.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _, _ = server.ExecContext(context.Background(), "DROP DATABASE IF EXISTS "+name) })
	db := benchMySQLDB(b, base, name, 8)
	if err := idemmysql.Migrate(ctx, db); err != nil {
		b.Fatal(err)
	}
	store, err := idem.New(idemmysql.New(db), &idem.Config{ReplayRead: idem.ReplayReadAlways})
	if err != nil {
		b.Fatal(err)
	}
	type sk struct{ scope, key string }
	keys := make([]sk, 200)
	for i := range keys {
		keys[i] = sk{fmt.Sprintf("tenant-%02d", i%10), workload.NewKey()}
	}
	noop := func(context.Context, *sql.Tx, string) error { return nil }
	if err := workload.Complete(ctx, store, noop, len(keys), func(i int) (string, string) { return keys[i].scope, keys[i].key }); err != nil {
		b.Fatal(err)
	}
	run := func(b *testing.B, op func(ctx context.Context, k sk) error) {
		b.SetParallelism(4) // 8 goroutines on 2 cores
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := op(ctx, keys[rand.IntN(len(keys))]); err != nil { //nolint:gosec // workload randomness
					b.Error(err)
					return
				}
			}
		})
	}
	scan := func(q string, args ...any) error {
		var (
			status       int16
			fp, hdr, bdy []byte
			code         sql.NullInt64
		)
		return db.QueryRowContext(ctx, q, args...).Scan(&fp, &status, &code, &hdr, &bdy)
	}
	const cols = `SELECT fingerprint, status, response_status, response_headers, response_body FROM idempotency_keys `
	pkOp := func(ctx context.Context, k sk) error {
		return scan(cols+`WHERE scope = ? AND idempotency_key = ?`, k.scope, k.key)
	}
	replayOp := func(ctx context.Context, k sk) error {
		res, err := store.Do(ctx, k.scope, k.key, workload.Fingerprint, func(context.Context, *sql.Tx) (*idem.Response, error) {
			return nil, errors.New("completed key executed again")
		})
		if err == nil && !res.Replayed {
			err = errors.New("not replayed")
		}
		return err
	}
	b.Run("pkselect", func(b *testing.B) {
		run(b, func(ctx context.Context, k sk) error { return pkOp(ctx, k) })
	})
	b.Run("gcsql", func(b *testing.B) {
		run(b, func(ctx context.Context, k sk) error {
			return scan(cols+`WHERE scope = ? AND idempotency_key = ? AND expires_at > COALESCE(CAST(? AS DATETIME(6)), UTC_TIMESTAMP(6))`, []byte(k.scope), []byte(k.key), nil)
		})
	})
	b.Run("gcsql2", func(b *testing.B) {
		run(b, func(ctx context.Context, k sk) error {
			return scan(cols+`WHERE scope = ? AND idempotency_key = ? AND expires_at > UTC_TIMESTAMP(6)`, k.scope, k.key)
		})
	})
	b.Run("replay", func(b *testing.B) {
		run(b, func(ctx context.Context, k sk) error { return replayOp(ctx, k) })
	})
	// mixed runs both in turn on every goroutine, so that both see the same
	// load (the machine is shared): pk/replay is the ratio of their mean
	// latencies, at a fixed number of workers the ratio of their rates.
	b.Run("mixed", func(b *testing.B) {
		var pkNs, replayNs atomic.Int64
		var turn atomic.Bool
		run(b, func(ctx context.Context, k sk) error {
			ops := [2]func(context.Context, sk) error{pkOp, replayOp}
			sums := [2]*atomic.Int64{&pkNs, &replayNs}
			first := 0
			if turn.Load() {
				first = 1
			}
			turn.Store(!turn.Load())
			for n := range 2 {
				i := (first + n) % 2
				start := time.Now()
				if err := ops[i](ctx, k); err != nil {
					return err
				}
				sums[i].Add(int64(time.Since(start)))
			}
			return nil
		})
		b.ReportMetric(float64(pkNs.Load())/float64(replayNs.Load()), "pk/replay")
	})
}
