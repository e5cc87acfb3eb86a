package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/testdb"
	"github.com/idemstore/idem/internal/workload"
	idempg "github.com/idemstore/idem/postgres"
)

// BenchmarkReplayDo compares a replay through Store.Do (its read on the
// pool first) with the bare primary-key SELECT of the same rows, from 8
// goroutines on a pool of 8: the pair of issue 17's replay target.
func BenchmarkReplayDo(b *testing.B) {
	ctx := context.Background()
	url := testdb.PostgresURL(b)
	schema := testdb.Name()
	setup := benchPGPool(ctx, b, url, "public", 2)
	benchPGExec(ctx, b, setup, "CREATE SCHEMA "+schema)
	b.Cleanup(func() { _, _ = setup.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
	pool := benchPGPool(ctx, b, url, schema, 8)
	if err := idempg.Migrate(ctx, pool); err != nil {
		b.Fatal(err)
	}
	store, err := idem.New(idempg.New(pool), &idem.Config{ReplayRead: idem.ReplayReadAlways})
	if err != nil {
		b.Fatal(err)
	}
	type sk struct{ scope, key string }
	keys := make([]sk, 200)
	for i := range keys {
		keys[i] = sk{fmt.Sprintf("tenant-%02d", i%10), workload.NewKey()}
	}
	noop := func(context.Context, pgx.Tx, string) error { return nil }
	if err := workload.Complete(ctx, store, noop, len(keys), func(i int) (string, string) { return keys[i].scope, keys[i].key }); err != nil {
		b.Fatal(err)
	}
	run := func(b *testing.B, op func(ctx context.Context, k sk) error) {
		b.SetParallelism(4) // 8 goroutines on 2 cores
		b.ReportAllocs()
		var before, after syscall.Rusage
		_ = syscall.Getrusage(syscall.RUSAGE_SELF, &before)
		defer func() {
			_ = syscall.Getrusage(syscall.RUSAGE_SELF, &after)
			cpu := time.Duration(after.Utime.Nano() + after.Stime.Nano() - before.Utime.Nano() - before.Stime.Nano())
			b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
		}()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := op(ctx, keys[rand.IntN(len(keys))]); err != nil { //nolint:gosec // workload randomness
					b.Error(err)
					return
				}
			}
		})
	}
	pkOp := func(ctx context.Context, k sk) error {
		var (
			status       int16
			fp, hdr, bdy []byte
			code         int32
		)
		return pool.QueryRow(ctx, benchPGSelect, k.scope, k.key).Scan(&status, &fp, &code, &hdr, &bdy)
	}
	replayOp := func(ctx context.Context, k sk) error {
		res, err := store.Do(ctx, k.scope, k.key, workload.Fingerprint, func(context.Context, pgx.Tx) (*idem.Response, error) {
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
	scan5 := func(row pgx.Row) error {
		var (
			status       int16
			fp, hdr, bdy []byte
			code         *int32
		)
		return row.Scan(&fp, &status, &code, &hdr, &bdy)
	}
	b.Run("gcsql", func(b *testing.B) {
		run(b, func(ctx context.Context, k sk) error {
			return scan5(pool.QueryRow(ctx, `SELECT fingerprint, status, response_status, response_headers, response_body
FROM idempotency_keys
WHERE scope = $1::text AND idempotency_key = $2::text
	AND expires_at > COALESCE($3::timestamptz, clock_timestamp())`, k.scope, k.key, nil))
		})
	})
	b.Run("gcsql2", func(b *testing.B) {
		run(b, func(ctx context.Context, k sk) error {
			return scan5(pool.QueryRow(ctx, `SELECT fingerprint, status, response_status, response_headers, response_body
FROM idempotency_keys
WHERE scope = $1 AND idempotency_key = $2 AND expires_at > clock_timestamp()`, k.scope, k.key))
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
